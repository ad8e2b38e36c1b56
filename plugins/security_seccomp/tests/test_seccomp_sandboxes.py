"""The profile in real sandboxes: in force by default, off on request, what it denies (a static
probe tries each call as root inside), what its settings lift, and ordinary work still runs."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
from dsec_security_seccomp.policy import absent_architectures
from dsec_security_seccomp.probe import run_probe

from dsec_core.config import NodeConfig
from dsec_core.errors import InvalidSpec, UnknownLayer
from dsec_core.layers.store import LayerStore
from dsec_core.testing import leftovers

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="sandboxes need root")

#: What the default profile refuses, each tried by the probe as root in the sandbox.
DENIED = [
    "unshare_user", "clone_user", "nested_caps", "nested_tmpfs", "nested_bind", "nested_overlay",
    "nested_raw", "nested_packet", "nested_nft", "keyctl", "add_key", "request_key",
    "io_uring_setup", "userfaultfd", "bpf", "perf_event_open", "init_module", "finit_module",
    "delete_module", "kexec_load", "kexec_file_load", "pidfd_getfd", "fanotify_init",
    "socket_vsock", "socket_vsock_hibits", "personality_noaslr", "ficlone", "ficlonerange",
    "fideduperange",
    "xfs_swapext", "ext4_move_ext", "ficlone_hibits", "i386_unshare_user", "i386_clone_user",
    "i386_keyctl", "i386_add_key", "i386_io_uring_setup", "i386_userfaultfd", "i386_bpf",
    "i386_perf_event_open", "i386_init_module", "i386_ficlone",
]  # fmt: skip
#: What must still work under it.
ALLOWED = ["fork", "socket_tcp", "unshare_fs", "ptrace_child", "i386_getpid"]

DEBIAN_BASE = "debian-python@12-2"


def _seccomp_mode(sb) -> str:
    r = sb.exec("grep '^Seccomp:' /proc/1/status")
    return r.stdout.decode().split()[-1]


def test_every_sandbox_gets_the_profile_unless_its_spec_turns_it_off(dsec_sandboxes, dsec_client):
    sb = dsec_sandboxes.create()
    assert sb.info.policies["seccomp"] == "enforced"
    assert _seccomp_mode(sb) == "2"  # a filter, on the agent and all it starts
    (state,) = [p for p in dsec_client.policies(sb.id) if p.name == "seccomp"]
    assert state.stats["default"] == "EPERM" and "SCMP_ARCH_X86" in state.stats["architectures"]
    assert state.stats["via"] == "agent"  # compiled once in the daemon, installed by the agent
    off = dsec_sandboxes.create(policies={"seccomp": {"enabled": False}})
    assert off.info.policies["seccomp"].startswith("off:")
    assert _seccomp_mode(off) == "0"


def test_bad_settings_fail_the_create_and_leave_nothing(dsec_sandboxes, dsec_client, dsec_node):
    before = {s.id for s in dsec_client.list()}
    dirs_before = set(leftovers(dsec_node.home)["sandbox_dirs"])
    for settings, field in (
        ({"allow": ["no_such_call"]}, "policies.seccomp.allow[0]"),
        ({"userns": 1}, "policies.seccomp.userns"),
        ({"deny": ["read"]}, "policies.seccomp.deny"),
    ):
        with pytest.raises(InvalidSpec) as e:
            dsec_sandboxes.create(policies={"seccomp": settings})
        assert e.value.field == field, e.value
    assert {s.id for s in dsec_client.list()} == before
    assert set(leftovers(dsec_node.home)["sandbox_dirs"]) == dirs_before


def test_the_probe_under_the_default_profile(dsec_sandboxes, probe):
    sb = dsec_sandboxes.create()
    sb.exec("echo data > /tmp/dst").check()
    got = run_probe(sb, probe, *DENIED, *ALLOWED, env={"PROBE_DST": "/tmp/dst"})
    assert {n: got[n] for n in ALLOWED} == dict.fromkeys(ALLOWED, "ok")
    # everything else fails with EPERM from the filter
    assert {n: got[n] for n in DENIED} == dict.fromkeys(DENIED, "EPERM")
    # an x32 call: EPERM where the kernel runs x32; where it does not, x32 is left out of the
    # filter, and libseccomp's filter kills a caller that uses an ABI it was not built for
    x32 = run_probe(sb, probe, "x32_unshare_user")["x32_unshare_user"]
    assert x32 == ("signal:31" if "SCMP_ARCH_X32" in absent_architectures("x86_64") else "EPERM")
    # clone3 is answered ENOSYS, so that libc falls back to clone, whose flags are filtered;
    # so is a call newer than the profile (statmount), as runc's filters answered it
    assert run_probe(sb, probe, "clone3_plain", "clone3_user", "statmount") == {
        "clone3_plain": "ENOSYS",
        "clone3_user": "ENOSYS",
        "statmount": "ENOSYS",
    }
    assert sb.exec("cat /tmp/dst").stdout == b"data\n"


def test_userns_lets_the_sandbox_nest_namespaces(dsec_sandboxes, probe):
    sb = dsec_sandboxes.create(policies={"seccomp": {"userns": True}})
    nested = ["unshare_user", "clone_user", "clone3_user", "i386_unshare_user", "nested_caps",
              "nested_tmpfs", "nested_bind", "nested_overlay", "nested_raw", "nested_packet",
              "nested_nft"]  # fmt: skip
    assert run_probe(sb, probe, *nested) == dict.fromkeys(nested, "ok")
    # only namespaces: the rest of the profile holds
    assert run_probe(sb, probe, "keyctl", "io_uring_setup", "ficlone") == dict.fromkeys(
        ("keyctl", "io_uring_setup", "ficlone"), "EPERM"
    )


def test_allow_lifts_exactly_the_calls_it_names(dsec_sandboxes, probe):
    sb = dsec_sandboxes.create(
        policies={"seccomp": {"allow": ["io_uring_setup", "perf_event_open"]}}
    )
    got = run_probe(sb, probe, "io_uring_setup", "i386_io_uring_setup", "perf_event_open",
                    "keyctl", "userfaultfd", "unshare_user")  # fmt: skip
    assert got == {
        "io_uring_setup": "ok",
        "i386_io_uring_setup": "ok",
        "perf_event_open": "ok",
        "keyctl": "EPERM",
        "userfaultfd": "EPERM",
        "unshare_user": "EPERM",
    }


def test_busybox_work_runs_under_the_profile(dsec_sandboxes):
    sb = dsec_sandboxes.create()
    script = r"""
