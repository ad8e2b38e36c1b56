"""The backend conformance kit: every backend plugin subclasses ``BackendConformance``.

    from dsec_core.testing import BackendConformance

    class TestMyBackend(BackendConformance):
        backend_name = "mybackend"

The checks run against a real node daemon (fixtures in ``dsec_core.testing.fixtures``): the
declared contract, exec semantics, timeouts, output caps, sessions, files, isolation, limits,
TTL, cleanup, a sandbox dying on its own, re-adoption after a daemon restart, and that a
create claiming a warm member gets a sandbox indistinguishable from a cold one. A check that
needs a ``Feature`` the backend does not claim is reported as a skip naming the feature; checks
that look into the host's /proc or the host side of the writable layer need
``Feature.SHARED_KERNEL``.
"""

from __future__ import annotations

import base64
import concurrent.futures as cf
import json
import os
import re
import signal
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any, ClassVar

import pytest

from ..backend import AGENT_PATH, AgentChannel, Backend, Feature, RootfsForm, cgroup_path
from ..errors import (
    AdmissionRejected,
    DsecError,
    ExecTimeout,
    FeatureUnavailable,
    InvalidSpec,
    PluginInvalid,
    SandboxNotRunning,
    SandboxPathError,
    SandboxPaused,
    SessionClosed,
    UnknownSandbox,
    UnknownSession,
)
from ..localnode import daemon_pid
from ..plugins import registry
from ..records import JudgeCase, SandboxUsage
from .fixtures import KIT_DEVICE_KIND, cgroup_hierarchies, leftovers
from .waits import until

__all__ = ["BackendConformance"]

#: Seconds the node may take to notice a sandbox that died on its own (it looks every second).
NOTICE_WITHIN = 5.0
#: Seconds ``check_available`` may take: the node calls it before it first uses the backend.
AVAILABLE_WITHIN = 2.0


def _rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


def _marker() -> str:
    """A number no other test's ``sleep`` uses, to find the processes a check started."""
    return f"9{os.getpid() % 1000}{time.monotonic_ns() % 10**7}1"


def _host_pids_with(marker: str) -> list[int]:
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


def _sandbox_has(sb: Any, marker: str) -> bool:
    """Whether a process in the sandbox has ``marker`` in its argv, as the sandbox's /proc
    shows it (the agent itself needs /proc, so every backend has one). The reading command's
    own argv names only /proc paths, so it never matches itself."""
    out = sb.exec("cat /proc/[0-9]*/cmdline 2>/dev/null; true").stdout
    return marker.replace(" ", "\0").encode() in out


