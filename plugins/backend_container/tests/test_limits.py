"""Sandboxes see their own limits: CPUs and memory through lxcfs and a cpuset, their cgroups
read-only at /sys/fs/cgroup; and the node's lxcfs starts, dies, is re-adopted and goes away
cleanly.

The tools that read these files are the host's own (procps ``free`` and ``uptime``, coreutils
``nproc``, glibc ``getconf``, the system python), copied with their libraries into a layer:
busybox's ``free`` and ``uptime`` ask sysinfo(2), which lxcfs cannot change
(docs/operators/limits.md).
They are called by their paths: the kit's busybox shell runs its own applet for a bare name.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from dsec_backend_container.cpus import CpuPinning, host_cpus, parse_cpus
from dsec_backend_container.lxcfs import LXCFS_FILES
from dsec_backend_container.runc import ContainerBackend

import dsec
from dsec_core.config import NodeConfig
from dsec_core.layers.build import build_layer
from dsec_core.layers.store import LayerStore
from dsec_core.linux.cgroups import hierarchies
from dsec_core.localnode import daemon_pid, ensure_daemon, stop_daemon
from dsec_core.testing import (
    KitNode,
    SandboxRecorder,
    leftovers,
    make_busybox_rootfs,
    running_kit_node,
)

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="a dsec node needs root")

MiB = 1 << 20
HOST_TOOLS = ("/usr/bin/free", "/usr/bin/uptime", "/usr/bin/nproc", "/usr/bin/getconf")
SYSTEM_PYTHON = Path("/usr/bin/python3")
HOST_CPUS = len(host_cpus())


def _copy_with_libraries(binary: str, root: Path) -> None:
    """``binary`` and every shared library ``ldd`` names for it, at the same paths."""
    out = subprocess.run(["ldd", binary], capture_output=True, text=True, check=True).stdout
    paths = [binary] + [w for line in out.splitlines() for w in line.split() if w.startswith("/")]
    for path in paths:
        dest = root / path.lstrip("/")
        dest.parent.mkdir(parents=True, exist_ok=True)
        if dest.is_symlink() or dest.exists():
            dest.unlink()
        shutil.copy2(os.path.realpath(path), dest)


def _host_tools_rootfs(root: Path) -> bool:
    """A busybox root with the host's procps, coreutils nproc, getconf and, if the host has
    one, its system python (with the little of its library ``-I -S`` needs); True if python
    is there."""
    make_busybox_rootfs(root)
    for tool in HOST_TOOLS:
        if not os.access(tool, os.X_OK):
            pytest.skip(f"{tool} is not installed (procps, coreutils, libc-bin)")
        _copy_with_libraries(tool, root)
    python = Path(os.path.realpath(SYSTEM_PYTHON))
    stdlib = Path("/usr/lib") / python.name
    if not (python.exists() and (stdlib / "encodings").is_dir()):
        return False
    _copy_with_libraries(os.fspath(python), root)
    (root / "usr/bin/python3").symlink_to(python.name)
    lib = root / "usr/lib" / python.name
    shutil.copytree(stdlib / "encodings", lib / "encodings")
    shutil.copy2(stdlib / "os.py", lib / "os.py")
    (lib / "lib-dynload").mkdir()
    return True


@pytest.fixture(scope="module")
def node() -> Iterator[KitNode]:
    with running_kit_node("dsec-limits-") as node:
        yield node


@pytest.fixture(scope="module")
def tools(node: KitNode) -> tuple[str, bool]:
    """The host-tools layer's ref, and whether it has a python."""
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp) / "rootfs"
        has_python = _host_tools_rootfs(root)
        info = build_layer(
            root,
            name="host-tools",
            version="1",
            kind="base",
            store=LayerStore(node.config.layer_dir),
        )
    return info.ref, has_python


@pytest.fixture
def client(node: KitNode) -> Iterator[SandboxRecorder]:
    """Creates sandboxes on the module's node (``create(**spec)``); kills them all after."""
    with node.client() as c:
        rec = SandboxRecorder(c, {"backend": "container", "layers": (node.layer.ref,)})
        try:
            yield rec
        finally:
            rec.cleanup()


def _run(sb, cmd: str) -> str:
    res = sb.exec(cmd)
    assert res.exit_code == 0, (cmd, res.stdout, res.stderr)
    return res.stdout.decode()


def _mem_total_kib(meminfo: str) -> int:
    line = next(x for x in meminfo.splitlines() if x.startswith("MemTotal:"))
    return int(line.split()[1])


# --- what a sandbox sees ----------------------------------------------------------------------


