"""The backend conformance kit: every backend plugin subclasses ``BackendConformance``.

    from dsec_core.testing import BackendConformance

    class TestMyBackend(BackendConformance):
        backend_name = "mybackend"

The checks run against a real node daemon (fixtures in ``dsec_core.testing.fixtures``): exec
semantics, timeouts, output caps, sessions, files, limits, TTL and cleanup. Checks that need a
feature a backend does not claim in ``Backend.features`` are skipped, not failed.
"""

from __future__ import annotations

import concurrent.futures as cf
import os
import re
import time
from pathlib import Path

import pytest

from ..errors import (ExecTimeout, SandboxPathError, SessionClosed, UnknownSandbox,
                      UnknownSession)
from ..plugins import registry
from .fixtures import leftovers

__all__ = ["BackendConformance"]


def _rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


def _pids_with_marker(marker: str) -> list[int]:
    """Host pids whose argv contains ``marker`` (words split as in argv)."""
    needle = marker.replace(" ", "\0").encode()
    found = []
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                if needle in Path(f"/proc/{pid}/cmdline").read_bytes():
                    found.append(int(pid))
            except OSError:
                pass
    return found


class BackendConformance:
    """Behaviour every dsec backend must show. Set ``backend_name`` in the subclass."""

    backend_name: str = ""

    def _features(self, dsec_node) -> frozenset[str]:
        return registry().backend(self.backend_name).features

    def _need(self, dsec_node, feature: str) -> None:
        if feature not in self._features(dsec_node):
            pytest.skip(f"backend {self.backend_name} does not claim {feature!r}")

    # --- exec -----------------------------------------------------------------------------
    def test_exec_shell_and_argv(self, dsec_sandboxes):
        sb = dsec_sandboxes.create()
        r = sb.exec("echo out; echo err >&2; exit 3")
        assert (r.stdout, r.stderr, r.exit_code) == (b"out\n", b"err\n", 3)
        assert not r.truncated and not r.timed_out and r.duration >= 0
        r = sb.exec(["echo", "a b", "$HOME"])
        assert r.stdout == b"a b $HOME\n" and r.exit_code == 0

    def test_command_not_found_is_127(self, dsec_sandboxes):
        sb = dsec_sandboxes.create()
        assert sb.exec(["/no/such/program"]).exit_code == 127
        assert sb.exec("no-such-program-xyz").exit_code == 127

    def test_exec_stdin_env_cwd(self, dsec_sandboxes):
        sb = dsec_sandboxes.create(env={"FROM_SPEC": "spec"})
        r = sb.exec("cat; echo $FROM_SPEC $FROM_CALL; pwd", stdin=b"in\n",
                    env={"FROM_CALL": "call"}, cwd="/tmp")
        assert r.stdout == b"in\nspec call\n/tmp\n"
        with pytest.raises(SandboxPathError):
            sb.exec("true", cwd="/no/such/dir")

    def test_exec_binary_output(self, dsec_sandboxes):
        sb = dsec_sandboxes.create()
        r = sb.exec("printf '\\000\\377\\001'")
        assert r.stdout == b"\x00\xff\x01"

    def test_timeout_kills_process_tree(self, dsec_sandboxes):
        sb = dsec_sandboxes.create()
        marker = f"4{os.getpid() % 1000}{int(time.time()) % 1000}7"
        started = time.monotonic()
        r = sb.exec(f"setsid sleep {marker} & (sleep {marker} &) ; sleep {marker}", timeout=1.0)
        assert r.timed_out and time.monotonic() - started < 10
        with pytest.raises(ExecTimeout):
            r.check()
        time.sleep(0.3)
        assert _pids_with_marker(f"sleep {marker}") == []
        assert sb.exec("echo alive").stdout == b"alive\n"

    def test_output_cap_bounds_memory(self, dsec_sandboxes, dsec_node):
        sb = dsec_sandboxes.create()
        daemon_pid = int((dsec_node.config.run_dir / "dsecd.pid").read_text())
        before = _rss_kib(daemon_pid)
        r = sb.exec("yes", timeout=3.0, max_output=64 << 10)
        assert r.truncated and r.timed_out
        assert len(r.stdout) == 64 << 10
        assert _rss_kib(daemon_pid) - before < 64 << 10  # < 64 MiB growth after a yes flood
        small = sb.exec("head -c 100000 /dev/zero", max_output=1000)
        assert small.truncated and len(small.stdout) == 1000 and small.exit_code == 0

    def test_concurrent_execs(self, dsec_sandboxes):
        sb = dsec_sandboxes.create()
        started = time.monotonic()
        with cf.ThreadPoolExecutor(8) as pool:
            results = list(pool.map(lambda i: sb.exec(f"sleep 0.5; echo {i}"), range(8)))
        assert [r.stdout for r in results] == [f"{i}\n".encode() for i in range(8)]
        assert time.monotonic() - started < 3.5

    # --- sessions -------------------------------------------------------------------------
    def test_sessions_keep_state(self, dsec_sandboxes):
        sb = dsec_sandboxes.create()
        a, b = sb.session(), sb.session()
        a.exec("cd /tmp && X=41 && export Y=yes && f() { echo fn$1; }")
        r = a.exec("pwd; echo $((X+1)) $Y; f 7")
        assert r.stdout == b"/tmp\n42 yes\nfn7\n"
        assert b.exec("pwd; echo ${X:-unset}").stdout == b"/\nunset\n"
        assert a.exec("false").exit_code == 1
        assert a.exec("echo still").stdout == b"still\n"
        a.close()
        with pytest.raises((UnknownSession, SessionClosed)):
            a.exec("true")
        b.close()

    def test_session_timeout_and_exit(self, dsec_sandboxes):
        sb = dsec_sandboxes.create()
        s = sb.session()
        r = s.exec("sleep 100", timeout=0.5)
        assert r.timed_out
        assert s.exec("echo ok").stdout == b"ok\n"
        r = s.exec("exit 3")
        assert r.exit_code == 3
        with pytest.raises((SessionClosed, UnknownSession)):
            s.exec("true")

    # --- files ----------------------------------------------------------------------------
    def test_files(self, dsec_sandboxes, tmp_path):
        sb = dsec_sandboxes.create()
        sb.write_file("/work/dir/a.txt", b"hello\n", mode=0o600)
        assert sb.read_file("/work/dir/a.txt") == b"hello\n"
        assert sb.exec("cat /work/dir/a.txt").stdout == b"hello\n"
        entries = {e.name: e for e in sb.list_dir("/work/dir")}
        assert entries["a.txt"].type == "file" and entries["a.txt"].size == 6
        assert entries["a.txt"].mode & 0o777 == 0o600
        big = os.urandom(3 << 20) * 4  # 12 MiB: more than one transfer chunk
        local = tmp_path / "big.bin"
        local.write_bytes(big)
        sb.upload(local, "/work/big.bin")
        sb.download("/work/big.bin", tmp_path / "back.bin")
        assert (tmp_path / "back.bin").read_bytes() == big
        assert sb.exec("wc -c < /work/big.bin").stdout.strip() == str(len(big)).encode()
        sb.remove("/work/dir", recursive=True)
        with pytest.raises(SandboxPathError):
            sb.read_file("/work/dir/a.txt")
        with pytest.raises(SandboxPathError):
            sb.list_dir("/no/such/dir")

    # --- isolation and limits -------------------------------------------------------------
    def test_root_inside_is_not_root_outside(self, dsec_sandboxes, dsec_node):
        self._need(dsec_node, "userns")
        sb = dsec_sandboxes.create()
        assert sb.exec("id -u").stdout == b"0\n"
        uid_map = sb.exec("cat /proc/self/uid_map").stdout.split()
        assert uid_map[0] == b"0" and uid_map[1] != b"0"
        sb.exec("echo x > /root/owned").check()
        upper = dsec_node.config.sandbox_dir / sb.id / "upper" / "root" / "owned"  # on disk
        assert upper.stat().st_uid == int(uid_map[1])
        assert b"NoNewPrivs:\t1" in sb.exec("cat /proc/self/status").stdout
        # mknod and raw sockets are not in the capability set
        assert sb.exec("mknod /tmp/sda b 8 0").exit_code != 0

    def test_namespaces(self, dsec_sandboxes, dsec_node):
        self._need(dsec_node, "pid-namespace")
        sb = dsec_sandboxes.create()
        pids = [p for p in sb.exec("ls /proc").stdout.split() if p.isdigit()]
        assert b"1" in pids and len(pids) < 10
        assert sb.exec("cat /proc/1/cmdline").stdout.startswith(b"/.dsec/agent")
        if "net-namespace" in self._features(dsec_node):
            links = sb.exec("ls /sys/class/net").stdout.split()
            assert links == [b"lo"]
        assert sb.exec("hostname").stdout.strip() != os.uname().nodename.encode()

    def test_masked_and_readonly_proc(self, dsec_sandboxes, dsec_node):
        self._need(dsec_node, "userns")
        sb = dsec_sandboxes.create()
        assert sb.exec("cat /proc/kcore | head -c 10 | wc -c").stdout.strip() == b"0"
        assert sb.exec("cat /proc/kpagecgroup | head -c 10 | wc -c").stdout.strip() == b"0"
        r = sb.exec("echo 1 > /proc/sys/kernel/domainname")
        assert r.exit_code != 0

    def test_memory_limit(self, dsec_sandboxes, dsec_node):
        self._need(dsec_node, "cgroups")
        sb = dsec_sandboxes.create(memory="64M")
        r = sb.exec("dd if=/dev/zero of=/dev/null bs=200M count=1", timeout=30)
        assert r.exit_code != 0  # killed by the OOM killer, not allowed 200M
        assert sb.exec("echo survived").stdout == b"survived\n"
        # commands, not the sandbox's init, are what the OOM killer takes first
        assert sb.exec("cat /proc/self/oom_score_adj").stdout == b"1000\n"
        assert sb.exec("cat /proc/1/oom_score_adj").stdout.strip() != b"1000"

    def test_pids_limit(self, dsec_sandboxes, dsec_node):
        self._need(dsec_node, "cgroups")
        sb = dsec_sandboxes.create(pids=40)
        r = sb.exec("for i in $(seq 100); do sleep 4 & done; wait", timeout=30)
        assert r.exit_code != 0 and re.search(rb"fork|resource|again", r.stderr, re.I)
        held = sb.usage().pids
        if held is not None:
            assert 30 <= held <= 40  # the sleeps that did start hold the sandbox at its limit
        deadline = time.monotonic() + 15
        while True:  # once they exit, the sandbox works again
            try:
                if sb.exec("echo recovered").stdout == b"recovered\n":
                    break
            except Exception:
                pass
            assert time.monotonic() < deadline, "sandbox did not recover from its pids limit"
            time.sleep(0.5)

    def test_cpu_limit(self, dsec_sandboxes, dsec_node):
        self._need(dsec_node, "cgroups")
        sb = dsec_sandboxes.create(cpu=0.25)
        before = sb.usage().cpu_seconds
        if before is None:
            pytest.skip("backend reports no cpu usage")
        sb.exec("timeout 2 sh -c 'while :; do :; done'", timeout=10)
        used = sb.usage().cpu_seconds - before
        assert used < 0.25 * 2 * 1.6 + 0.1, f"used {used:.2f}s of CPU in 2s at 0.25 cores"
        assert used > 0.1

    # --- lifecycle ------------------------------------------------------------------------
    def test_ttl_kills(self, dsec_sandboxes, dsec_client):
        sb = dsec_sandboxes.create(ttl=1.0)
        assert sb.exec("true").exit_code == 0
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            if sb.id not in {i.id for i in dsec_client.list()}:
                break
            time.sleep(0.2)
        else:
            pytest.fail("sandbox outlived its ttl")
        with pytest.raises(UnknownSandbox):
            dsec_client.get(sb.id)

    def test_kill_leaves_nothing(self, dsec_sandboxes, dsec_node, dsec_client):
        sb = dsec_sandboxes.create()
        marker = f"9{os.getpid() % 1000}{int(time.time() * 10) % 10000}1"
        sb.exec(f"sleep {marker} > /dev/null 2>&1 &")
        sb.write_file("/tmp/data", b"x" * 1000)
        assert _pids_with_marker(f"sleep {marker}")
        sb.kill()
        assert _pids_with_marker(f"sleep {marker}") == []
        with pytest.raises(UnknownSandbox):
            dsec_client.get(sb.id)
        left = leftovers(dsec_node.home)
        assert sb.id not in left["sandbox_dirs"]
        assert not [m for m in left["mounts"] if sb.id in m]
        assert not [c for c in left["cgroups"] if sb.id in c]

    def test_create_many(self, dsec_sandboxes):
        sbs = dsec_sandboxes.create_many(4)
        assert len({sb.id for sb in sbs}) == 4
        for sb in sbs:
            assert sb.exec(["echo", sb.id]).stdout == f"{sb.id}\n".encode()

    def test_writes_are_private(self, dsec_sandboxes):
        a, b = dsec_sandboxes.create(), dsec_sandboxes.create()
        a.exec("echo mine > /etc/motd-a; rm -f /bin/true").check()
        assert b.exec("cat /etc/motd-a").exit_code != 0
        assert b.exec("/bin/true").exit_code == 0
