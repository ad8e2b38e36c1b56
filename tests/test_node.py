"""The node as a whole: bad input, failure paths that must leave nothing, and restarts."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import dsec
from dsec_core.config import NodeConfig
from dsec_core.layers.build import build_layer
from dsec_core.layers.store import LayerStore
from dsec_core.linux.cgroups import hierarchies, memory_limit
from dsec_core.localnode import daemon_pid, ensure_daemon, stop_daemon
from dsec_core.testing import leftovers, running_kit_node


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False


@pytest.fixture(scope="module", autouse=True)
def _shared_node_starts_empty(dsec_node):
    """This module checks that the whole shared node is clean after each failure path; a module
    that ran before it on this worker may have left sandboxes running there on purpose (FnCall
    pool members idle until their timeout, a test's sandbox with a long ttl): they are not
    leaks, but they are not this module's either. Kill what the node lists first, and say what
    it was (a CI run once failed five checks here on one such container)."""
    with dsec_node.client() as client:
        for info in client.list():
            print(f"test_node: killing {info.id} left running on the shared node: {info.labels}")
            client.kill(info.id)


def _assert_clean(home: Path, sandbox_id: str | None = None) -> None:
    left = leftovers(home)
    if sandbox_id is None:
        assert left["sandbox_dirs"] == [], left
        assert [m for m in left["mounts"] if "/sandboxes/" in m] == [], left
        assert left["cgroups"] == [] and left["processes"] == [], left
    else:
        assert sandbox_id not in left["sandbox_dirs"]
        assert not [m for m in left["mounts"] if sandbox_id in m]


# --- bad input gets typed errors and leaves nothing ------------------------------------------


def test_unknown_layer_names_known(dsec_sandboxes, dsec_node):
    with pytest.raises(dsec.UnknownLayer) as e:
        dsec_sandboxes.create(layers=("no-such-layer@1",))
    assert "no-such-layer@1" in str(e.value) and "kit-base@1" in str(e.value)
    _assert_clean(dsec_node.home)


def test_unknown_backend_names_known(dsec_sandboxes, dsec_node):
    with pytest.raises(dsec.UnknownBackend) as e:
        dsec_sandboxes.create(backend="warp-drive")
    assert "warp-drive" in str(e.value) and "container" in str(e.value)


def test_unknown_environment(dsec_sandboxes):
    with pytest.raises(dsec.UnknownEnvironment) as e:
        dsec_sandboxes.create(layers=(), environment="no-such-env")
    assert "no-such-env" in str(e.value)


def test_unknown_sandbox(dsec_client):
    with pytest.raises(dsec.UnknownSandbox):
        dsec_client.exec("deadbeef0000", "true")
    with pytest.raises(dsec.UnknownSandbox):
        dsec_client.kill("deadbeef0000")


def test_invalid_spec_is_typed():
    with pytest.raises(dsec.InvalidSpec):
        dsec.SandboxSpec(layers=("kit-base@1",), memory="lots")
    with pytest.raises(dsec.InvalidSpec):
        _ = dsec.SandboxSpec(layers=("kit-base@1",), memory="1M").limits
    with pytest.raises(dsec.InvalidSpec):
        dsec.SandboxSpec()


def test_admission_rejects_beyond_capacity(dsec_sandboxes, dsec_node):
    with pytest.raises(dsec.AdmissionRejected) as e:
        dsec_sandboxes.create(memory="4T")
    assert "memory" in str(e.value)
    with pytest.raises(dsec.AdmissionRejected):
        dsec_sandboxes.create(cpu=1000)
    _assert_clean(dsec_node.home)


def test_corrupt_layer_image_fails_cleanly(dsec_sandboxes, dsec_node, tmp_path):
    junk = tmp_path / "junk.erofs"
    junk.write_bytes(os.urandom(1 << 16))
    info = LayerStore(dsec_node.config.layer_dir).add(junk, name="junk", version="1", kind="base")
    with pytest.raises(dsec.MountError):
        dsec_sandboxes.create(layers=("junk@1",))
    _assert_clean(dsec_node.home)
    assert not (dsec_node.config.mount_dir / info.digest.split(":")[1][:32]).exists()


def test_runtime_failure_fails_cleanly(dsec_sandboxes, dsec_node, tmp_path):
    # A layer whose /.dsec is a file: runc cannot mount the agent there and fails to start.
    rootfs = tmp_path / "bad"
    rootfs.mkdir()
    (rootfs / ".dsec").write_text("in the way")
    store = LayerStore(dsec_node.config.layer_dir)
    build_layer(rootfs, name="blocker", version="1", kind="toolkit", store=store)
    with pytest.raises(dsec.DsecError) as e:
        dsec_sandboxes.create(layers=("blocker@1", dsec_node.layer.ref))
    assert "runc" in str(e.value)
    _assert_clean(dsec_node.home)
    assert not list((dsec_node.config.run_dir / "runc").iterdir())


# --- the SDK ---------------------------------------------------------------------------------


def test_async_client_same_methods():
    sync = {n for n in dir(dsec.Client) if not n.startswith("_")}
    asyn = {n for n in dir(dsec.AsyncClient) if not n.startswith("_")}
    assert sync == asyn


async def test_async_client_end_to_end(dsec_node):
    async with dsec.AsyncClient(os.fspath(dsec_node.config.socket_path)) as client:
        sbs = await client.create_many(layers=(dsec_node.layer.ref,), n=3, memory="64M")
        try:
            results = await asyncio.gather(*(sb.exec(["echo", sb.id]) for sb in sbs))
            assert [r.stdout for r in results] == [f"{sb.id}\n".encode() for sb in sbs]
            async with await sbs[0].session() as ses:
                await ses.exec("cd /tmp")
                assert (await ses.exec("pwd")).stdout == b"/tmp\n"
            await sbs[0].write_file("/tmp/f", "text")
            assert await sbs[0].read_file("/tmp/f") == b"text"
        finally:
            await asyncio.gather(*(sb.kill() for sb in sbs))
    _assert_clean(dsec_node.home)


def test_sandbox_context_manager_kills(dsec_client, dsec_node):
    with dsec_client.create(layers=(dsec_node.layer.ref,), memory="64M") as sb:
        assert sb.exec("echo hi").text == "hi\n"
    with pytest.raises(dsec.UnknownSandbox):
        dsec_client.get(sb.id)


# --- restarts: sandboxes outlive the daemon and are re-adopted -------------------------------


@pytest.fixture
def private_node():
    """A node of its own, for tests that stop and restart the daemon."""
    if os.geteuid() != 0:
        pytest.skip("needs root")
    with running_kit_node("dsec-restart-") as node:
        yield node


@pytest.mark.parametrize("how", ["stop", "sigkill"])
def test_daemon_restart_readopts(private_node, how):
    cfg = private_node.config
    with private_node.client() as c:
        keep = c.create(layers=(private_node.layer.ref,), memory="64M")
        short = c.create(layers=(private_node.layer.ref,), memory="64M", ttl=2)
        doomed = c.create(layers=(private_node.layer.ref,), memory="64M")
        keep.write_file("/root/state", b"before restart")
        keep.exec("sleep 3000 > /dev/null 2>&1 &", background=True).check()
        init_pid = keep.info.pid
        doomed_pid = doomed.info.pid
    old = daemon_pid(cfg)
    if how == "stop":
        stop_daemon(cfg)
    else:
        os.kill(old, signal.SIGKILL)
        deadline = time.monotonic() + 5
        while _alive(old) and time.monotonic() < deadline:
            time.sleep(0.02)
    assert _alive(init_pid), "sandbox died with its daemon"
    os.kill(doomed_pid, signal.SIGKILL)  # one dies while no daemon watches
    time.sleep(2.5)  # the short one's ttl passes while no daemon runs
    ensure_daemon(cfg)
    with private_node.client() as c:
        ids = {i.id for i in c.list()}
        assert keep.id in ids and short.id not in ids and doomed.id not in ids
        # the restarted daemon still knows that one died, and does not confuse it with a
        # sandbox whose time ran out
        with pytest.raises(dsec.SandboxDied, match="died on its own"):
            c.exec(doomed.id, "true")
        with pytest.raises(dsec.UnknownSandbox) as gone:
            c.exec(short.id, "true")
        assert not isinstance(gone.value, dsec.SandboxDied)
        again = c.get(keep.id)
        assert again.read_file("/root/state") == b"before restart"
        assert b"sleep 3000" in again.exec("ps").stdout
        again.kill()
    _assert_clean(private_node.home)


def test_sandboxes_outlive_client_process(private_node):
    code = (
        "import dsec, sys; c = dsec.Client(sys.argv[1]); "
        "sb = c.create(layers=(sys.argv[2],), memory='64M'); print(sb.id)"
    )
    out = subprocess.run(
        [
            sys.executable,
            "-c",
            code,
            os.fspath(private_node.config.socket_path),
            private_node.layer.ref,
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    sid = out.stdout.strip()
    with private_node.client() as c:
        assert c.exec(sid, "echo here").stdout == b"here\n"
        c.kill(sid)


def test_create_many_is_all_or_nothing(dsec_client, dsec_node):
    # Each fits alone; together they exceed the node's memory, so some are rejected and the
    # SDK removes the ones that were made.
    per = dsec_node.config.memory_capacity // 3 + (64 << 20)
    before = {i.id for i in dsec_client.list()}
    with pytest.raises(dsec.AdmissionRejected):
        dsec_client.create_many(layers=(dsec_node.layer.ref,), memory=per, n=3)
    assert {i.id for i in dsec_client.list()} == before
    if not before:
        _assert_clean(dsec_node.home)


def test_explicit_layers_stack_on_an_environment(dsec_client, dsec_node, tmp_path):
    from dsec_core.catalog import CatalogStore, parse_catalog

    extra = tmp_path / "extra"
    (extra / "opt").mkdir(parents=True)
    (extra / "opt" / "tool").write_text("extra layer\n")
    store = LayerStore(dsec_node.config.layer_dir)
    build_layer(extra, name="extra-tool", version="1", kind="toolkit", store=store)
    catalog = parse_catalog(
        {
            "name": "kit",
            "layers": [],
            "environments": [
                {"name": "kit-env", "base": dsec_node.layer.ref, "env": {"FROM_ENV": "yes"}}
            ],
        },
        where="test",
        root=tmp_path,
        store=store,
    )
    CatalogStore(dsec_node.config.catalog_dir).save(catalog)
    with dsec_client.create(environment="kit-env", layers=("extra-tool@1",), memory="64M") as sb:
        assert sb.info.layers == ("extra-tool@1", dsec_node.layer.ref)
        assert sb.exec("cat /opt/tool; echo $FROM_ENV").stdout == b"extra layer\nyes\n"


def test_policies_over_the_api_and_the_cli(dsec_sandboxes, dsec_node):
    sb = dsec_sandboxes.create()
    states = {p.name: p.state for p in sb.policies()}
    assert states == sb.info.policies  # what create reported is what inspect shows
    with pytest.raises(dsec.PolicyUnavailable) as e:
        sb.set_policy("no-such-policy-here", {"x": 1})
    assert e.value.policy == "no-such-policy-here"
    env = dict(os.environ, DSEC_HOME=os.fspath(dsec_node.home))
    out = subprocess.run(
        [sys.executable, "-m", "dsec_core.cli", "sandbox", "inspect", sb.id, "--json"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    assert doc["sandbox"]["id"] == sb.id and doc["usage"]["pids"] >= 1
    assert {p["name"] for p in doc["policies"]} == set(states)


# --- the daemon's own cgroups ---------------------------------------------------------------
def _cgroups_of(pid: int) -> dict[str, str]:
    """controller (or "" for cgroup v2) -> cgroup path, from /proc/PID/cgroup."""
    out = {}
    for line in Path(f"/proc/{pid}/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        for c in controllers.split(",") if controllers else [""]:
            out[c] = path
    return out


def test_daemon_runs_confined_in_its_own_cgroups(monkeypatch):
    if os.geteuid() != 0:
        pytest.skip("needs root")
    monkeypatch.setenv("DSEC_DAEMON_MEMORY", "300M")
    with running_kit_node("dsec-cgroup-") as node:
        cfg = node.config
        mine = "/" + cfg.daemon_cgroup
        dirs = [h / cfg.daemon_cgroup for h in hierarchies()]
        pid = daemon_pid(cfg)
        assert pid is not None
        own = _cgroups_of(pid)
        assert {own.get(c, own.get("")) for c in ("memory", "pids")} == {mine}, own
        # the memory hierarchy's (v1) or the one cgroup's (v2) limit; pids has none
        assert [limit for d in dirs if (limit := memory_limit(d))] == [300 << 20]
        with node.client() as c:
            sb = c.create(layers=(node.layer.ref,), memory="64M")
            sb.exec("sleep 1000 > /dev/null 2>&1 &", background=True).check()
            init = sb.info.pid
            assert init is not None
            # runc places the sandbox by absolute path: never inside the daemon's cgroups
            assert _cgroups_of(init)["memory" if "memory" in own else ""] == f"/dsec/{sb.id}"
            held = {int(p) for d in dirs for p in (d / "cgroup.procs").read_text().split()}
            assert init not in held and pid in held
            sandbox = {
                int(p)
                for h in hierarchies()
                for p in (h / "dsec" / sb.id / "cgroup.procs").read_text().split()
            }
            assert len(sandbox) >= 2 and not sandbox & held  # the agent and its sleep
        stop_daemon(cfg)
        assert [d for d in dirs if d.exists()] == [], "the stopped daemon left its cgroups"
        ensure_daemon(cfg)  # a new daemon confines itself again; the sandbox is re-adopted
        assert _cgroups_of(daemon_pid(cfg) or 0).get("pids", "") in (mine, "")
        with node.client() as c:
            assert c.get(sb.id).exec("echo adopted").stdout == b"adopted\n"


def test_daemon_memory_setting(monkeypatch):
    monkeypatch.setenv("DSEC_DAEMON_MEMORY", "1G")
    assert NodeConfig.from_env().daemon_memory == 1 << 30
    monkeypatch.setenv("DSEC_DAEMON_MEMORY", "0")
    assert NodeConfig.from_env().daemon_memory == 0  # not confined
    monkeypatch.setenv("DSEC_DAEMON_MEMORY", "plenty")
    with pytest.raises(dsec.InvalidSpec) as e:
        NodeConfig.from_env()
    assert "DSEC_DAEMON_MEMORY" in str(e.value)
    one, other = NodeConfig(home=Path("/a")), NodeConfig(home=Path("/b"))
    assert one.daemon_cgroup.startswith("dsec-daemon/") and one.daemon_cgroup != other.daemon_cgroup