def test_one_cpu_sandbox_counts_one_cpu_everywhere(client, tools):
    ref, has_python = tools
    sb = client.create(layers=(ref,), cpu=1, memory="256M")
    assert _run(sb, "/usr/bin/nproc").strip() == "1"  # sched_getaffinity: the cpuset
    assert _run(sb, "getconf _NPROCESSORS_ONLN").strip() == "1"  # /sys/.../cpu/online
    assert _run(sb, "grep -c ^processor /proc/cpuinfo").strip() == "1"
    assert _run(sb, "grep -c '^cpu[0-9]' /proc/stat").strip() == "1"
    assert len(parse_cpus(_run(sb, "cat /sys/devices/system/cpu/online"))) == 1
    if not has_python:
        pytest.skip("the host has no system python to copy in for os.cpu_count()")
    code = "import os; print(os.cpu_count(), len(os.sched_getaffinity(0)))"
    out = _run(sb, f"python3 -I -S -c '{code}'")
    assert out.split() == ["1", "1"]


def test_256m_sandbox_sees_256m(client, tools):
    ref, _ = tools
    sb = client.create(layers=(ref,), cpu=1, memory="256M")
    assert _mem_total_kib(_run(sb, "cat /proc/meminfo")) == 256 * 1024
    mem = next(x for x in _run(sb, "/usr/bin/free -k").splitlines() if x.startswith("Mem:"))
    assert int(mem.split()[1]) == 256 * 1024  # procps free reads /proc/meminfo
    assert _run(sb, "/usr/bin/free -m").split("\n")[1].split()[1] == "256"
    swap = next(x for x in _run(sb, "/usr/bin/free -k").splitlines() if x.startswith("Swap:"))
    assert int(swap.split()[1]) <= 256 * 1024


def test_uptime_and_load_are_the_sandbox_own(client, tools):
    ref, _ = tools
    host_up = float(Path("/proc/uptime").read_text().split()[0])
    sb = client.create(layers=(ref,), cpu=1, memory="256M")
    up = float(_run(sb, "cat /proc/uptime").split()[0])
    assert 0 <= up < 120 and (host_up < 120 or up < host_up - 60)
    # procps, from /proc/uptime and /proc/loadavg: " 12:30:19 up 0 min,  0 users,  load ..."
    shown = _run(sb, "/usr/bin/uptime").split(" up ")[1].split(",")[0].strip()
    assert shown in ("0 min", "1 min", "2 min"), shown
    # the run queue is the sandbox's own: its few tasks, not the host's
    load = _run(sb, "cat /proc/loadavg").split()
    tasks = int(load[3].split("/")[1])
    host_tasks = int(Path("/proc/loadavg").read_text().split()[3].split("/")[1])
    assert tasks < 20 and (host_tasks < 20 or tasks < host_tasks)


def test_cgroup_is_visible_read_only(client, node):
    sb = client.create(layers=(node.layer.ref,), cpu=0.5, memory="256M")
    v2 = sb.exec("test -e /sys/fs/cgroup/cgroup.controllers").exit_code == 0
    if v2:
        limit, quota = "/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/cpu.max"
        assert _run(sb, f"cat {quota}").split() == ["50000", "100000"]
    else:
        limit, quota = "/sys/fs/cgroup/memory/memory.limit_in_bytes", ""
        assert _run(sb, "cat /sys/fs/cgroup/cpu/cpu.cfs_quota_us").strip() == "50000"
        assert len(parse_cpus(_run(sb, "cat /sys/fs/cgroup/cpuset/cpuset.cpus"))) == 1
    assert int(_run(sb, f"cat {limit}")) == 256 * MiB
    # a cgroup namespace: the sandbox's cgroup is its root
    assert all(line.endswith(":/") for line in _run(sb, "cat /proc/self/cgroup").splitlines())
    for write in (
        f"echo 1073741824 > {limit}",
        "touch /sys/fs/cgroup/x",
        f"mkdir {os.path.dirname(limit)}/child",
    ):
        res = sb.exec(write)
        assert res.exit_code != 0 and b"Read-only file system" in res.stderr, (write, res)
    assert int(_run(sb, f"cat {limit}")) == 256 * MiB
    host = [h / "dsec" / sb.id for h in hierarchies()]
    assert all(not (d / "child").exists() for d in host)


def test_sandbox_as_big_as_the_host_is_not_pinned(client, tools):
    ref, _ = tools
    sb = client.create(layers=(ref,), cpu=HOST_CPUS, memory="1G")
    assert _run(sb, "/usr/bin/nproc").strip() == str(HOST_CPUS)
    assert _run(sb, "getconf _NPROCESSORS_ONLN").strip() == str(HOST_CPUS)
    assert _mem_total_kib(_run(sb, "cat /proc/meminfo")) == 1024 * 1024
    half = client.create(layers=(ref,), cpu=0.5, memory="64M")
    assert _run(half, "/usr/bin/nproc").strip() == "1"  # ceil(0.5)
    assert _mem_total_kib(_run(half, "cat /proc/meminfo")) == 64 * 1024


