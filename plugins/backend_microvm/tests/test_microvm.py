"""The microVM backend beyond the kit: what the guest is (its own kernel, layers over virtio-pmem
with DAX or virtio-blk, limits as vCPUs and RAM, QEMU confined on the host), and every failure
path (no QEMU, a guest that never answers, a guest that panics, QEMU killed from outside)
ending in a typed error with nothing left behind."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from dsec_backend_microvm import MicroVmBackend

from dsec_core.backend import cgroup_path
from dsec_core.errors import (
    BackendUnavailable,
    DsecError,
    NotFound,
    SandboxDied,
    SandboxNotRunning,
    SnapshotInUse,
    StartTimeout,
    UnknownSnapshot,
)
from dsec_core.layers.store import LayerStore
from dsec_core.linux.cgroups import CGROUP_ROOT
from dsec_core.testing import leftovers, running_kit_node, until
from dsec_core.vm.coldmem import ram_mapping
from dsec_core.vm.runner import vm_cache_dir

pytestmark = [
    pytest.mark.skipif(shutil.which("qemu-system-x86_64") is None, reason="QEMU is not installed"),
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root"),
]


@pytest.fixture
def vm(dsec_sandboxes):
    return dsec_sandboxes.create(cpu=2, memory="384M")


@pytest.fixture
def dsec_backend_name() -> str:
    return "microvm"


def _qemu_pids(sandbox_id: str) -> list[int]:
    """Host pids of QEMU processes named after the sandbox (``-name dsec-<id>``)."""
    needle = f"dsec-{sandbox_id}".encode()
    found = []
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                if needle in Path(f"/proc/{pid}/cmdline").read_bytes():
                    found.append(int(pid))
            except OSError:
                pass
    return found


def _gone(client, sandbox_id: str) -> bool:
    """Whether the node has forgotten the sandbox (cleaned up after it)."""
    try:
        client.get(sandbox_id)
    except SandboxDied:
        return True
    return False


def _nothing_left(node, sandbox_id: str) -> None:
    """Nothing of the sandbox: no directory, mount, cgroup or process (QEMU, forwarder)."""
    left = leftovers(node.config.home)
    mine = {k: [x for x in v if sandbox_id in x] for k, v in left.items()}
    assert not any(mine.values()), f"left behind: {mine}"
    assert not left["processes"], left["processes"]
    assert not _qemu_pids(sandbox_id)


def test_the_guest_has_its_own_kernel_and_the_limits(vm):
    host = os.uname().release.encode()
    assert host not in vm.exec("cat /proc/version").stdout
    assert vm.exec("nproc").stdout.strip() == b"2"
    total_kib = int(vm.exec("grep MemTotal /proc/meminfo").stdout.split()[1])
    assert 250 << 10 < total_kib <= 384 << 10


def test_layers_are_mapped_with_dax(vm):
    mounts = vm.exec("cat /proc/mounts").stdout.decode()
    erofs = [line for line in mounts.splitlines() if " erofs " in line]
    assert erofs and all("dax=always" in line for line in erofs), mounts
    assert all(line.split()[0].startswith("/dev/pmem") for line in erofs), mounts


def test_an_idle_guest_leaves_its_disk_alone(vm, dsec_node):
    """The writable disk is a sparse file the host formatted, whose holes read as zeros: the
    guest mounts it without ext4's background zeroing of inode tables (``noinit_itable``),
    which zeroed 160 MB of a 10 GiB disk (write-zeroes requests QEMU passes on to the file)
    in every new VM's first seconds, and took a TCG guest's idle CPU from 6 to 26 ms a
    second meanwhile. Its file on the host stays as sparse as the host made it."""
    disk = dsec_node.config.sandbox_dir / vm.id / "disk.raw"
    mounts = vm.exec("cat /proc/mounts").text
    (rw,) = [line for line in mounts.splitlines() if line.split()[1] == "/.dsec/rw"]
    assert "noinit_itable" in rw, rw
    before = disk.stat().st_blocks * 512
    time.sleep(4)
    grown = disk.stat().st_blocks * 512 - before
    assert grown < 4 << 20, f"the idle guest's disk file grew {grown >> 20} MiB in 4 s"


def test_qemu_is_confined_on_the_host(vm, dsec_client):
    pid = dsec_client.get(vm.id).info.pid
    assert pid in _qemu_pids(vm.id)
    memory = CGROUP_ROOT / "memory" / cgroup_path(vm.id)
    assert str(pid) in (memory / "cgroup.procs").read_text().split()
    assert int((memory / "memory.limit_in_bytes").read_text()) > 384 << 20
    quota = CGROUP_ROOT / "cpu" / cgroup_path(vm.id) / "cpu.cfs_quota_us"
    assert int(quota.read_text()) == 200_000


def test_no_qemu_is_backend_unavailable_saying_how_to_install(monkeypatch):
    monkeypatch.setenv("PATH", "/nonexistent")
    with pytest.raises(BackendUnavailable, match="apt-get install qemu-system-x86"):
        MicroVmBackend.check_available()


def test_a_guest_that_never_answers_is_a_start_timeout_and_leaves_nothing(
    dsec_sandboxes, dsec_node, dsec_client
):
    before = {i.id for i in dsec_client.list()}
    with pytest.raises(StartTimeout) as caught:
        dsec_sandboxes.create(start_timeout=0.01)
    sid = caught.value.context.get("sandbox_id")
    assert sid and not _qemu_pids(sid)
    assert {i.id for i in dsec_client.list()} == before
    _nothing_left(dsec_node, sid)


def test_a_guest_kernel_panic_is_reported_with_its_cause(vm, dsec_client, dsec_node):
    with pytest.raises(DsecError):  # the agent goes down with its kernel
        vm.exec("echo c > /proc/sysrq-trigger", timeout=10)
    deadline = time.monotonic() + 15
    while True:
        try:
            dsec_client.get(vm.id)
        except SandboxDied as e:
            assert e.context["kind"] == "guest_panic"
            assert "sysrq" in e.context["cause"].lower()
            break
        assert time.monotonic() < deadline, "the node did not notice the panic"
        time.sleep(0.2)
    _nothing_left(dsec_node, vm.id)


def test_qemu_killed_from_outside_is_noticed_with_its_cause(vm, dsec_client, dsec_node):
    pid = dsec_client.get(vm.id).info.pid
    os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while True:
        try:
            vm.exec("true")
        except SandboxDied as e:
            assert e.context["kind"] == "crashed" and "QEMU exited" in e.context["cause"]
            break
        except SandboxNotRunning as e:  # the node noticed, and is cleaning up
            raise AssertionError(f"a request while it cleans up names no fault: {e}") from e
        except DsecError:
            pass  # the agent is gone before the node has noticed
        assert time.monotonic() < deadline, "the node did not notice QEMU's death"
        time.sleep(0.2)
    until(lambda: _gone(dsec_client, vm.id), 10)  # SandboxDied from the start of its clean-up
    _nothing_left(dsec_node, vm.id)


def test_layers_over_virtio_blk(monkeypatch):
    """Where pmem is not wanted (or cannot be had), the layers reach a microvm machine as
    read-only virtio-blk disks."""
    monkeypatch.setenv("DSEC_VM_LAYERS", "blk")
    with running_kit_node("dsec-kit-blk-") as node, node.client() as client:
        sb = client.create(layers=["kit-base@1"], backend="microvm")
        try:
            mounts = sb.exec("cat /proc/mounts").stdout.decode()
            erofs = [line for line in mounts.splitlines() if " erofs " in line]
            assert erofs and all(line.split()[0].startswith("/dev/vd") for line in erofs)
            assert sb.exec("echo hi > /root/f && cat /root/f").stdout == b"hi\n"
            cmdline = Path(f"/proc/{client.get(sb.id).info.pid}/cmdline").read_bytes()
            assert b"microvm" in cmdline
        finally:
            sb.kill()


def test_pause_saves_the_vm_to_a_file_and_ends_qemu(vm, dsec_client, dsec_node):
    """DSec's VM pause: memory and devices to a file, no QEMU while paused, and the guest goes
    on from the same instant (a session's shell and its variables, a background process)."""
    s = vm.session()
    s.exec("X=41; sleep 1000 > /dev/null 2>&1 &")
    vm.write_file("/root/before", b"kept")
    pid = dsec_client.get(vm.id).info.pid
    dsec_client.pause(vm.id)
    assert not _qemu_pids(vm.id), "QEMU still runs while the VM is paused"
    saved = dsec_node.config.home / "sandboxes" / vm.id / "vm.state"
    assert saved.stat().st_size > 0
    info = dsec_client.resume(vm.id)
    assert info.pid != pid and _qemu_pids(vm.id) == [info.pid]
    assert not saved.exists()
    assert s.exec("echo $((X+1))").stdout == b"42\n"
    assert b"sleep" in vm.exec("ps -o comm 2>/dev/null || cat /proc/[0-9]*/comm").stdout
    assert vm.read_file("/root/before") == b"kept"


def test_later_vms_start_from_a_saved_boot_with_their_own_randomness(dsec_sandboxes, dsec_node):
    """The first VM of a shape is saved once booted; the next start from that state (no
    boot), each with its own hostname and its CRNG reseeded with the node's fresh bytes."""
    cache = vm_cache_dir() / "templates"
    first = dsec_sandboxes.create(memory="320M")
    assert any((d / "ready").exists() for d in cache.iterdir()), "no template was saved"
    clones = [dsec_sandboxes.create(memory="320M") for _ in range(2)]
    seen = set()
    for sb in (first, *clones):
        assert sb.exec("hostname").stdout == f"dsec-{sb.id[:12]}\n".encode()
        seen.add(sb.exec("head -c 16 /dev/urandom | od -An -x").stdout)
    assert len(seen) == 3, "two VMs from one saved state drew the same random bytes"


def test_a_fresh_node_home_starts_from_the_boot_another_home_saved(monkeypatch):
    """The VM cache is the machine's (``vm_cache_dir``), its templates keyed by content, not by
    a node's paths: a VM of the same shape in a fresh node home starts from the boot another
    home saved, and the fresh home fetches, unpacks and saves nothing of its own for it."""
    monkeypatch.setenv("DSEC_VM_LAYERS", "blk")  # each guest reads the layer files of its home
    spec = {"backend": "microvm", "cpu": 1.0, "memory": "336M", "pids": 256, "ttl": 600}
    with running_kit_node() as first:
        with first.client() as client, client.create(layers=(first.layer.ref,), **spec) as sb:
            assert sb.exec("echo up").stdout == b"up\n"
        image = LayerStore(first.config.layer_dir).image_path(first.layer)
        with running_kit_node() as fresh:
            copy = fresh.home / "same-base.erofs"
            shutil.copyfile(image, copy)  # the same layer, in the fresh home's own store
            info = LayerStore(fresh.config.layer_dir).add(
                copy, name="same-base", version="1", kind="base"
            )
            assert info.digest == first.layer.digest
            with fresh.client() as client, client.create(layers=(info.ref,), **spec) as sb:
                assert sb.exec("echo up").stdout == b"up\n"
                state = json.loads((fresh.config.runtime_dir / sb.id / "state.json").read_text())
            assert state["backend_state"].get("template"), "the fresh home booted its VM"
            assert not (fresh.home / "vm").exists()


def test_the_vm_cache_is_the_machines_unless_said(monkeypatch):
    monkeypatch.delenv("DSEC_VM_CACHE", raising=False)
    assert vm_cache_dir() == Path("/var/cache/dsec/vm")  # root's, as the build cache
    monkeypatch.setenv("DSEC_VM_CACHE", "/srv/vm")
    assert vm_cache_dir() == Path("/srv/vm")


def test_a_sandboxs_kernel_wins_over_the_backends_default(tmp_path, monkeypatch):
    """``rt.kernel`` (from the sandbox's catalog environment) is what the guest boots; without
    one, the backend's own (DSEC_VM_KERNEL, DSEC_VM_KERNEL_VERSION, else its default)."""
    from dsec_core.config import NodeConfig
    from dsec_core.vm import runner

    asked: list[tuple[str, str | None]] = []

    def ensure_kernel(cache, package, version):
        asked.append((package, version))
        return SimpleNamespace(package=package, vmlinuz=tmp_path / "vmlinuz")

    monkeypatch.setattr(runner, "ensure_kernel", ensure_kernel)
    monkeypatch.setattr(runner, "build_initramfs", lambda *a: tmp_path / "initrd")
    monkeypatch.setattr(runner, "ensure_vmlinux", lambda *a: tmp_path / "vmlinux")
    monkeypatch.setenv("DSEC_VM_KERNEL", "linux-image-amd64")
    monkeypatch.delenv("DSEC_VM_KERNEL_VERSION", raising=False)
    backend = MicroVmBackend(NodeConfig(home=tmp_path))
    agent = tmp_path / "agent"
    assert backend.boot_files(agent)[0].package == "linux-image-amd64"
    backend.boot_files(agent, "linux-image-cloud-amd64=6.1.192-3")
    backend.boot_files(agent, "linux-image-rt-amd64")
    backend.boot_files(agent, "linux-image-cloud-amd64=6.1.192-3")  # made once per kernel
    assert asked == [
        ("linux-image-amd64", None),
        ("linux-image-cloud-amd64", "6.1.192-3"),
        ("linux-image-rt-amd64", None),
    ]


def test_restore_n_from_a_memory_snapshot_goes_on_from_its_instant(vm, dsec_client):
    """A VM fork: three VMs from one memory snapshot each go on from the saved instant (a
    background counter keeps counting from where it was, a session keeps its variables), each
    with its own disk; the source runs on."""
    s = vm.session()
    s.exec("N=7")
    vm.exec(
        # each count replaces the file whole (a reader never sees it truncated and empty)
        "(i=0; while true; do i=$((i+1)); echo $i > /root/count.new; "
        "mv /root/count.new /root/count; sleep 0.1; done) "
        "> /dev/null 2>&1 &",
        background=True,
    ).check()
    until(
        lambda: vm.exec("cat /root/count 2>/dev/null").stdout.strip() not in (b"", b"1"),
        what="the guest's loop counting",
    )
    snap = vm.snapshot_memory(name=f"fork-{vm.id}")
    assert snap.backend == "microvm" and snap.bytes > 0
    at_save = int(vm.exec("cat /root/count").stdout)
    forks = dsec_client.restore(snap.name, 3)
    try:
        assert len({f.id for f in forks}) == 3
        for i, f in enumerate(forks):
            count = int(f.exec("cat /root/count").stdout)
            assert count >= at_save - 12, "the fork did not start from the saved instant"
            time.sleep(0.3)
            assert int(f.exec("cat /root/count").stdout) > count, "its counter stopped"
            f.write_file("/root/mine", str(i).encode())
        for i, f in enumerate(forks):
            assert f.read_file("/root/mine") == str(i).encode()  # disks are their own
        assert vm.exec("cat /root/mine 2>/dev/null || echo none").stdout == b"none\n"
        assert vm.exec("hostname").stdout == f"dsec-{vm.id[:12]}\n".encode()
        assert forks[0].exec("hostname").stdout == f"dsec-{forks[0].id[:12]}\n".encode()
    finally:
        for f in forks:
            f.kill()
        dsec_client.remove_memory_snapshot(snap.name)
    with pytest.raises(UnknownSnapshot):
        dsec_client.remove_memory_snapshot(snap.name)
    with pytest.raises(NotFound):  # neither a memory snapshot nor a snapshot layer now
        dsec_client.restore(snap.name, 1)
    with pytest.raises(BackendUnavailable):
        dsec_client.snapshot_memory(dsec_client.create(layers=["kit-base@1"]).id)


def _smaps(pid: int) -> dict[str, int]:
    """``/proc/<pid>/smaps_rollup`` in bytes."""
    out = {}
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines()[1:]:
        key, _, value = line.partition(":")
        out[key] = int(value.split()[0]) << 10
    return out


def test_forks_map_the_snapshots_memory_and_share_what_they_do_not_write(
    vm, dsec_client, dsec_node
):
    """Four forks of one memory snapshot map its saved RAM privately: a write in one is its
    own (the others, and the snapshot, unchanged), the pages they only read are one copy in
    the host's page cache (their private memory together well under four parents'), each
    wakes with the host's clock, and the snapshot cannot be removed while they map it, across
    a daemon restart too."""
    # 48 MiB of the guest's RAM that is not zero: a tmpfs file of random bytes
    vm.exec(
        "mkdir -p /mnt/ram && mount -t tmpfs -o size=64m tmpfs /mnt/ram && "
        "dd if=/dev/urandom of=/mnt/ram/blob bs=1048576 count=48 2>/dev/null"
    ).check()
    digest = vm.exec("md5sum < /mnt/ram/blob").stdout
    parent = _smaps(_qemu_pids(vm.id)[0])
    snap = vm.snapshot_memory(name=f"cow-{vm.id}")
    saved = dsec_node.config.home / "memory-snapshots" / snap.name
    assert (saved / "vm.ram").stat().st_blocks * 512 >= 48 << 20  # the RAM is a file
    assert (saved / "vm.state").stat().st_size < 8 << 20  # and not in the stream
    time.sleep(4)  # the snapshot's clock falls behind the host's
    ram_digest = hashlib.sha256((saved / "vm.ram").read_bytes()).hexdigest()
    forks = dsec_client.restore(snap.name, 4)
    try:
        # 64 MiB of its own, then freed: they go back to the host (free page reporting:
        # QEMU discards them), never as a hole punched in the RAM file the others map
        pid0 = _qemu_pids(forks[0].id)[0]
        forks[0].exec("dd if=/dev/urandom of=/dev/shm/own bs=1048576 count=64").check()
        high = _smaps(pid0)["Rss"]
        forks[0].exec("rm /dev/shm/own; echo changed > /mnt/ram/blob").check()
        until(
            lambda: _smaps(pid0)["Rss"] < high - (40 << 20),
            timeout=20,
            what="the freed pages given back",
        )
        assert hashlib.sha256((saved / "vm.ram").read_bytes()).hexdigest() == ram_digest
        for f in forks[1:]:
            assert f.exec("md5sum < /mnt/ram/blob").stdout == digest
        assert forks[0].exec("cat /mnt/ram/blob").stdout == b"changed\n"
        assert vm.exec("md5sum < /mnt/ram/blob").stdout == digest
        for f in forks:
            guest = int(f.exec("date +%s").stdout)
            assert abs(guest - time.time()) < 2.5, "the fork kept the snapshot's clock"
        private = [_smaps(_qemu_pids(f.id)[0]) for f in forks]
        mine = [p["Private_Clean"] + p["Private_Dirty"] for p in private]
        shared = [p["Shared_Clean"] + p["Shared_Dirty"] for p in private]
        # the blob was read in three forks: its pages are the snapshot file's, mapped by each
        assert all(s >= 40 << 20 for s in shared[1:]), shared
        assert sum(mine) < 2 * parent["Rss"], (mine, parent["Rss"])
        dsec_node.restart()  # the forks run on, adopted, and still hold the snapshot
        with dsec_node.client() as c:
            with pytest.raises(SnapshotInUse) as e:
                c.remove_memory_snapshot(snap.name)
            assert sorted(e.value.context["sandboxes"]) == sorted(f.id for f in forks)
            assert c.exec(forks[2].id, "md5sum < /mnt/ram/blob").stdout == digest
    finally:
        for f in forks:
            f.kill()
    dsec_client.remove_memory_snapshot(snap.name)
    assert not saved.exists()


def test_a_frozen_disk_holds_writes_until_thawed_or_its_guard_thaws_it(vm, dsec_node):
    """The agent's freeze (what a VM's pack_diff holds the guest's disk still with): a write
    to the disk waits while it is frozen and lands once it is thawed, by the node or, if the
    node never does, by the guard after its seconds; a second thaw says it was not frozen."""
    import asyncio

    from dsec_core.agent.rpc import AgentClient

    agent = AgentClient(dsec_node.config.runtime_dir / vm.id / "agent.sock", vm.id)

    def write_in_background(name: str) -> None:
        vm.exec(f"(echo x > /root/{name}; sync) > /dev/null 2>&1 &", background=True).check()

    assert asyncio.run(agent.freeze(True, seconds=60)) is True
    write_in_background("held")
    time.sleep(1.0)
    assert vm.exec("test -e /root/held").exit_code != 0, "a write went through the freeze"
    assert asyncio.run(agent.freeze(False)) is True
    until(lambda: vm.exec("cat /root/held 2>/dev/null").stdout == b"x\n", what="the write")
    assert asyncio.run(agent.freeze(False)) is False  # not frozen now

    t0 = time.monotonic()
    asyncio.run(agent.freeze(True, seconds=2))  # and nobody thaws it
    write_in_background("guarded")
    until(
        lambda: vm.exec("cat /root/guarded 2>/dev/null").stdout == b"x\n",
        timeout=20,
        what="the guard's thaw",
    )
    assert time.monotonic() - t0 >= 1.5


def test_a_group_forks_a_microvm_into_microvms(dsec_client, dsec_node):
    """``group.fork`` of a VM member: pack_diff of its disk, restored as VMs of its backend
    (not the node's default), each holding what the member wrote."""
    group = dsec_client.group(f"vmfork-{os.getpid()}")
    (member,) = group.create(layers=[dsec_node.layer.ref], backend="microvm", memory="384M")
    try:
        member.write_file("/root/state", b"step 3")
        forks = group.fork(member, 2, memory="384M")
        assert [f.info.backend for f in forks] == ["microvm", "microvm"]
        assert [f.read_file("/root/state") for f in forks] == [b"step 3", b"step 3"]
        assert forks[0].exec("uname -r").stdout != os.uname().release.encode() + b"\n"
    finally:
        group.kill()


def _ram_rss(pid: int, size: int) -> int:
    """The resident bytes of ``pid``'s mapping of ``size`` bytes (a guest's RAM)."""
    found = ram_mapping(Path(f"/proc/{pid}/smaps").read_text(), size)
    assert found is not None, f"no mapping of {size} bytes in QEMU {pid}"
    return found[0]


def test_cold_guest_memory_goes_back_and_a_busy_guest_keeps_its_own(monkeypatch):
    """The node's reclaim passes (every 5 s here): an idle guest's page cache of a file it
    wrote, cold since, goes back to the host through the balloon (QEMU's resident memory
    falls, the node counts it) and the file reads the same after; a guest that keeps reading
    its data keeps it resident; ``node status`` reports the passes."""
    # a pass every 5 s: the busy guest reads all of its data within that even on a loaded host
    monkeypatch.setenv("DSEC_VM_RECLAIM_INTERVAL", "5")
    spec = {"backend": "microvm", "cpu": 1.0, "memory": "512M", "pids": 256, "ttl": 600}
    write = "dd if=/dev/urandom of=/root/data bs=1048576 count=96 2>/dev/null; md5sum /root/data"
    with running_kit_node() as node, node.client() as client:
        client.create(layers=(node.layer.ref,), **spec).kill()  # its template: both load it
        idle = client.create(layers=(node.layer.ref,), **spec)
        busy = client.create(layers=(node.layer.ref,), **spec)
        digest = idle.exec(write).check().stdout
        busy.exec(write).check()
        busy.exec(
            # md5sum reads into its own buffer (cat to /dev/null splices and touches nothing)
            "(while true; do md5sum /root/data; done) > /dev/null 2>&1 &",
            background=True,
        ).check()
        idle_pid, busy_pid = (_qemu_pids(sb.id)[0] for sb in (idle, busy))

        # both wrote the same; the idle one gives its cold page cache back, the busy one
        # keeps reading its data and keeps it resident
        def given() -> bool:
            return _ram_rss(idle_pid, 512 << 20) < _ram_rss(busy_pid, 512 << 20) - (48 << 20)

        deadline = time.monotonic() + 60
        while not given():
            assert time.monotonic() < deadline, (
                "the idle guest's cold page cache was not given back: RAM resident idle "
                f"{_ram_rss(idle_pid, 512 << 20) >> 20} MiB, busy "
                f"{_ram_rss(busy_pid, 512 << 20) >> 20} MiB; {client.node_info()['reclaim']}"
            )
            time.sleep(0.5)
        time.sleep(6)  # another pass: the busy guest's data stays
        assert _ram_rss(idle_pid, 512 << 20) < _ram_rss(busy_pid, 512 << 20) - (48 << 20)
        assert idle.exec("md5sum /root/data").stdout == digest
        reclaim = client.node_info()["reclaim"]
        assert reclaim["enabled"] and reclaim["passes"] >= 2
        assert reclaim["given_back"] >= 48 << 20


def test_a_snapshot_loads_with_the_devices_it_was_saved_with(monkeypatch):
    """A memory snapshot of a VM with a balloon restores on a node restarted without balloons
    (DSEC_VM_BALLOON=0): the fork's QEMU has the saved VM's devices, not the node's settings
    of the day, while a VM the node creates now has none."""
    spec = {"backend": "microvm", "cpu": 1.0, "memory": "384M", "pids": 256, "ttl": 600}
    with running_kit_node() as node:
        with node.client() as client:
            vm = client.create(layers=(node.layer.ref,), **spec)
            vm.write_file("/root/kept", b"saved")
            snap = client.snapshot_memory(vm.id, f"devices-{vm.id}")
            vm.kill()
        monkeypatch.setenv("DSEC_VM_BALLOON", "0")
        node.restart()
        with node.client() as client:
            (fork,) = client.restore(snap.name, 1)
            assert fork.read_file("/root/kept") == b"saved"
            argv = Path(f"/proc/{_qemu_pids(fork.id)[0]}/cmdline").read_bytes()
            assert b"virtio-balloon" in argv
            fresh = client.create(layers=(node.layer.ref,), **spec)
            argv = Path(f"/proc/{_qemu_pids(fresh.id)[0]}/cmdline").read_bytes()
            assert b"virtio-balloon" not in argv
            fork.kill()
            fresh.kill()
            client.remove_memory_snapshot(snap.name)
