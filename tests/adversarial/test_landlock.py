"""Attacks on a sandbox's file policy (``landlock``): overwriting the shell and the toolkit under
read-only paths, reading answers and harness logs under hidden ones, and reaching outside the
sandbox's Landlock domain by signals, ptrace and abstract unix sockets.

Each attack runs as root inside a sandbox of the task layer (``dsec_security_landlock.testing``
on the kit's busybox base), by a static C probe (``landlock_probe.c``) making the system calls
itself, twice: in a sandbox without the policy (the control: the attack works there, so the
policy is what stops it) and in one with ``TASK_POLICY``. Where Landlock does not mediate what
is tried (metadata), the test shows exactly what gets through and ends as a known gap.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dsec_core.config import NodeConfig
from dsec_core.errors import UnknownLayer
from dsec_core.layers.store import LayerStore
from dsec_core.linux.tools import compile_static

testing = pytest.importorskip(
    "dsec_security_landlock.testing", reason="the security_landlock plugin is not installed"
)
ANSWER, HARNESS_LOG, JUDGE = testing.ANSWER, testing.HARNESS_LOG, testing.JUDGE
TASK_FILES, TASK_POLICY = testing.TASK_FILES, testing.TASK_POLICY

PROBE_SOURCE = Path(__file__).with_name("landlock_probe.c")
PROBE = "/tmp/landlock-probe"  # /tmp: a new top-level entry would get no rights at all
DEBIAN_BASE = "debian-python@12-2"


@pytest.fixture(scope="module")
def probe_binary(tmp_path_factory) -> bytes:
    out = tmp_path_factory.mktemp("probe") / "landlock_probe"
    compile_static([PROBE_SOURCE], out, "the landlock probe", flags=["-O2", "-Wall"])
    return out.read_bytes()


@pytest.fixture
def task(dsec_node) -> tuple[str, ...]:
    info = testing.task_layer(LayerStore(dsec_node.config.layer_dir))
    return (info.ref, dsec_node.layer.ref)


@pytest.fixture
def pair(dsec_sandboxes, task, probe_binary):
    """(control, guarded): the task's sandbox without the policy and with it, probe inside."""
    control = dsec_sandboxes.create(layers=task)
    guarded = dsec_sandboxes.create(layers=task, policies={"landlock": TASK_POLICY})
    assert "landlock" not in control.info.policies
    assert guarded.info.policies["landlock"] == "enforced"
    for sb in (control, guarded):
        sb.write_file(PROBE, probe_binary, mode=0o755)
    return control, guarded


def attempt(sb, *args: str) -> dict[str, str]:
    """The probe's "step: outcome" lines."""
    r = sb.exec([PROBE, *args], timeout=30)
    out = {}
    for line in r.stdout.decode(errors="replace").splitlines():
        what, sep, outcome = line.partition(": ")
        if sep:
            out[what] = outcome
    assert out, r
    return out


def worked(steps: dict[str, str]) -> set[str]:
    return {w for w, outcome in steps.items() if outcome == "ok"}


# --- read-only paths --------------------------------------------------------------------------
OVERWRITE_STEPS = {
    "write", "truncate", "link out", "write through the link", "create beside", "mkdir beside",
    "symlink beside", "mkfifo beside", "link in beside", "rename out", "rename over", "unlink",
}  # fmt: skip


@pytest.mark.attack("overwrite the shell's binary and a toolkit binary under read-only paths")
def test_overwrite_the_shell_and_the_toolkit(pair, witness):
    control, guarded = pair
    for path in ("/bin/busybox", JUDGE):  # /bin/sh -> /bin/busybox on the kit's base
        assert worked(attempt(control, "overwrite", path)) == OVERWRITE_STEPS, path
        steps = attempt(guarded, "overwrite", path)
        assert set(steps) == OVERWRITE_STEPS and not worked(steps), (path, steps)
        assert set(steps.values()) <= {"EACCES", "EXDEV"}, steps  # Landlock's answers
    # the binaries are what the layers hold, and still run
    assert guarded.read_file(JUDGE) == TASK_FILES[JUDGE][0]
    assert guarded.exec(JUDGE).stdout == b"judged: all cases passed\n"
    assert guarded.exec(["/bin/sh", "-c", "echo intact"]).stdout == b"intact\n"
    assert control.exec(JUDGE).exit_code != 0  # the control's toolkit is gone