@pytest.mark.skipif(HOST_CPUS < 2, reason="one core: nothing to spread over")
def test_one_cpu_sandboxes_are_spread_over_cores(client, node):
    a = client.create(layers=(node.layer.ref,), cpu=1, memory="64M")
    b = client.create(layers=(node.layer.ref,), cpu=1, memory="64M")
    cores = [_run(sb, "cat /sys/fs/cgroup/cpuset/cpuset.cpus").strip() for sb in (a, b)]
    assert cores[0] != cores[1]


def test_pinning_takes_the_least_committed_cores():
    p = CpuPinning([0, 1, 2, 3])
    assert p.pick("a", 1) == [0]
    assert p.pick("b", 2) == [1, 2]
    assert p.pick("c", 0.5) == [3]
    assert p.pick("d", 0.25) == [3]  # 0.5 + 0.25 on 3 < 1 on 0
    assert p.pick("e", 4) is None  # every core: not pinned
    p.release("a")
    assert p.pick("f", 1) == [0]
    p.add("a", [0], 1)
    p.add("a", [0], 1)  # counted once
    assert p.load[0] == 2


# --- the node's lxcfs -------------------------------------------------------------------------


def _lxcfs_pid(node: KitNode) -> int | None:
    try:
        return int((node.config.run_dir / "lxcfs.pid").read_text())
    except (OSError, ValueError):
        return None


def _lxcfs_cgroups(node: KitNode) -> list[Path]:
    import hashlib

    digest = hashlib.sha256(os.fsencode(os.path.abspath(node.home))).hexdigest()[:12]
    return [d for h in hierarchies() if (d := h / "dsec-lxcfs" / digest).exists()]


def _lxcfs_processes(home: Path) -> list[int]:
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if b"lxcfs" in cmd and os.fsencode(home) in cmd:
            found.append(int(pid))
    return found


def _wait_for(what, timeout: float = 10.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = what()
        if value:
            return value
        time.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what}")


def _gone(pid: int) -> bool:
    """Exited: no such process, or a zombie its new parent (the host's init, once the daemon
    that started it has gone) has not reaped yet."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def _sees_256m(sb) -> bool:
    res = sb.exec("cat /proc/meminfo")
    return res.exit_code == 0 and _mem_total_kib(res.stdout.decode()) == 256 * 1024


def test_lxcfs_starts_on_first_need_and_leaves_nothing(tmp_path):
    with running_kit_node("dsec-lxcfs-") as node:
        assert _lxcfs_pid(node) is None  # nothing until a sandbox needs it
        with node.client() as c:
            sb = c.create(layers=(node.layer.ref,), cpu=1, memory="256M")
            pid = _lxcfs_pid(node)
            assert pid is not None and _lxcfs_processes(node.home) == [pid]
            assert _sees_256m(sb)
            # its own cgroups, not the daemon's (which go when the daemon stops)
            assert len(_lxcfs_cgroups(node)) == len(hierarchies())
            own = Path(f"/proc/{pid}/cgroup").read_text()
            assert "dsec-lxcfs/" in own and "dsec-daemon/" not in own
            sb.kill()
        home = node.home
        # the daemon keeps it while it runs (the next sandbox needs it)
        assert _lxcfs_processes(home) == [pid]
    # running_kit_node failed the test if the node left a mount or a process under its home
    assert _lxcfs_processes(home) == []
    assert _gone(pid)
    assert _lxcfs_cgroups(node) == []
    with open("/proc/self/mountinfo") as f:
        assert os.fspath(home) not in f.read()


async def test_the_backends_of_one_node_share_one_lxcfs(tmp_path):
    """The container backend and one built on it (FnCall) serve the same node: when both first
    need lxcfs at once, one starts and neither kills the other's under a create (a CI run's
    create found /proc/swaps missing while the second unmounted the first's)."""
    config = NodeConfig(home=tmp_path / "home")
    config.run_dir.mkdir(parents=True)
    backends = [ContainerBackend(config), ContainerBackend(config)]
    try:
        assert backends[0].lxcfs is backends[1].lxcfs
        mounts = await asyncio.gather(*(b.lxcfs.ensure() for b in backends))
        pids = _lxcfs_processes(config.home)
        assert len(pids) == 1 and all((m / "proc" / "swaps").is_file() for m in mounts)
        await backends.pop().close()  # the other still serves sandboxes: lxcfs stays
        assert _lxcfs_processes(config.home) == pids and (mounts[0] / "proc" / "swaps").is_file()
    finally:
        for backend in backends:
            await backend.close()
    assert _lxcfs_processes(config.home) == [] and _gone(pids[0])
    with open("/proc/self/mountinfo") as f:
        assert os.fspath(config.home) not in f.read()