set -e
cd /tmp
mkdir -p w/a/b && echo hello > w/a/b/f && ln -s f w/a/b/l && chmod 600 w/a/b/f
tar czf w.tgz w && rm -rf w && tar xzf w.tgz && test "$(cat w/a/b/l)" = hello
find w -type f | sort | xargs md5sum > sums && md5sum -c sums >/dev/null
seq 1 2000 | awk '{s+=$1} END {print s}' | grep -qx 2001000
printf 'b\na\nc\n' | sort | sed -n 2p | grep -qx b
dd if=/dev/zero of=z bs=64k count=16 2>/dev/null && test "$(wc -c < z)" -eq 1048576
mkfifo p && (echo through > p &) && read line < p && test "$line" = through
sleep 5 & pid=$!; kill $pid; wait $pid || true
mkdir www && echo over-loopback > www/x && httpd -p 127.0.0.1:7123 -h /tmp/www
for i in 1 2 3 4 5 6 7 8 9 10; do wget -qO got http://127.0.0.1:7123/x && break; sleep 0.2; done
grep -qx over-loopback got
chroot / /bin/true
ps -o pid,comm >/dev/null && top -bn1 >/dev/null
date +%s >/dev/null && uname -a >/dev/null && id -u | grep -qx 0
echo fine
"""
    r = sb.exec(["/bin/sh", "-xc", script], timeout=60)  # -x: the failing step in the message
    assert r.exit_code == 0 and r.stdout.endswith(b"fine\n"), r.stderr.decode()[-2000:]


@pytest.fixture
def python_base(dsec_node) -> str:
    """The default catalog's Debian + python3 base (built by run.sh test in DSEC_TEST_HOME),
    copied into the kit node's store."""
    built = NodeConfig(home=Path(os.environ.get("DSEC_TEST_HOME", "/var/lib/dsec-test")))
    try:
        info = LayerStore(built.layer_dir).resolve(DEBIAN_BASE)
    except (UnknownLayer, OSError):
        pytest.skip(f"{DEBIAN_BASE} is not built (run.sh test builds the default catalog)")
    store = LayerStore(dsec_node.config.layer_dir)
    if not store.exists(DEBIAN_BASE):
        with store.scratch("seccomp-test-") as tmp:
            copy = tmp / "image.erofs"
            shutil.copyfile(LayerStore(built.layer_dir).image_path(info), copy)
            store.add(copy, name="debian-python", version="12-2", kind="base")
    return DEBIAN_BASE


PYTHON_WORK = r"""
import asyncio, mmap, multiprocessing, os, socket, subprocess, sys, tempfile, threading

def square(x):
    return x * x

async def echo_once():
    async def handle(reader, writer):
        writer.write(await reader.readline())
        await writer.drain()
        writer.close()
    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"ping\n")
    line = await reader.readline()
    writer.close()
    server.close()
    return line

if __name__ == "__main__":
    out = subprocess.run(["/bin/echo", "spawned"], capture_output=True, check=True).stdout
    assert out == b"spawned\n"
    with multiprocessing.Pool(2) as pool:
        assert pool.map(square, range(8)) == [x * x for x in range(8)]
    results = []
    threads = [threading.Thread(target=lambda: results.append(1)) for _ in range(8)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    assert len(results) == 8
    assert asyncio.run(echo_once()) == b"ping\n"
    pid = os.fork()
    if pid == 0:
        os._exit(7)
    assert os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == 7
    with tempfile.TemporaryFile() as f:
        f.write(b"x" * 4096)
        f.flush()
        with mmap.mmap(f.fileno(), 4096) as m:
            assert m[:1] == b"x"
    print("python fine", sys.version_info[:2])
"""


def test_python_in_the_default_base_runs_under_the_profile(dsec_sandboxes, python_base):
    sb = dsec_sandboxes.create(layers=(python_base,))
    assert sb.info.policies["seccomp"] == "enforced"
    sb.write_file("/tmp/work.py", PYTHON_WORK)
    r = sb.exec(["python3", "/tmp/work.py"], timeout=120)
    assert r.exit_code == 0 and b"python fine" in r.stdout, r
    r = sb.exec(
        "python3 -c 'import ctypes, json, sqlite3, ssl' && bash -c 'echo $((6 * 7))'", timeout=60
    )
    assert r.exit_code == 0 and r.stdout.endswith(b"42\n"), r


def test_the_profile_is_reported_after_a_daemon_restart(dsec_sandboxes, dsec_node):
    sb = dsec_sandboxes.create(policies={"seccomp": {"allow": ["io_uring_setup"]}})
    try:
        dsec_node.restart()
    finally:
        dsec_node.ensure_running()
    with dsec_node.client() as c:
        (state,) = [p for p in c.policies(sb.id) if p.name == "seccomp"]
        assert state.state == "enforced" and state.stats["allow"] == ["io_uring_setup"]
        again = c.get(sb.id)
        assert _seccomp_mode(again) == "2"
        again.kill()
