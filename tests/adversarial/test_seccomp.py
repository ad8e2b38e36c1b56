"""Kernel surfaces a sandbox has no business in, attacked as root inside with a static C probe
(``dsec_security_seccomp.probe``): each attempt fails under the default seccomp profile, and
the same attempt in a sandbox whose spec turns the profile off shows that the kernel would have
let it through, so the filter is what holds. Specs that ask for ``userns`` or ``allow`` get
exactly what they ask for."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from dsec_core.records import SandboxSpec
from dsec_core.testing import KitNode, running_kit_node

probe_module = pytest.importorskip(
    "dsec_security_seccomp.probe", reason="the security_seccomp plugin is not installed"
)
run_probe = probe_module.run_probe

OFF = {"seccomp": {"enabled": False}}


@pytest.fixture(scope="module")
def probe(tmp_path_factory) -> Path:
    if not shutil.which("gcc"):
        pytest.skip("the probe needs gcc (apt-get install gcc libc6-dev)")
    return probe_module.build_probe(tmp_path_factory.mktemp("probe"))


def _mounts_of(node, *sandboxes) -> set[str]:
    """The host's mount points inside the sandboxes' runtime directories (their root
    filesystems): where a mount made inside would show if it leaked out."""
    dirs = [os.fspath(node.config.runtime_dir / sb.id) for sb in sandboxes]
    with open("/proc/self/mountinfo") as f:
        points = {line.split()[4] for line in f}
    return {m for m in points if any(m.startswith(d) for d in dirs)}


def _nft_tables() -> str:
    nft = shutil.which("nft")
    if nft is None:
        return ""
    return subprocess.run([nft, "list", "tables"], capture_output=True, text=True).stdout


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _sandboxes(dsec_sandboxes):
    """A sandbox under the default profile and one whose spec turns it off."""
    guarded = dsec_sandboxes.create()
    bare = dsec_sandboxes.create(policies=OFF)
    assert guarded.info.policies["seccomp"] == "enforced"
    assert bare.info.policies["seccomp"].startswith("off")
    return guarded, bare


def _attempt(dsec_sandboxes, probe, names, env=None):
    """The probes in a sandbox under the default profile and in one without it."""
    guarded, bare = _sandboxes(dsec_sandboxes)
    return run_probe(guarded, probe, *names, env=env), run_probe(bare, probe, *names, env=env)


@pytest.mark.attack("nested user namespace, then tmpfs, bind and overlay mounts")
def test_nested_userns_mounts(dsec_sandboxes, witness, probe, dsec_node):
    names = ["nested_tmpfs", "nested_bind", "nested_overlay"]
    guarded, bare = _sandboxes(dsec_sandboxes)
    before = _mounts_of(dsec_node, guarded, bare)
    off = run_probe(bare, probe, *names)
    assert off == dict.fromkeys(names, "ok"), "the kernel refuses these anyway: test is void"
    assert run_probe(guarded, probe, *names) == dict.fromkeys(names, "EPERM")
    assert _mounts_of(dsec_node, guarded, bare) == before  # nothing propagated to the host


@pytest.mark.attack("unshare (and clone, clone3, int $0x80) to regain capabilities")
def test_unshare_to_regain_capabilities(dsec_sandboxes, witness, probe):
    names = ["unshare_user", "clone_user", "i386_unshare_user", "i386_clone_user", "nested_caps"]
    on, off = _attempt(dsec_sandboxes, probe, [*names, "clone3_user", "cap_sys_admin"])
    assert {n: off[n] for n in names} == dict.fromkeys(names, "ok")
    assert {n: on[n] for n in names} == dict.fromkeys(names, "EPERM")
    assert on["clone3_user"] == "ENOSYS"  # libc falls back to clone, filtered above
    assert on["cap_sys_admin"] == off["cap_sys_admin"] == "EPERM"


@pytest.mark.attack("raw and packet sockets, from the sandbox and from a nested userns")
def test_raw_and_packet_sockets(dsec_sandboxes, witness, probe):
    names = ["socket_raw", "socket_packet", "i386_socket_packet", "nested_raw", "nested_packet"]
    on, off = _attempt(dsec_sandboxes, probe, names)
    assert off["nested_raw"] == off["nested_packet"] == "ok"
    assert on == dict.fromkeys(names, "EPERM")


@pytest.mark.attack("nf_tables table creation, in the sandbox and in a nested userns")
def test_nf_tables(dsec_sandboxes, witness, probe):
    host_tables = _nft_tables()
    on, off = _attempt(dsec_sandboxes, probe, ["nft_table", "nested_nft"])
    assert off["nested_nft"] == "ok"
    assert on == {"nft_table": "EPERM", "nested_nft": "EPERM"}
    assert _nft_tables() == host_tables


@pytest.mark.attack("keyctl, add_key and request_key (the kernel keyring is not namespaced)")
def test_keyrings(dsec_sandboxes, witness, probe):
    names = ["keyctl", "add_key", "request_key", "i386_keyctl", "i386_add_key"]
    on, off = _attempt(dsec_sandboxes, probe, names)
    assert off == dict.fromkeys(names, "ok")
    assert on == dict.fromkeys(names, "EPERM")


@pytest.mark.attack("io_uring_setup")
def test_io_uring(dsec_sandboxes, witness, probe):
    names = ["io_uring_setup", "i386_io_uring_setup"]
    on, off = _attempt(dsec_sandboxes, probe, names)
    assert off == dict.fromkeys(names, "ok")
    assert on == dict.fromkeys(names, "EPERM")


@pytest.mark.attack("userfaultfd")
def test_userfaultfd(dsec_sandboxes, witness, probe):
    names = ["userfaultfd", "i386_userfaultfd"]
    on, off = _attempt(dsec_sandboxes, probe, names)
    assert off == dict.fromkeys(names, "ok")
    assert on == dict.fromkeys(names, "EPERM")


@pytest.mark.attack("bpf and perf_event_open")
def test_bpf_and_perf_events(dsec_sandboxes, witness, probe):
    names = ["bpf", "i386_bpf", "perf_event_open", "i386_perf_event_open"]
    on, off = _attempt(dsec_sandboxes, probe, names)
    # unprivileged bpf is off by sysctl on this host; perf events for oneself are not
    assert off["perf_event_open"] == off["i386_perf_event_open"] == "ok"
    assert on == dict.fromkeys(names, "EPERM")


@pytest.mark.attack("init_module, finit_module, delete_module, kexec_load, kexec_file_load")
def test_module_and_kexec_calls(dsec_sandboxes, witness, probe):
    names = ["init_module", "finit_module", "delete_module", "kexec_load", "kexec_file_load",
             "i386_init_module"]  # fmt: skip
    on, off = _attempt(dsec_sandboxes, probe, names)
    # this kernel has neither modules nor kexec (ENOSYS without the filter): the filter still
    # refuses them before the kernel looks, as it would on a kernel that has them
    assert all(off[n] in ("ENOSYS", "EPERM") for n in names), off
    assert on == dict.fromkeys(names, "EPERM")


@pytest.mark.attack("FICLONE/FICLONERANGE/FIDEDUPERANGE: read-only layer file into a writable one")
def test_clone_range_into_a_writable_file(dsec_sandboxes, witness, probe):
    sb = dsec_sandboxes.create()
    sb.exec("echo mine > /tmp/dst").check()
    names = ["ficlone", "ficlonerange", "fideduperange", "ficlone_hibits", "i386_ficlone"]
    env = {"PROBE_SRC": "/bin/busybox", "PROBE_DST": "/tmp/dst"}
    assert run_probe(sb, probe, *names, env=env) == dict.fromkeys(names, "EPERM")
    assert sb.exec("cat /tmp/dst").stdout == b"mine\n"


@pytest.mark.attack("FICLONE/FICLONERANGE/FIDEDUPERANGE into a file the sandbox may not write")
def test_clone_range_into_a_file_it_may_not_write(dsec_sandboxes, witness, probe, dsec_node):
    sb = dsec_sandboxes.create()
    agents = sorted(dsec_node.config.bin_dir.glob("dsec-agent-*"))
    sums = {p: _sha256(p) for p in agents}
    names = ["ficlone", "ficlonerange", "fideduperange", "i386_ficlone"]
    # the agent binary: a read-only bind mount inside, root's file outside
    env = {"PROBE_SRC": "/bin/busybox", "PROBE_DST": "/.dsec/agent", "PROBE_DST_MODE": "ro"}
    assert run_probe(sb, probe, *names, env=env) == dict.fromkeys(names, "EPERM")
    assert agents and {p: _sha256(p) for p in agents} == sums
    assert sb.exec(["/.dsec/agent", "--version"]).exit_code == 0


@pytest.fixture(scope="module")
def xfs_node() -> Iterator[KitNode]:
    """A second node whose sandboxes' writable layers are XFS with reflink
    (``DSEC_DISK_FS=xfs``), as DSec's production disks were: there the extent-sharing ioctls
    really work, unless refused."""
    if shutil.which("mkfs.xfs") is None:
        pytest.skip("mkfs.xfs is not installed (apt-get install xfsprogs)")
    with pytest.MonkeyPatch.context() as mp:  # what its daemon reads as it starts
        mp.setenv("DSEC_DISK_FS", "xfs")
        node = running_kit_node("dsec-kit-xfs-")
        kit = node.__enter__()
    try:
        yield kit
    finally:
        node.__exit__(None, None, None)


@pytest.mark.attack("FICLONE/FICLONERANGE/FIDEDUPERANGE between files on an XFS writable layer")
def test_clone_range_on_an_xfs_writable_layer(xfs_node, witness, probe):
    names = ["ficlone", "ficlonerange", "fideduperange", "xfs_swapext"]  # in this order
    env = {"PROBE_SRC": "/tmp/a", "PROBE_DST": "/tmp/b"}
    results = {}
    with xfs_node.client() as c:
        for mode, policies in (("on", {}), ("off", OFF)):
            sb = c.create(SandboxSpec(layers=(xfs_node.layer.ref,), policies=policies, disk="512M"))
            try:
                sb.exec("head -c 65536 /dev/urandom > /tmp/a; head -c 65536 /dev/zero > /tmp/b")
                results[mode] = run_probe(sb, probe, *names, env=env)
                results[mode]["b"] = sb.exec("cmp -s /tmp/a /tmp/b && echo same || echo kept")
            finally:
                sb.kill()
    on, off = results["on"], results["off"]
    # without the filter the kernel shares the extents (overlayfs passes clone and dedupe on
    # to XFS; not XFS's own ioctls, which it answers ENOTTY), and b becomes a
    assert (off["ficlone"], off["ficlonerange"], off["fideduperange"]) == ("ok",) * 3, off
    assert off["b"].stdout == b"same\n"
    assert {n: on[n] for n in names} == dict.fromkeys(names, "EPERM")
    assert on["b"].stdout == b"kept\n"


@pytest.mark.attack("XFS_IOC_SWAPEXT and EXT4_IOC_MOVE_EXT on the writable layer")
def test_swap_extents_on_the_writable_layer(dsec_sandboxes, witness, probe):
    sb = dsec_sandboxes.create()
    sb.exec("seq 1 5000 > /tmp/a && echo victim > /tmp/b").check()
    names = ["xfs_swapext", "ext4_move_ext"]
    env = {"PROBE_SRC": "/tmp/a", "PROBE_DST": "/tmp/b"}
    assert run_probe(sb, probe, *names, env=env) == dict.fromkeys(names, "EPERM")
    assert sb.exec("cat /tmp/b; wc -l < /tmp/a").stdout == b"victim\n5000\n"


@pytest.mark.attack("AF_VSOCK sockets to the hypervisor, plain and with junk in the upper bits")
def test_vsock(dsec_sandboxes, witness, probe):
    names = ["socket_vsock", "socket_vsock_hibits"]
    on, off = _attempt(dsec_sandboxes, probe, names)
    assert on == dict.fromkeys(names, "EPERM")
    if off["socket_vsock"] != "ok":
        pytest.skip(f"this kernel has no AF_VSOCK ({off['socket_vsock']}): nothing to reach")


@pytest.mark.attack("a spec with userns: true gets nested namespaces, and only that")
def test_userns_setting_permits_what_it_says(dsec_sandboxes, witness, probe, dsec_node):
    sb = dsec_sandboxes.create(policies={"seccomp": {"userns": True}})
    host_tables, before = _nft_tables(), _mounts_of(dsec_node, sb)
    nested = ["nested_caps", "nested_tmpfs", "nested_bind", "nested_overlay", "nested_raw",
              "nested_packet", "nested_nft", "i386_unshare_user"]  # fmt: skip
    rest = ["keyctl", "io_uring_setup", "userfaultfd", "ficlone", "mount_tmpfs", "socket_raw"]
    got = run_probe(sb, probe, *nested, *rest, env={"PROBE_DST": "/tmp/dst"})
    assert {n: got[n] for n in nested} == dict.fromkeys(nested, "ok")
    # the sandbox's own namespaces stay as they were: no capability in them came back
    assert {n: got[n] for n in rest} == dict.fromkeys(rest, "EPERM")
    # what happened in the nested namespaces stayed there
    assert _nft_tables() == host_tables and _mounts_of(dsec_node, sb) == before


@pytest.mark.attack("a spec with an allow exception gets that call, and only that")
def test_allow_exception_permits_what_it_says(dsec_sandboxes, witness, probe):
    sb = dsec_sandboxes.create(policies={"seccomp": {"allow": ["io_uring_setup", "keyctl"]}})
    got = run_probe(sb, probe, "io_uring_setup", "i386_io_uring_setup", "keyctl",
                    "add_key", "userfaultfd", "unshare_user")  # fmt: skip
    assert got == {
        "io_uring_setup": "ok",
        "i386_io_uring_setup": "ok",
        "keyctl": "ok",
        "add_key": "EPERM",
        "userfaultfd": "EPERM",
        "unshare_user": "EPERM",
    }


@pytest.mark.attack("32-bit (int $0x80) and x32 syscalls to get around the filter")
def test_compat_abis_do_not_bypass(dsec_sandboxes, witness, probe):
    sb = dsec_sandboxes.create()
    got = run_probe(sb, probe, "i386_getpid", "i386_unshare_user", "i386_keyctl",
                    "i386_userfaultfd", "i386_perf_event_open", "x32_unshare_user")  # fmt: skip
    assert got.pop("i386_getpid") == "ok", "the 32-bit ABI is not reachable: nothing was tested"
    # x32: refused, or, where the kernel has no x32 and the profile leaves it out, the caller
    # is killed (SIGSYS) by the filter for using an ABI it was not built for
    assert got.pop("x32_unshare_user") in ("EPERM", "signal:31")
    assert got == dict.fromkeys(
        ["i386_unshare_user", "i386_keyctl", "i386_userfaultfd", "i386_perf_event_open"], "EPERM"
    )