def test_killed_lxcfs_is_replaced_and_live_sandboxes_get_it_back():
    with running_kit_node("dsec-lxcfs-kill-") as node, node.client() as c:
        sb = c.create(layers=(node.layer.ref,), cpu=1, memory="256M")
        old = _lxcfs_pid(node)
        assert old is not None and _sees_256m(sb)
        os.kill(old, signal.SIGKILL)
        new = _wait_for(lambda: (p := _lxcfs_pid(node)) != old and p)
        # the live sandbox's files are the new lxcfs's, not a dead connection's
        _wait_for(lambda: _sees_256m(sb))
        assert not os.path.exists(f"/proc/{old}"), "the dead lxcfs was not reaped"
        assert _lxcfs_processes(node.home) == [new]
        other = c.create(layers=(node.layer.ref,), cpu=1, memory="128M")
        assert _mem_total_kib(_run(other, "cat /proc/meminfo")) == 128 * 1024
        assert _sees_256m(sb)


def test_lxcfs_outlives_a_daemon_restart_and_is_readopted():
    with running_kit_node("dsec-lxcfs-restart-") as node:
        cfg = node.config
        with node.client() as c:
            sb = c.create(layers=(node.layer.ref,), cpu=1, memory="256M")
            first = _lxcfs_pid(node)
        stop_daemon(cfg)
        assert first is not None and _lxcfs_processes(node.home) == [first]
        ensure_daemon(cfg)
        with node.client() as c:
            again = c.get(sb.id)
            assert _sees_256m(again) and _lxcfs_pid(node) == first
            # it dies while no daemon runs: the next daemon starts another and mends the
            # sandbox's files as it re-adopts it
            stop_daemon(cfg)
            os.kill(first, signal.SIGKILL)
            _wait_for(lambda: _gone(first))
            ensure_daemon(cfg)
            again = c.get(sb.id)
            _wait_for(lambda: _sees_256m(again))
            assert _lxcfs_pid(node) not in (None, first)
            again.kill()
        assert daemon_pid(cfg) is not None


@pytest.mark.parametrize(
    "setting, message", [("/nonexistent/lxcfs", "not installed"), ("/bin/false", "did not start")]
)
def test_missing_or_broken_lxcfs_is_a_typed_error(monkeypatch, setting, message):
    monkeypatch.setenv("DSEC_LXCFS", setting)
    with running_kit_node("dsec-nolxcfs-") as node:
        monkeypatch.delenv("DSEC_LXCFS")
        with node.client() as c, pytest.raises(dsec.BackendUnavailable) as e:
            c.create(layers=(node.layer.ref,), memory="64M")
        assert "lxcfs" in str(e.value) and message in str(e.value)
        assert "DSEC_LXCFS=off" in str(e.value) or setting == "/bin/false"
        left = leftovers(node.home)
        assert left["sandbox_dirs"] == [] and left["processes"] == [], left
        assert _lxcfs_cgroups(node) == [] and _lxcfs_pid(node) is None


def test_without_lxcfs_or_pinning_sandboxes_still_work(monkeypatch, tmp_path):
    monkeypatch.setenv("DSEC_LXCFS", "off")
    monkeypatch.setenv("DSEC_CPU_PINNING", "off")
    with running_kit_node("dsec-nolxcfs-") as node:
        monkeypatch.delenv("DSEC_LXCFS")
        monkeypatch.delenv("DSEC_CPU_PINNING")
        with node.client() as c:
            sb = c.create(layers=(node.layer.ref,), cpu=1, memory="256M")
            host_total = _mem_total_kib(Path("/proc/meminfo").read_text())
            assert _mem_total_kib(_run(sb, "cat /proc/meminfo")) == host_total
            assert _run(sb, "/usr/bin/nproc").strip() == str(HOST_CPUS)
            mounts = _run(sb, "cat /proc/mounts")
            assert "fuse.lxcfs" not in mounts and " /sys/fs/cgroup " in mounts
            assert _lxcfs_pid(node) is None and not _lxcfs_processes(node.home)
            sb.kill()


def test_lxcfs_files_are_the_ones_bound(client, node):
    sb = client.create(layers=(node.layer.ref,), memory="64M")
    table = [line.split() for line in _run(sb, "cat /proc/mounts").splitlines()]
    mounts = {fields[1]: fields[2] for fields in table}
    assert {f: mounts.get(f) for f in LXCFS_FILES} == {f: "fuse.lxcfs" for f in LXCFS_FILES}
    # the kernel's masked and read-only /proc paths are still masked and read-only
    assert _run(sb, "wc -c < /proc/keys").strip() == "0"
    res = sb.exec("echo x > /proc/sys/kernel/hostname")
    assert res.exit_code != 0 and b"Read-only file system" in res.stderr