@pytest.fixture
def debian_base(dsec_node) -> str:
    """The default catalog's Debian base (built by run.sh test in DSEC_TEST_HOME), copied into
    the kit node's store: a real /bin/bash, and /bin a symlink to usr/bin (merged /usr)."""
    built = NodeConfig(home=Path(os.environ.get("DSEC_TEST_HOME", "/var/lib/dsec-test")))
    try:
        info = LayerStore(built.layer_dir).resolve(DEBIAN_BASE)
    except (UnknownLayer, OSError):
        pytest.skip(f"{DEBIAN_BASE} is not built (run.sh test builds the default catalog)")
    store = LayerStore(dsec_node.config.layer_dir)
    if not store.exists(DEBIAN_BASE):
        with store.scratch("landlock-test-") as tmp:
            copy = tmp / "image.erofs"
            shutil.copyfile(LayerStore(built.layer_dir).image_path(info), copy)
            store.add(copy, name="debian-python", version="12-2", kind="base")
    return DEBIAN_BASE


@pytest.mark.attack("overwrite /bin/bash on a Debian base, /bin read-only (a symlink to usr/bin)")
def test_overwrite_bin_bash(dsec_sandboxes, debian_base, probe_binary, witness):
    control = dsec_sandboxes.create(layers=(debian_base,))
    guarded = dsec_sandboxes.create(
        layers=(debian_base,), policies={"landlock": {"read_only": ["/bin"]}}
    )
    for sb in (control, guarded):
        sb.write_file(PROBE, probe_binary, mode=0o755)
    bash = guarded.read_file("/usr/bin/bash")
    assert worked(attempt(control, "overwrite", "/bin/bash")) == OVERWRITE_STEPS
    # the agent resolved /bin to /usr/bin: the file is protected by either name
    for path in ("/bin/bash", "/usr/bin/bash"):
        steps = attempt(guarded, "overwrite", path)
        assert set(steps) == OVERWRITE_STEPS and not worked(steps), (path, steps)
    assert guarded.read_file("/bin/bash") == bash
    assert guarded.exec(["/bin/bash", "-c", "echo $((6 * 7))"]).stdout == b"42\n"
    assert control.exec(["/bin/bash", "-c", "true"]).exit_code != 0  # the control's is gone


@pytest.mark.attack("chmod a read-only toolkit binary (metadata, not a write)")
def test_chmod_a_read_only_binary(pair, witness):
    control, guarded = pair
    assert worked(attempt(control, "chmod", JUDGE)) == {"chmod 04777"}
    steps = attempt(guarded, "chmod", JUDGE)
    # what holds: the contents, and no setuid bit takes effect (nosuid mounts, no_new_privs)
    assert guarded.read_file(JUDGE) == TASK_FILES[JUDGE][0]
    assert guarded.exec(JUDGE).stdout == b"judged: all cases passed\n"
    if steps["chmod 04777"] == "ok":
        pytest.xfail("Landlock does not mediate chmod/chown/utimes: modes can change, contents not")


# --- hidden paths -----------------------------------------------------------------------------
READ_STEPS = {
    "open and read", "mmap", "list its directory", "symlink from /tmp", "hard link into /tmp",
    "..", "/tmp/..", "/proc/self/root", "/proc/1/root", "openat from an O_PATH handle",
    "chdir and read", "rename its directory out",
}  # fmt: skip


@pytest.mark.attack("read answer files and harness logs under hidden paths, twelve ways")
def test_read_answers_and_harness_logs(pair, witness):
    control, guarded = pair
    for path in (ANSWER, HARNESS_LOG):
        got = worked(attempt(control, "read", path))
        # out of reach even without the policy: /proc/1/root is the agent's (non-dumpable),
        # and overlayfs refuses to move a directory of a read-only layer (EXDEV)
        assert got == READ_STEPS - {"/proc/1/root", "rename its directory out"}, (path, got)
    for path in (ANSWER, HARNESS_LOG):
        steps = attempt(guarded, "read", path)
        assert set(steps) == READ_STEPS and not worked(steps), (path, steps)
    assert guarded.read_file(ANSWER) == TASK_FILES[ANSWER][0]  # still there, unread