class BackendConformance:
    """Behaviour every dsec backend must show. Set ``backend_name`` in the subclass.

    ``sandbox_spec`` adds ``SandboxSpec`` fields to every sandbox the kit creates: a backend
    without ``Feature.NET_NAMESPACE`` cannot run the default ``network="none"`` and names a
    network mode and the security policy that enforces it here. ``writable_root = False``
    says the backend's root filesystem is read-only by design (FnCall members: only tmpfs work
    areas such as ``/tmp``, ``/root`` and ``/work`` take writes); the kit then checks private
    writes there and that the root refuses them, and skips the writable layer's ownership. A
    base class of your own that sets no ``backend_name`` is declared with
    ``class Base(BackendConformance, abstract=True)``. ``lacks`` maps features the backend
    claims but sandboxes of this ``sandbox_spec`` do not have to the reason (the container
    backend under ``runtime="runsc"`` does not share the host's kernel); checks that need them
    are skipped with that reason. ``differs`` maps names of single checks to the reason they
    do not hold for this variant (what its runtime does differently); they are skipped with it.
    """

    backend_name: ClassVar[str] = ""
    sandbox_spec: ClassVar[Mapping[str, Any]] = {}
    writable_root: ClassVar[bool] = True
    lacks: ClassVar[Mapping[Feature, str]] = {}
    differs: ClassVar[Mapping[str, str]] = {}

    @pytest.fixture(autouse=True)
    def _variant_differs(self, request: pytest.FixtureRequest) -> None:
        reason = self.differs.get(request.node.originalname)
        if reason is not None:
            pytest.skip(f"{request.node.originalname} with {self.sandbox_spec}: {reason}")

    def __init_subclass__(cls, abstract: bool = False, **kw: Any) -> None:
        super().__init_subclass__(**kw)
        name = getattr(cls, "backend_name", "")
        if not abstract and (not isinstance(name, str) or not name):
            # Without a name the checks would run against whatever backend a default picked.
            raise PluginInvalid(
                f"{cls.__module__}.{cls.__qualname__} subclasses BackendConformance but sets no "
                'backend_name: add `backend_name = "<the name your Backend registers>"` to the '
                "class (or declare a base class of your own with abstract=True)",
                test_class=cls.__qualname__,
            )

    # --- what the backend claims ----------------------------------------------------------
    def backend_class(self) -> type[Backend]:
        """The class registered as ``backend_name`` (``UnknownBackend`` if none is)."""
        return registry().backend(self.backend_name)

    def need(self, *features: Feature) -> None:
        """Skip the calling check unless the backend claims every one of ``features``."""
        claimed = self.backend_class().features
        missing = [f for f in features if f not in claimed]
        if missing:
            names = ", ".join(f"Feature.{f.name} ({f.value!r})" for f in missing)
            pytest.skip(f"backend {self.backend_name!r} does not claim {names}")
        for f in features:
            if f in self.lacks:
                pytest.skip(
                    f"Feature.{f.name} ({f.value!r}) with {self.sandbox_spec}: {self.lacks[f]}"
                )

    def has(self, feature: Feature) -> bool:
        """Whether sandboxes of this class have ``feature`` (claimed, not in ``lacks``)."""
        return feature in self.backend_class().features and feature not in self.lacks

    # --- the declared contract ------------------------------------------------------------
    def test_declares_the_contract(self):
        cls = self.backend_class()
        assert cls.name == self.backend_name
        assert isinstance(cls.rootfs, RootfsForm), (
            f"rootfs must be a RootfsForm member, not {cls.rootfs!r}"
        )
        assert isinstance(cls.agent_channel, AgentChannel), (
            f"agent_channel must be an AgentChannel member, not {cls.agent_channel!r}"
        )
        assert isinstance(cls.features, frozenset), "features must be a frozenset of Feature"
        loose = [f for f in cls.features if not isinstance(f, Feature)]
        assert not loose, f"features must be Feature members, not strings: {loose}"
        assert isinstance(cls.policy_targets, frozenset) and all(
            isinstance(t, str) and t for t in cls.policy_targets
        ), "policy_targets must be a frozenset of enforcement point names (str)"

    def test_check_available_here(self):
        started = time.monotonic()
        self.backend_class().check_available()
        took = time.monotonic() - started
        assert took < AVAILABLE_WITHIN, f"check_available took {took:.1f}s"

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
        r = sb.exec(
            "cat; echo $FROM_SPEC $FROM_CALL; pwd",
            stdin=b"in\n",
            env={"FROM_CALL": "call"},
            cwd="/tmp",
        )
        assert r.stdout == b"in\nspec call\n/tmp\n"
        with pytest.raises(SandboxPathError):
            sb.exec("true", cwd="/no/such/dir")

    def test_exec_binary_output(self, dsec_sandboxes):
        sb = dsec_sandboxes.create()
        r = sb.exec("printf '\\000\\377\\001'")
        assert r.stdout == b"\x00\xff\x01"

    def test_timeout_kills_process_tree(self, dsec_sandboxes):
        sb = dsec_sandboxes.create()
        marker = self._time_out_a_process_tree(sb)
        assert not _sandbox_has(sb, f"sleep {marker}"), "timed-out processes live on"
        assert sb.exec("echo alive").stdout == b"alive\n"

    def test_timeout_leaves_no_process_on_the_host(self, dsec_sandboxes):
        self.need(Feature.SHARED_KERNEL)
        marker = self._time_out_a_process_tree(dsec_sandboxes.create())
        assert _host_pids_with(f"sleep {marker}") == []

    @staticmethod
    def _time_out_a_process_tree(sb: Any) -> str:
        """Run a command that leaves a setsid'd and a double-forked child, let it time out,
        and return the marker in their argv."""
        marker = _marker()
        started = time.monotonic()
        r = sb.exec(f"setsid sleep {marker} & (sleep {marker} &) ; sleep {marker}", timeout=1.0)
        assert r.timed_out and time.monotonic() - started < 10
        with pytest.raises(ExecTimeout):
            r.check()
        time.sleep(0.3)
        return marker

    def test_exec_leaves_nothing_running(self, dsec_sandboxes):
        """What a command leaves running dies when it exits, setsid'd and double-forked
        processes too; with ``background=True`` it lives on; ``exclusive`` kills it."""
        sb = dsec_sandboxes.create()
        marker, kept = _marker(), _marker()
        r = sb.exec(f"setsid sleep {marker} & (sleep {marker} &); sleep {marker} & echo left")
        assert r.exit_code == 0 and r.stdout == b"left\n" and not r.timed_out
        assert not _sandbox_has(sb, f"sleep {marker}"), "an exec's processes outlived it"
        sb.exec(f"sleep {kept} > /dev/null 2>&1 &", background=True).check()
        assert _sandbox_has(sb, f"sleep {kept}"), "background=True did not keep the process"
        r = sb.exec("cat /proc/[0-9]*/cmdline; true", exclusive=True)
        assert f"sleep\0{kept}".encode() not in r.stdout, "exclusive left a process running"
        assert not _sandbox_has(sb, f"sleep {kept}")

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

    # --- isolation ------------------------------------------------------------------------
    def test_agent_is_pid_1_at_its_path(self, dsec_sandboxes):
        self.need(Feature.PID_NAMESPACE)
        sb = dsec_sandboxes.create()
        pids = [p for p in sb.exec("ls /proc").stdout.split() if p.isdigit()]
        assert b"1" in pids and len(pids) < 10, f"the sandbox sees other processes: {pids}"
        argv = sb.exec("cat /proc/1/cmdline").stdout.split(b"\0")
        assert argv[0] == AGENT_PATH.encode(), f"PID 1 is {argv}, not the agent at {AGENT_PATH}"

    def test_agent_is_out_of_reach_of_root_inside(self, dsec_sandboxes):
        # Non-dumpable, so root inside cannot follow its /proc links (nor ptrace it, read its
        # memory or take its fds): that holds where root inside lacks CAP_SYS_PTRACE over it,
        # i.e. in a user namespace of the sandbox's own.
        self.need(Feature.PID_NAMESPACE)
        self.need(Feature.USERNS)
        sb = dsec_sandboxes.create()
        exe = sb.exec("readlink /proc/1/exe")
        assert exe.exit_code != 0 and not exe.stdout, f"the sandbox can read PID 1's exe: {exe}"

    def test_network_is_loopback_only(self, dsec_sandboxes):
        self.need(Feature.NET_NAMESPACE)
        sb = dsec_sandboxes.create()
        # /proc/net follows the reader's network namespace, and needs no /sys in the sandbox
        r = sb.exec("cut -d: -f1 /proc/net/dev | tail -n +3")
        assert r.stdout.split() == [b"lo"], f"interfaces in the sandbox: {r.stdout!r}"

    def test_root_inside_is_not_root_outside(self, dsec_sandboxes):
        self.need(Feature.USERNS)
        sb = dsec_sandboxes.create()
        assert sb.exec("id -u").stdout == b"0\n"
        uid_map = sb.exec("cat /proc/self/uid_map").stdout.split()
        assert uid_map[0] == b"0" and uid_map[1] != b"0"
        assert b"NoNewPrivs:\t1" in sb.exec("cat /proc/self/status").stdout
        # mknod and raw sockets are not in the capability set
        assert sb.exec("mknod /tmp/sda b 8 0").exit_code != 0

    def test_writable_layer_belongs_to_the_mapped_uid(self, dsec_sandboxes, dsec_node):
        self.need(Feature.USERNS, Feature.SHARED_KERNEL)
        if self.backend_class().rootfs is not RootfsForm.COMPOSED:
            pytest.skip(
                f"backend {self.backend_name!r} takes RootfsForm.IMAGES: its writable "
                "layer is a disk the host does not look into"
            )
        if not self.writable_root:
            pytest.skip(f"backend {self.backend_name!r} has a read-only root (writable_root)")
        sb = dsec_sandboxes.create()
        host_uid = int(sb.exec("cat /proc/self/uid_map").stdout.split()[1])
        sb.exec("echo x > /root/owned").check()
        upper = dsec_node.config.sandbox_dir / sb.id / "upper" / "root" / "owned"  # on disk
        assert upper.stat().st_uid == host_uid

    def test_masked_and_readonly_proc(self, dsec_sandboxes):
        self.need(Feature.USERNS)
        sb = dsec_sandboxes.create()
        assert sb.exec("cat /proc/kcore | head -c 10 | wc -c").stdout.strip() == b"0"
        assert sb.exec("cat /proc/kpagecgroup | head -c 10 | wc -c").stdout.strip() == b"0"
        r = sb.exec("echo 1 > /proc/sys/kernel/domainname")
        assert r.exit_code != 0

    # --- cgroups and limits ---------------------------------------------------------------
    def test_cgroups_live_at_the_contract_path(self, dsec_sandboxes):
        self.need(Feature.CGROUPS)
        sb = dsec_sandboxes.create()
        rel = cgroup_path(sb.id)
        found = [h / rel for h in cgroup_hierarchies() if (h / rel).is_dir()]
        assert found, f"no hierarchy under /sys/fs/cgroup has the sandbox's cgroup {rel}"
        held = set()
        for d in found:
            try:
                held |= set((d / "cgroup.procs").read_text().split())
            except OSError:
                pass
        assert held, f"no process is in the sandbox's cgroups {found}"
        sb.kill()
        left = [os.fspath(d) for d in found if d.exists()]
        assert left == [], f"cgroups outlive the sandbox: {left}"

    def test_usage_reports_memory_cpu_and_pids(self, dsec_sandboxes):
        self.need(Feature.CGROUPS)
        sb = dsec_sandboxes.create()
        sb.exec("sleep 30 > /dev/null 2>&1 &", background=True).check()
        u = sb.usage()
        assert isinstance(u, SandboxUsage)
        assert u.memory is not None and u.memory > 0, u
        assert u.cpu_seconds is not None and u.cpu_seconds >= 0, u
        assert u.pids is not None and u.pids >= 2, u  # the agent and the sleep

    def test_memory_limit(self, dsec_sandboxes):
        self.need(Feature.CGROUPS)
        sb = dsec_sandboxes.create(memory="64M")
        r = sb.exec("dd if=/dev/zero of=/dev/null bs=200M count=1", timeout=30)
        assert r.exit_code != 0  # killed by the OOM killer, not allowed 200M
        assert sb.exec("echo survived").stdout == b"survived\n"
        # commands, not the sandbox's init, are what the OOM killer takes first
        assert sb.exec("cat /proc/self/oom_score_adj").stdout == b"1000\n"
        assert sb.exec("cat /proc/1/oom_score_adj").stdout.strip() != b"1000"

    def test_pids_limit(self, dsec_sandboxes):
        self.need(Feature.CGROUPS)
        sb = dsec_sandboxes.create(pids=40)
        # background: the sleeps that started must outlive the failed loop to hold the limit
        r = sb.exec("for i in $(seq 100); do sleep 4 & done; wait", timeout=30, background=True)
        assert r.exit_code != 0 and re.search(rb"fork|resource|again", r.stderr, re.IGNORECASE)
        held = sb.usage().pids
        assert held is not None and 30 <= held <= 40  # the sleeps that started hold the limit
        deadline = time.monotonic() + 15
        while True:  # once they exit, the sandbox works again
            try:
                if sb.exec("echo recovered").stdout == b"recovered\n":
                    break
            except DsecError:
                pass
            assert time.monotonic() < deadline, "sandbox did not recover from its pids limit"
            time.sleep(0.5)

    def test_cpu_limit(self, dsec_sandboxes):
        self.need(Feature.CGROUPS)
        sb = dsec_sandboxes.create(cpu=0.25)
        before = sb.usage().cpu_seconds
        assert before is not None, "a backend that claims CGROUPS reports cpu_seconds"
        sb.exec("timeout 2 sh -c 'while :; do :; done'", timeout=10)
        used = sb.usage().cpu_seconds - before
        assert used < 0.25 * 2 * 1.6 + 0.1, f"used {used:.2f}s of CPU in 2s at 0.25 cores"
        assert used > 0.1

    # --- lifecycle ------------------------------------------------------------------------
    def test_ttl_kills(self, dsec_sandboxes, dsec_client):
        asked = time.monotonic()
        sb = dsec_sandboxes.create(ttl=1.0)
        try:
            assert sb.exec("true").exit_code == 0
        except (SandboxNotRunning, UnknownSandbox):
            # a slow machine (an emulated VM on a loaded host): the ttl ended it mid-call
            assert time.monotonic() - asked >= 1.0
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
        sb.exec("sleep 1000 > /dev/null 2>&1 &", background=True).check()
        sb.write_file("/tmp/data", b"x" * 1000)
        sb.kill()
        with pytest.raises(UnknownSandbox):
            dsec_client.get(sb.id)
        self._assert_nothing_left(dsec_node, sb.id)

    def test_kill_leaves_no_process_on_the_host(self, dsec_sandboxes):
        self.need(Feature.SHARED_KERNEL)
        sb = dsec_sandboxes.create()
        marker = _marker()
        sb.exec(f"sleep {marker} > /dev/null 2>&1 &", background=True).check()
        # a background command's shell forks the sleep after the exec answers
        until(lambda: _host_pids_with(f"sleep {marker}"), what="the sleep running on the host")
        sb.kill()
        assert _host_pids_with(f"sleep {marker}") == []

    def test_node_notices_a_sandbox_that_died(self, dsec_sandboxes, dsec_node, dsec_client):
        sb = dsec_sandboxes.create()
        pid = dsec_client.get(sb.id).info.pid
        if pid is None:
            pytest.skip(
                f"backend {self.backend_name!r} reports no host pid (state['pid']), "
                "so the kit cannot kill the sandbox behind the node's back"
            )
        marker = _marker()
        sb.exec(f"sleep {marker} > /dev/null 2>&1 &", background=True).check()
        os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + NOTICE_WITHIN
        while sb.id in {i.id for i in dsec_client.list()}:
            assert time.monotonic() < deadline, (
                f"the node still lists the sandbox {NOTICE_WITHIN}s after its pid {pid} died: "
                "alive() must say False once that process is gone (and reaped)"
            )
            time.sleep(0.2)
        with pytest.raises(UnknownSandbox):
            dsec_client.get(sb.id)
        if self.has(Feature.SHARED_KERNEL):  # else it has no host view
            assert _host_pids_with(f"sleep {marker}") == []
        self._assert_nothing_left(dsec_node, sb.id)

    def test_sandboxes_survive_a_daemon_restart(self, dsec_sandboxes, dsec_node):
        sb = dsec_sandboxes.create()
        sb.write_file("/root/kept", b"written before the restart")
        marker = _marker()
        sb.exec(f"sleep {marker} > /dev/null 2>&1 &", background=True).check()
        before = daemon_pid(dsec_node.config)
        try:
            dsec_node.restart()
        finally:
            dsec_node.ensure_running()  # later checks need a daemon whatever happened here
        assert daemon_pid(dsec_node.config) not in (None, before)
        with dsec_node.client() as client:
            assert sb.id in {i.id for i in client.list()}, "the restarted node lost the sandbox"
            again = client.get(sb.id)
            assert again.exec("echo adopted").stdout == b"adopted\n"
            assert again.read_file("/root/kept") == b"written before the restart"
            assert _sandbox_has(again, f"sleep {marker}"), "processes did not survive"
            again.kill()
        self._assert_nothing_left(dsec_node, sb.id)

    def test_create_many(self, dsec_sandboxes):
        sbs = dsec_sandboxes.create_many(4)
        assert len({sb.id for sb in sbs}) == 4
        for sb in sbs:
            assert sb.exec(["echo", sb.id]).stdout == f"{sb.id}\n".encode()

    def test_reset_leaves_nothing_for_the_next_call(self, dsec_client, dsec_node):
        """Two FnCalls in a row land in the same member (the second waits for the first's
        reset); nothing of the first is left for the second."""
        self.need(Feature.RESET)
        env = dsec_node.environment("kit-fncall")
        kw: dict[str, Any] = {"backend": self.backend_name, "memory": "64M", "timeout": 30}
        first = dsec_client.fncall(
            env,
            "echo x > /tmp/left; echo x > /dev/shm/left; sleep 1000 & echo $SECRET",
            **kw,
            env={"SECRET": "kept?"},
        )
        assert first.ok and first.stdout == b"kept?\n", first
        second = dsec_client.fncall(env, "ls -A /tmp /dev/shm; ps -o args; env", **kw)
        assert second.ok and second.member == first.member, second
        assert b"left" not in second.stdout and b"sleep" not in second.stdout
        assert b"kept?" not in second.stdout

    def test_pause_stops_everything_and_resume_goes_on(self, dsec_sandboxes):
        """A counting loop does not count while the sandbox is paused and goes on from its
        count after the resume; a paused sandbox answers nothing (``SandboxPaused``)."""
        self.need(Feature.PAUSE)
        sb = dsec_sandboxes.create()
        # each count replaces the file whole (a reader never sees it truncated and empty)
        loop = (
            "(i=0; while :; do i=$((i+1)); echo $i > /tmp/n.new; mv /tmp/n.new /tmp/n; "
            "sleep 0.02; done) >/dev/null 2>&1 &"
        )
        sb.exec(loop, background=True).check()

        def count() -> int:
            return int(sb.exec("cat /tmp/n 2>/dev/null || echo 0").stdout)

        first = until(count, what="the loop's first count")
        until(lambda: count() > first, what="the loop counting")  # a loaded host is slow
        before = count()
        assert sb.pause().state == "paused"
        with pytest.raises(SandboxPaused):
            sb.exec("true")
        time.sleep(1.0)  # some 50 counts, had it run
        assert sb.resume().state == "running"
        after = int(sb.exec("cat /tmp/n").stdout)
        assert before <= after < before + 25, (before, after)
        until(lambda: count() > after, what="the loop counting again")
        assert sb.resume().state == "running"  # not paused: a no-op

    def test_a_driver_reaches_its_worker_and_nothing_else(self, dsec_sandboxes):
        """An agent sandbox (``drives``) runs a command in its worker through the drive socket
        and the agent's bridge, and the step is logged (asked again, it is not run again); a
        sandbox it does not drive is not there for it, and a worker cannot reach the socket."""
        self.need(Feature.DRIVE)
        worker = dsec_sandboxes.create()
        other = dsec_sandboxes.create()
        agent = dsec_sandboxes.create(drives=[worker.id])

        def drive(sb, request: dict) -> dict:
            r = sb.exec([AGENT_PATH, "drive"], stdin=json.dumps(request) + "\n")
            assert r.exit_code == 0, r
            return json.loads(r.stdout)

        step = {"op": "exec", "sandbox": worker.id, "cmd": "echo x >> /tmp/ran; wc -l < /tmp/ran"}
        for _ in range(2):
            answer = drive(agent, {**step, "step": 0})["result"]
            assert base64.b64decode(answer["stdout"]) == b"1\n"
        assert answer["replayed"]
        assert worker.exec("cat /tmp/ran").stdout == b"x\n"
        denied = drive(agent, {"op": "exec", "sandbox": other.id, "cmd": "touch /tmp/x"})
        assert denied["error"]["type"] == "UnknownSandbox"
        assert other.exec("test -e /tmp/x").exit_code == 1
        refused = worker.exec([AGENT_PATH, "drive"], stdin='{"op": "workers"}\n')
        assert refused.exit_code != 0 or b"error" in refused.stdout

    def test_a_memory_window_bounds_one_judged_case(self, dsec_client, dsec_node):
        """Judge mode over the backend's memory window: in a member of 160 MiB, a case limited
        to 32 MiB that asks for 64 MiB is MLE, while the next case, within it, is accepted."""
        self.need(Feature.RESET)
        self.need(Feature.MEMORY_WINDOW)
        env = dsec_node.environment("kit-judge")
        r = dsec_client.judge(
            env,
            'read n; dd if=/dev/zero of=/dev/null bs="$n" count=1 2>/dev/null && echo ok',
            cases=[JudgeCase(b"64M\n", b"ok\n"), JudgeCase(b"8M\n", b"ok\n")],
            memory="160M",
            memory_limit="32M",
            backend=self.backend_name,
        )
        assert [c.verdict for c in r.cases] == ["MLE", "AC"], r.cases

    def test_devices_reach_their_holder_only(self, dsec_sandboxes, dsec_node):
        """A device of the node's inventory (the kit's stand-in, /dev/null's numbers) appears
        in the sandbox that holds it, at its path, and works; an exclusive holder keeps it from
        others; a sandbox without it does not see it; it serves again after a kill."""
        self.need(Feature.DEVICES)
        path = dsec_node.device
        if path is None:
            pytest.skip("the kit could not make a stand-in device node under /dev")
        sb = dsec_sandboxes.create(devices=[KIT_DEVICE_KIND])
        assert sb.info.devices == (os.fspath(path),)
        r = sb.exec(f"stat -c '%t:%T' {path} && echo data > {path} && echo wrote")
        assert r.stdout.split() == [b"1:3", b"wrote"], r
        with pytest.raises(AdmissionRejected) as e:
            dsec_sandboxes.create(devices=[f"{KIT_DEVICE_KIND}:shared"])
        assert e.value.pool == f"devices:{KIT_DEVICE_KIND}" and sb.id in str(e.value)
        other = dsec_sandboxes.create()
        assert other.exec(f"test -e {path}").exit_code != 0
        sb.kill()
        again = dsec_sandboxes.create(devices=[KIT_DEVICE_KIND])
        assert again.info.devices == (os.fspath(path),)

    def test_no_screen_is_a_typed_refusal(self, dsec_sandboxes):
        """Without ``Feature.SCREEN`` a screenshot and input are each a ``FeatureUnavailable``
        naming the feature (the client's error, not the node's)."""
        if Feature.SCREEN in self.backend_class().features:
            pytest.skip(f"backend {self.backend_name!r} has a screen (test_screen_shows)")
        sb = dsec_sandboxes.create()
        for call in (sb.screenshot, lambda: sb.input([{"type": "key", "key": "a"}])):
            with pytest.raises(FeatureUnavailable) as e:
                call()
            assert e.value.feature == Feature.SCREEN.value

    def test_screen_shows_and_refuses_bad_input(self, dsec_sandboxes):
        """With ``Feature.SCREEN`` a screenshot is a PNG and bad input is refused before it is
        sent."""
        self.need(Feature.SCREEN)
        sb = dsec_sandboxes.create()
        png = sb.screenshot()
        assert png.startswith(b"\x89PNG\r\n\x1a\n"), png[:16]
        with pytest.raises(InvalidSpec):
            sb.input([{"type": "click", "x": -1, "y": 0}])

    def test_memory_snapshot_forks_go_on_from_its_instant(self, dsec_sandboxes, dsec_client):
        """Two sandboxes restored from one memory snapshot each hold what the saved one had
        at that instant (a file, a session's variable, a process still running), each with
        its own writable layer; the saved sandbox runs on."""
        self.need(Feature.MEMORY_SNAPSHOT)
        sb = dsec_sandboxes.create()
        marker = _marker()
        s = sb.session()
        s.exec("KEPT=41")
        sb.exec(f"sleep {marker} > /dev/null 2>&1 &", background=True).check()
        sb.write_file("/root/before", b"saved")
        snap = dsec_client.snapshot_memory(sb.id, f"kit-{sb.id}")
        try:
            forks = dsec_client.restore(snap.name, 2)
            try:
                for i, f in enumerate(forks):
                    assert f.read_file("/root/before") == b"saved"
                    assert _sandbox_has(f, f"sleep {marker}"), "the fork lost a process"
                    f.write_file("/root/mine", str(i).encode())
                assert [f.read_file("/root/mine") for f in forks] == [b"0", b"1"]
            finally:
                for f in forks:
                    f.kill()
        finally:
            dsec_client.remove_memory_snapshot(snap.name)
        assert s.exec("echo $((KEPT+1))").stdout == b"42\n"
        assert sb.exec("test -e /root/mine").exit_code != 0

    def test_pack_diff_restores_on_this_backend(self, dsec_sandboxes, dsec_client):
        """With ``Feature.PACK_DIFF``: a sandbox's writable layer packed into a snapshot layer
        (a file written, a file of its layers removed) and restored twice on the same backend:
        each restored sandbox holds the file and lacks the removed one, with a writable layer
        of its own; the packed sandbox runs on, and writes to it after the pack are its
        alone."""
        self.need(Feature.PACK_DIFF)
        if not self.writable_root:
            pytest.skip(f"backend {self.backend_name!r} has a read-only root (writable_root)")
        sb = dsec_sandboxes.create()
        sb.exec("mkdir -p /root/work && echo packed > /root/work/file && rm -f /bin/true").check()
        info = dsec_client.pack_diff(sb.id, name=f"kit-pack-{sb.id}")
        assert info.kind == "snapshot" and info.parents
        sb.exec("echo after > /root/work/later").check()
        restored = dsec_client.restore(info.ref, 2, spec=dsec_sandboxes.spec())
        dsec_sandboxes.created.extend(r.id for r in restored)
        for i, r in enumerate(restored):
            assert r.read_file("/root/work/file") == b"packed\n"
            assert r.exec("test -e /bin/true").exit_code != 0, "the removal was not packed"
            assert r.exec("test -e /root/work/later").exit_code != 0
            r.write_file("/root/work/mine", str(i).encode())
        assert [r.read_file("/root/work/mine") for r in restored] == [b"0", b"1"]
        assert sb.exec("cat /root/work/later").stdout == b"after\n"
        assert sb.exec("test -e /root/work/mine").exit_code != 0

    def test_memory_a_sandbox_frees_goes_back_to_the_host(self, dsec_sandboxes):
        """With ``Feature.BALLOON``: 64 MiB a sandbox fills (a tmpfs file) and then frees
        leave its host memory (``usage().memory``) within seconds, not only its own view."""
        self.need(Feature.BALLOON)
        sb = dsec_sandboxes.create(memory="384M")
        base = sb.usage().memory
        sb.exec("dd if=/dev/urandom of=/dev/shm/fill bs=1048576 count=64 2>/dev/null").check()
        high = sb.usage().memory
        assert high is not None and base is not None and high > base + (48 << 20), (base, high)
        sb.exec("rm /dev/shm/fill").check()
        until(
            lambda: (sb.usage().memory or high) < high - (40 << 20),
            timeout=30,
            what="the freed memory back on the host",
        )

    def test_writes_are_private(self, dsec_sandboxes):
        a, b = dsec_sandboxes.create(), dsec_sandboxes.create()
        if not self.writable_root:
            assert a.exec("echo mine > /etc/motd-a").exit_code != 0
            assert a.exec("rm -f /bin/true").exit_code != 0
            a.exec("echo mine > /tmp/motd-a").check()
            assert b.exec("cat /tmp/motd-a").exit_code != 0
            assert b.exec("/bin/true").exit_code == 0
            return
        a.exec("echo mine > /etc/motd-a; rm -f /bin/true").check()
        assert b.exec("cat /etc/motd-a").exit_code != 0
        assert b.exec("/bin/true").exit_code == 0

    # --- warm claims ----------------------------------------------------------------------
    #: What the kit compares between a cold sandbox and a claimed one: the environment
    #: commands get, the processes running, the files of the root and the work areas, the
    #: limits as the sandbox sees them, and the hostname (each sandbox's id in it as ``ID``).
    LOOK_ALIKE = (
        "env | sort",
        # read by the shell itself, then sorted: no process of the pipeline races the glob
        'x=$(for p in /proc/[0-9]*; do read -r c < $p/comm && echo "$c"; done); echo "$x" | sort',
        "find / -xdev 2>/dev/null | sort",
        "ls -la /tmp /root 2>/dev/null | awk '{print $1, $3, $4, $NF}'",
        "ulimit -a",
        "cat /sys/fs/cgroup/memory.max /sys/fs/cgroup/pids.max /sys/fs/cgroup/cpu.max "
        "2>/dev/null; true",
        "hostname",
    )

    def test_a_warm_claim_is_like_a_cold_create(self, dsec_sandboxes, dsec_client):
        """A create that claims a warm member gets a sandbox indistinguishable from a cold one
        of the same spec: files, processes, env, limits (``dsec_core.node.warm``). What two
        cold sandboxes of this backend show differently (a backend without a user namespace
        shows each sandbox's own uids) is not compared; warm members are never listed."""
        env = {"FROM_SPEC": "spec", "LANG": "C"}
        colds = [dsec_sandboxes.create(env=env) for _ in range(2)]
        shape = dsec_sandboxes.spec()
        ids_before = {i.id for i in dsec_client.list()}
        dsec_client.set_warm([(shape, 1)])
        try:
            deadline = time.monotonic() + 60
            while not any(p.ready for p in dsec_client.warm().pools):
                assert time.monotonic() < deadline, dsec_client.warm()
                time.sleep(0.05)
            listed = {i.id for i in dsec_client.list()}
            assert not listed - ids_before, "a warm member was listed"
            claimed = dsec_sandboxes.create(env=env, labels={"kit": "warm"})
            assert [p.claimed for p in dsec_client.warm().pools] == [1], "it did not claim"
        finally:
            dsec_client.set_warm([])
        assert claimed.id not in {c.id for c in colds} and claimed.info.labels == {"kit": "warm"}
        assert claimed.info.limits == colds[0].info.limits
        compared = 0
        for command in self.LOOK_ALIKE:
            seen = [
                sb.exec(command).stdout.decode().replace(sb.id[:12], "ID")
                for sb in (*colds, claimed)
            ]
            if seen[0] != seen[1]:
                continue  # two cold sandboxes differ here: the backend's own identity shows
            compared += 1
            assert seen[0] == seen[2], f"{command!r} differs: cold {seen[0]!r}, warm {seen[2]!r}"
        assert compared >= 4, "cold sandboxes of this backend differ in nearly everything"
        listed = {i.id for i in dsec_client.list()}
        assert {colds[0].id, claimed.id} <= listed
        assert not listed - ids_before - {claimed.id}, "a warm member was listed"

    # --- helpers --------------------------------------------------------------------------
    @staticmethod
    def _assert_nothing_left(dsec_node: Any, sandbox_id: str) -> None:
        left = leftovers(dsec_node.home)
        assert sandbox_id not in left["sandbox_dirs"], left
        assert not [m for m in left["mounts"] if sandbox_id in m], left
        assert not [c for c in left["cgroups"] if sandbox_id in c], left
