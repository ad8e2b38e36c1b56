"""IAM on a real etcd (Debian's etcd-server on loopback): what only etcd shows. Secrets never
reach etcd's files, big revocations fit its transaction limit, an unreachable or lost etcd is
a typed ``IamUnavailable``, and the test server leaves nothing behind."""

from __future__ import annotations

import os
import signal
import tempfile
import time
import urllib.request
from pathlib import Path

import pytest

from dsec_core.errors import AuthenticationFailed, IamUnavailable
from dsec_core.iam import EtcdStore, Iam
from dsec_core.testing.etcd import etcd_server
from dsec_core.testing.procs import free_port


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_secrets_never_reach_etcds_files_and_the_server_cleans_up():
    with etcd_server() as etcd:
        with Iam.open(etcd.url("files")) as iam:
            iam.create_project("org")
            info, secret = iam.create_key("org", "admin", "ops")
            assert iam.authenticate(secret).key_id == info.key_id
        raw = b"".join(
            p.read_bytes() for p in etcd.data_dir.rglob("*") if p.is_file() and p.suffix != ".log"
        )
        assert info.key_id.encode() in raw  # the scan reads etcd's data: its wal holds the key
        assert secret.encode() not in raw
        assert secret.rsplit("_", 1)[1].encode() not in raw
        pid, data_dir = etcd.pid, etcd.data_dir
        with urllib.request.urlopen(f"{etcd.endpoint}/health", timeout=2) as answer:
            assert answer.status == 200
    assert not _alive(pid)
    assert not data_dir.exists()


def test_big_forced_revocations_fit_etcds_transaction_limit():
    with etcd_server() as etcd, Iam.open(etcd.url("big")) as iam:
        iam.create_project("org")
        for i in range(60):
            iam.create_project(f"org/p{i}")
        secrets = [iam.create_key(f"org/p{i % 60}", "agent", f"k{i}")[1] for i in range(150)]
        gone = iam.revoke_project("org", force=True)
        assert len(gone.projects) == 61 and len(gone.keys) == 150
        assert iam.projects() == [] and iam.keys() == []
        store = iam.store
        assert isinstance(store, EtcdStore) and store.scan("") == {}
        with pytest.raises(AuthenticationFailed):
            iam.authenticate(secrets[0])


def test_an_unreachable_etcd_is_iam_unavailable():
    with Iam.open(f"etcd://127.0.0.1:{free_port()}/x") as iam:
        with pytest.raises(IamUnavailable) as err:
            iam.create_project("org")
        assert err.value.http_status == 503 and "cannot reach etcd" in str(err.value)
        with pytest.raises(IamUnavailable):
            iam.authenticate("dsk_" + "0" * 16 + "_" + "1" * 64)


def test_losing_etcd_mid_run_is_iam_unavailable_and_cached_keys_lapse():
    with etcd_server() as etcd:
        iam = Iam.open(etcd.url("lost"), cache_ttl=0.3)
        iam.create_project("org")
        _, secret = iam.create_key("org", "member")
        assert iam.authenticate(secret).project == "org"
        os.kill(etcd.pid, signal.SIGKILL)  # the context manager reaps it on the way out
        time.sleep(0.35)  # past the cache's ttl: the key must be checked again
        with pytest.raises(IamUnavailable):
            iam.authenticate(secret)
        with pytest.raises(IamUnavailable):
            iam.projects()
        iam.close()


def test_an_etcd_that_cannot_start_leaves_nothing_behind(tmp_path):
    before = set(Path(tempfile.gettempdir()).glob("dsec-etcd-*"))
    with pytest.raises(RuntimeError, match="etcd did not start"):
        with etcd_server("false", start_timeout=2):  # exits at once, each of its three tries
            pass
    with pytest.raises(FileNotFoundError):
        with etcd_server(str(tmp_path / "no-such-etcd")):
            pass
    assert set(Path(tempfile.gettempdir()).glob("dsec-etcd-*")) <= before