@pytest.mark.attack("find and read hidden answers by names tested with stat")
def test_stat_based_guessing(pair, witness):
    control, guarded = pair
    assert worked(attempt(control, "stat", ANSWER)) == {"stat", "list its directory"}
    steps = attempt(guarded, "stat", ANSWER)
    # names cannot be listed, contents cannot be read...
    assert steps["list its directory"] == "EACCES"
    assert not worked(attempt(guarded, "read", ANSWER))
    # ...but a name known or guessed can be tested, and its size and times read
    if steps["stat"] == "ok":
        pytest.xfail("Landlock does not mediate stat: existence and size beneath a hidden path")


@pytest.mark.attack("bind-mount a hidden directory elsewhere from a nested user namespace")
def test_bind_mount_trick(dsec_sandboxes, task, probe_binary, witness):
    # nested namespaces need the seccomp profile's userns setting; Landlock refuses any mount
    # to a process in its domain, whatever its capabilities there
    nested = {"seccomp": {"userns": True}}
    control = dsec_sandboxes.create(layers=task, policies=nested)
    guarded = dsec_sandboxes.create(layers=task, policies={**nested, "landlock": TASK_POLICY})
    for sb in (control, guarded):
        sb.write_file(PROBE, probe_binary, mode=0o755)
    steps = ["nested namespaces", "make mounts private", "bind mount", "read through the view"]
    assert attempt(control, "bind", ANSWER) == dict.fromkeys(steps, "ok")
    assert attempt(guarded, "bind", ANSWER) == {
        "nested namespaces": "ok",  # the seccomp setting allows them
        "make mounts private": "EPERM",  # Landlock: no mount changes at all inside a domain
        "bind mount": "EPERM",
        "read through the view": "ENOENT",  # nothing was mounted there
    }


# --- scope: signals, ptrace, abstract sockets -------------------------------------------------
def _inside(sb, *argv: str, namespaces: tuple[str, ...] = ("-U", "-p", "-n")) -> subprocess.Popen:
    """A host program started in the sandbox's user, pid and network namespaces: part of the
    sandbox to its processes, but never in its Landlock domain (like the agent)."""
    return subprocess.Popen(
        ["nsenter", "-t", str(sb.refresh().pid), *namespaces, "--", *argv],
        stdout=subprocess.PIPE,
        text=True,
    )


def _victim(sb) -> subprocess.Popen:
    """A dumpable process of root in the sandbox, outside its domain, with no capabilities (a
    command could trace it: the same ids, a subset of its capabilities)."""
    return _inside(sb, "setpriv", "--bounding-set=-all", "--inh-caps=-all", "sleep", "1000")


def _pid_inside(nsenter: subprocess.Popen, comm: str | None = None) -> int:
    """The pid, in the sandbox's pid namespace, of the process nsenter started there; with
    ``comm``, once it runs that program (before its exec it is not yet dumpable: entering the
    user namespace cleared that, and on a loaded machine a probe could come in between)."""
    for _ in range(1000):
        try:
            kids = Path(f"/proc/{nsenter.pid}/task/{nsenter.pid}/children").read_text().split()
            if (
                kids
                and comm is not None
                and Path(f"/proc/{kids[0]}/comm").read_text().strip() != comm
            ):
                kids = []
            if kids:
                status = Path(f"/proc/{kids[0]}/status").read_text()
                nspid = next(line for line in status.splitlines() if line.startswith("NSpid:"))
                return int(nspid.split()[-1])
        except (OSError, StopIteration):
            pass
        time.sleep(0.01)
    raise AssertionError("nsenter started nothing")


