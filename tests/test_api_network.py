"""The node API over TCP, as an apiserver or a remote trainer uses it: plain http and https on
loopback behind a bearer token, the SDK on top, and a daemon that refuses to listen on TCP
without a token."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path

import pytest

import dsec
from dsec_core.api.routes import ROUTES
from dsec_core.api.transport import HTTPTransport

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root")


def _round_trip(client, layer: str) -> None:
    """What a trainer does: create, exec, files, a session, kill."""
    with client.create(layers=(layer,), memory="64M") as sb:
        r = sb.exec(["sh", "-c", "echo $0 $X; cat", "hi"], env={"X": "there"}, stdin=b"in")
        assert (r.exit_code, r.stdout) == (0, b"hi there\nin")
        sb.write_file("/tmp/f", b"\x00data" * 1000)
        assert sb.read_file("/tmp/f") == b"\x00data" * 1000
        assert [e.name for e in sb.list_dir("/tmp")] == ["f"]
        assert sb.stat("/tmp/f").size == 5000
        sb.remove("/tmp/f")
        with sb.session() as ses:
            ses.exec("cd /tmp; Y=1")
            assert ses.exec("echo $PWD $Y").stdout == b"/tmp 1\n"
        assert sb.id in {i.id for i in client.list()}
    assert sb.id not in {i.id for i in client.list()}


@pytest.mark.parametrize("scheme", ["http", "https"])
def test_sdk_over_tcp(network_node, scheme):
    address = network_node.http if scheme == "http" else network_node.https
    with dsec.Client(address, token=network_node.token, verify=network_node.ca) as client:
        assert client.node_info()["home"] == os.fspath(network_node.node.home)
        _round_trip(client, network_node.node.layer.ref)


async def test_async_sdk_over_tls(network_node):
    async with dsec.AsyncClient(
        network_node.https, token=network_node.token, verify=network_node.ca
    ) as client:
        sbs = await client.create_many(layers=(network_node.node.layer.ref,), n=2, memory="64M")
        try:
            results = await asyncio.gather(*(sb.exec(["echo", sb.id]) for sb in sbs))
            assert [r.stdout for r in results] == [f"{sb.id}\n".encode() for sb in sbs]
            await sbs[0].write_file("/tmp/x", "text")
            assert await sbs[0].read_file("/tmp/x") == b"text"
        finally:
            await asyncio.gather(*(sb.kill() for sb in sbs))


@pytest.mark.parametrize("token", [None, "wrong", ""])
def test_tcp_refuses_a_missing_or_wrong_token(network_node, token):
    for address in (network_node.http, network_node.https):
        with dsec.Client(address, token=token, verify=network_node.ca) as client:
            with pytest.raises(dsec.AuthenticationFailed, match="bearer token"):
                client.list()
            with pytest.raises(dsec.AuthenticationFailed):
                client.create(layers=(network_node.node.layer.ref,))
    t = HTTPTransport(network_node.http, token=token)
    r = t.request("GET", ROUTES["openapi"].path, timeout=10)
    t.close()
    assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
    assert r.json()["error"]["type"] == "AuthenticationFailed"


def test_the_unix_socket_needs_no_token(network_node):
    with network_node.node.client() as client:
        assert client.list() == []


def test_tls_is_checked(network_node):
    # the self-signed certificate is in no system store: a typed NodeUnavailable
    with dsec.Client(network_node.https, token=network_node.token) as client:
        with pytest.raises(dsec.NodeUnavailable, match="CERTIFICATE_VERIFY_FAILED"):
            client.list()
    with dsec.Client(network_node.https, token=network_node.token, verify=False) as client:
        assert client.list() == []
    # plain http to the TLS port is no answer either
    plain = network_node.https.replace("https://", "http://")
    with dsec.Client(plain, token=network_node.token) as client:
        with pytest.raises(dsec.DsecError):
            client.list()
    with pytest.raises(dsec.InvalidSpec, match="CA file"):
        dsec.Client(network_node.https, token="t", verify="/no/such/ca.pem")


def test_client_reads_address_and_token_from_the_environment(network_node, monkeypatch):
    monkeypatch.setenv("DSEC_ADDRESS", network_node.http)
    monkeypatch.setenv("DSEC_TOKEN", network_node.token)
    with dsec.Client() as client:
        assert client.address == network_node.http
        assert client.node_info()["pid"] > 0
    with dsec.Client(network_node.http) as client:  # an explicit address: no token from env
        with pytest.raises(dsec.AuthenticationFailed):
            client.list()


def test_kept_alive_connections_survive_a_server_closing_them(network_node):
    # The daemon closes idle connections after its keep-alive timeout; simulate it by
    # closing every pooled connection's socket under the transport.
    with dsec.Client(network_node.http, token=network_node.token) as client:
        client.list()
        for sock in client._http._idle:
            sock.shutdown(2)
        assert client.list() == []


# --- a daemon refuses what it cannot serve safely -------------------------------------------


def _start(tmp_path: Path, **env: str) -> subprocess.CompletedProcess:
    full = dict(os.environ, DSEC_HOME=os.fspath(tmp_path / "home"), **env)
    for key in ("DSEC_API_TOKEN", "DSEC_TLS_CERT", "DSEC_TLS_KEY"):
        if key not in env:
            full.pop(key, None)
    return subprocess.run(
        [sys.executable, "-m", "dsec_core.cli", "node", "start"],
        env=full,
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_no_tcp_without_a_token(tmp_path):
    out = _start(tmp_path, DSEC_LISTEN="http://127.0.0.1:1")
    assert out.returncode == 1 and "Traceback" not in out.stderr
    assert "Error: refusing to listen on http://127.0.0.1:1 without an API token" in out.stderr
    # the daemon itself refuses too, should anything start it without the check
    env = dict(os.environ, DSEC_HOME=os.fspath(tmp_path / "home"), DSEC_LISTEN="http://127.0.0.1:1")
    env.pop("DSEC_API_TOKEN", None)
    out = subprocess.run(
        [sys.executable, "-m", "dsec_core.node.daemon"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 1 and "without an API token" in out.stderr


def test_no_https_without_a_certificate(tmp_path):
    out = _start(tmp_path, DSEC_LISTEN="https://127.0.0.1:1", DSEC_API_TOKEN="t")
    assert out.returncode == 1 and "needs DSEC_TLS_CERT and DSEC_TLS_KEY" in out.stderr
    (tmp_path / "junk.pem").write_text("not a certificate")
    out = _start(
        tmp_path,
        DSEC_LISTEN="https://127.0.0.1:1",
        DSEC_API_TOKEN="t",
        DSEC_TLS_CERT=os.fspath(tmp_path / "junk.pem"),
        DSEC_TLS_KEY=os.fspath(tmp_path / "junk.pem"),
    )
    assert out.returncode == 1 and "cannot load DSEC_TLS_CERT" in out.stderr
    out = _start(tmp_path, DSEC_LISTEN="ftp://127.0.0.1:1", DSEC_API_TOKEN="t")
    assert out.returncode == 1 and "bad address" in out.stderr