def _stop(proc: subprocess.Popen) -> None:
    """Kill what nsenter started (it forks into a pid namespace), then nsenter."""
    try:
        kids = Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split()
    except OSError:
        kids = []
    for pid in kids:
        try:
            os.kill(int(pid), signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.send_signal(signal.SIGKILL)
    proc.wait(10)


@pytest.mark.attack("signal the agent, and a process outside the sandbox's domain, with scope")
def test_signal_outside_the_domain(pair, witness):
    control, guarded = pair
    for sb, expect in ((control, "ok"), (guarded, "EPERM")):
        victim = _victim(sb)
        try:
            pid = _pid_inside(victim, "sleep")
            steps = attempt(sb, "signal", "1")  # the agent: delivered and ignored, or refused
            assert steps == {"kill 0": expect, "SIGTERM": expect}, (sb, steps)
            steps = attempt(sb, "signal", str(pid))
            assert steps == {"kill 0": expect, "SIGTERM": expect}, (sb, steps)
            time.sleep(0.2)
            assert (victim.poll() is None) == (expect == "EPERM"), "the victim's fate"
        finally:
            _stop(victim)
    assert guarded.exec("echo serving").stdout == b"serving\n"


@pytest.mark.attack("ptrace and read /proc/PID/environ of a dumpable process outside the domain")
def test_trace_outside_the_domain(pair, witness):
    """What Landlock adds to the agent's own defences: a process outside the domain cannot be
    traced or have its /proc files read even when it is dumpable and has the same ids (the
    agent relies on being non-dumpable; this holds without that)."""
    control, guarded = pair
    for sb, expect in ((control, "ok"), (guarded, "EPERM")):
        victim = _victim(sb)
        try:
            steps = attempt(sb, "trace", str(_pid_inside(victim, "sleep")))
            want = {"ptrace attach": expect, "read /proc/PID/environ": expect}
            if expect == "EPERM":
                want["read /proc/PID/environ"] = "EACCES"
            assert steps == want, (sb, steps)
        finally:
            _stop(victim)


LISTENER = """
import socket, sys
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
s.bind("\\0" + sys.argv[1])
s.listen(4)
print("ready", flush=True)
s.settimeout(20)
try:
    s.accept()
    print("accepted", flush=True)
except OSError:
    pass
"""


@pytest.mark.attack("connect to an abstract unix socket made outside the domain, with scope")
def test_abstract_socket_outside_the_domain(pair, witness):
    control, guarded = pair
    for sb, expect in ((control, "ok"), (guarded, "EPERM")):
        name = f"dsec-outside-{sb.id[:8]}"
        listener = _inside(sb, sys.executable, "-c", LISTENER, name, namespaces=("-n",))
        try:
            assert listener.stdout is not None and listener.stdout.readline() == "ready\n"
            assert attempt(sb, "connect", name) == {"connect": expect}, sb
        finally:
            _stop(listener)
    # inside the domain, across calls, abstract sockets work as ever
    guarded.exec(f"{PROBE} listen inner 20 > /tmp/inner.out &", background=True).check()
    for _ in range(100):
        if b"listen: ok" in guarded.exec("cat /tmp/inner.out").stdout:
            break
        time.sleep(0.02)
    assert attempt(guarded, "connect", "inner") == {"connect": "ok"}


# --- what the policy must leave to the trainer ------------------------------------------------
def test_the_trainers_file_operations_reach_protected_paths(pair):
    """Not an attack: the node's own file API, which trainers and verifiers use, is served
    outside the domain: it reads hidden answers and logs and installs into read-only paths."""
    _, guarded = pair
    assert guarded.read_file(ANSWER) == TASK_FILES[ANSWER][0]
    assert guarded.read_file(HARNESS_LOG) == TASK_FILES[HARNESS_LOG][0]
    assert {e.name for e in guarded.list_dir("/var/log/harness")} == {"run.log"}
    guarded.write_file(JUDGE, b"#!/bin/sh\necho new harness\n", mode=0o755)
    assert guarded.exec(JUDGE).stdout == b"new harness\n"
    assert not worked(attempt(guarded, "overwrite", JUDGE))
    assert guarded.exec(JUDGE).stdout == b"new harness\n"
