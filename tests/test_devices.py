"""Accelerators, shared or exclusive (issue 9, deliverable 8): a spec asks for devices from the
node's inventory; exclusive holders never share a device, shared ones honour the per-device cap;
the devices reach the sandbox through runc's device list.

There is no GPU on this machine: the real-node tests declare an inventory of stand-in device
nodes, made with mknod in a fresh directory under the host's /dev with the numbers of /dev/null
(1:3), /dev/zero (1:5) and /dev/full (1:7), so each is told apart inside by major:minor and
by what it does.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import shutil
import stat
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from dsec_backend_container import ContainerBackend

from dsec_core.api.messages import CreateRequest, FnCallRequest
from dsec_core.backend import DeviceNode, Feature
from dsec_core.catalog.model import Catalog, Environment
from dsec_core.catalog.store import CatalogStore
from dsec_core.config import NodeConfig
from dsec_core.errors import AdmissionRejected, BackendUnavailable, InvalidSpec
from dsec_core.node.devices import Device, DevicePool
from dsec_core.node.node import Node
from dsec_core.node.pools import PoolKey, Pools, PoolSettings
from dsec_core.records import DeviceRequest, JudgeCase, JudgeSpec, NodeLoad, SandboxSpec
from dsec_core.testing import KIT_DEVICE_KIND, async_until, node_home, running_kit_node

root_only = pytest.mark.skipif(os.geteuid() != 0, reason="needs root")
BASE = {"layers": ("kit-base@1",), "memory": "64M", "cpu": 0.2}


# --- the request ---------------------------------------------------------------------------
def test_a_request_reads_from_text_dicts_and_records_and_round_trips():
    assert DeviceRequest.parse("gpu") == DeviceRequest("gpu", 1, "exclusive")
    assert DeviceRequest.parse("gpu:2") == DeviceRequest("gpu", 2, "exclusive")
    assert DeviceRequest.parse("gpu:2:shared") == DeviceRequest("gpu", 2, "shared")
    assert DeviceRequest.parse("gpu:shared") == DeviceRequest("gpu", 1, "shared")
    spec = SandboxSpec(
        **BASE, devices=["gpu:2:shared", {"kind": "fpga"}, DeviceRequest("npu", mode="shared")]
    )
    assert spec.devices == (
        DeviceRequest("gpu", 2, "shared"),
        DeviceRequest("fpga"),
        DeviceRequest("npu", 1, "shared"),
    )
    assert SandboxSpec.from_dict(spec.to_dict()) == spec
    # through the HTTP API's decoder, as JSON
    wire = CreateRequest(spec).to_dict()
    assert wire["spec"]["devices"][0] == {"kind": "gpu", "count": 2, "mode": "shared"}
    assert CreateRequest.from_dict(wire).spec == spec
    call = FnCallRequest("env", "true", devices=("gpu:shared",))  # type: ignore[arg-type]
    assert FnCallRequest.from_dict(call.to_dict()).devices == (DeviceRequest("gpu", 1, "shared"),)


@pytest.mark.parametrize(
    ("devices", "field"),
    [
        ([{"kind": "gpu", "mode": "sometimes"}], "devices.mode"),
        ([{"kind": "gpu", "count": 0}], "devices.count"),
        ([{"kind": "gpu", "count": "2"}], "devices.count"),
        ([{"kind": "../gpu"}], "devices.kind"),
        (["gpu:two"], "devices"),
        (["gpu", "gpu:shared"], "devices"),
        ([3], "devices"),
    ],
)
def test_bad_requests_are_invalid_spec_naming_the_field(devices, field):
    with pytest.raises(InvalidSpec) as e:
        SandboxSpec(**BASE, devices=devices)
    assert e.value.context.get("field") == field or field in str(e.value)


def test_the_inventory_and_caps_read_from_the_environment(monkeypatch):
    monkeypatch.setenv("DSEC_DEVICES", "gpu=/dev/a, /dev/b ; fpga=/dev/c")
    monkeypatch.setenv("DSEC_DEVICE_SHARE_CAP", "3,gpu:2")
    cfg = NodeConfig.from_env()
    assert cfg.devices == {"gpu": ("/dev/a", "/dev/b"), "fpga": ("/dev/c",)}
    assert (cfg.share_cap("gpu"), cfg.share_cap("fpga")) == (2, 3)
    for bad in ("gpu", "gpu=", "gpu=dev/a", "=/dev/a"):
        monkeypatch.setenv("DSEC_DEVICES", bad)
        with pytest.raises(InvalidSpec, match="DSEC_DEVICES"):
            NodeConfig.from_env()
    monkeypatch.setenv("DSEC_DEVICES", "gpu=/dev/a")
    for bad in ("0", "gpu:", "gpu:x", ":2"):
        monkeypatch.setenv("DSEC_DEVICE_SHARE_CAP", bad)
        with pytest.raises(InvalidSpec, match="DSEC_DEVICE_SHARE_CAP"):
            NodeConfig.from_env()


# --- the allocator (pure logic) --------------------------------------------------------------
def _pool(n: int = 2, cap: int = 2, kind: str = "gpu") -> DevicePool:
    devices = [Device(kind, f"/dev/{kind}{i}", "c", 1, 3 + i, 0o666) for i in range(n)]
    return DevicePool(devices, {kind: cap})


def _paths(nodes: tuple[DeviceNode, ...]) -> list[str]:
    return [n.host_path for n in nodes]


def test_exclusive_holders_never_share_a_device_and_shared_ones_stay_off_it():
    pool = _pool(n=2, cap=4)
    a = pool.allocate("a", [DeviceRequest("gpu")])
    b = pool.allocate("b", [DeviceRequest("gpu")])
    assert sorted(_paths(a) + _paths(b)) == ["/dev/gpu0", "/dev/gpu1"]
    for mode in ("exclusive", "shared"):
        with pytest.raises(AdmissionRejected) as e:
            pool.allocate("c", [DeviceRequest("gpu", mode=mode)])
        assert (e.value.reason, e.value.pool) == ("devices", "devices:gpu")
        assert "exclusive to a" in str(e.value) and "exclusive to b" in str(e.value)
    pool.release("a")
    assert _paths(pool.allocate("c", [DeviceRequest("gpu", mode="shared")])) == _paths(a)
    with pytest.raises(AdmissionRejected):  # shared by c now: not free for an exclusive one
        pool.allocate("d", [DeviceRequest("gpu")])


def test_shared_holders_spread_and_honour_the_cap():
    pool = _pool(n=2, cap=2)
    got = [_paths(pool.allocate(s, [DeviceRequest("gpu", mode="shared")]))[0] for s in "abcd"]
    assert sorted(got) == ["/dev/gpu0", "/dev/gpu0", "/dev/gpu1", "/dev/gpu1"]
    assert got[:2] == ["/dev/gpu0", "/dev/gpu1"]  # least loaded first
    with pytest.raises(AdmissionRejected, match="shared by 2 of 2") as e:
        pool.allocate("e", [DeviceRequest("gpu", mode="shared")])
    assert e.value.pool == "devices:gpu"
    assert pool.usage() == {"gpu": {"total": 2, "idle": 0, "shareable": 0}}
    pool.release("b")
    assert pool.usage()["gpu"]["shareable"] == 1
    assert _paths(pool.allocate("e", [DeviceRequest("gpu", mode="shared")])) == [got[1]]


def test_a_count_takes_distinct_devices_all_or_none():
    pool = DevicePool(
        [
            Device("gpu", "/dev/g0", "c", 1, 3, 0o666),
            Device("gpu", "/dev/g1", "c", 1, 5, 0o666),
            Device("fpga", "/dev/f0", "c", 1, 7, 0o666),
        ],
        {"gpu": 2, "fpga": 2},
    )
    assert sorted(_paths(pool.allocate("a", [DeviceRequest("gpu", 2, "shared")]))) == [
        "/dev/g0",
        "/dev/g1",
    ]
    with pytest.raises(AdmissionRejected):  # 3 distinct asked, 2 exist
        pool.allocate("b", [DeviceRequest("gpu", 3, "shared")])
    pool.allocate("b", [DeviceRequest("fpga")])
    with pytest.raises(AdmissionRejected) as e:  # the gpu part fits, the fpga one does not
        pool.allocate("c", [DeviceRequest("gpu", mode="shared"), DeviceRequest("fpga")])
    assert e.value.pool == "devices:fpga"
    assert pool.held_by("c") == []  # nothing kept of a refused request
    with pytest.raises(AdmissionRejected, match="no devices of kind 'tpu'") as e:
        pool.allocate("c", [DeviceRequest("tpu")])
    assert e.value.pool == "devices:tpu"


def test_adopted_holders_count_again():
    pool = _pool(n=1, cap=2)
    node = pool.devices[0].node()
    pool.adopt("a", [DeviceRequest("gpu", mode="shared")], [node])
    pool.adopt("b", [DeviceRequest("gpu", mode="shared")], [node])
    with pytest.raises(AdmissionRejected):
        pool.allocate("c", [DeviceRequest("gpu", mode="shared")])
    gone = DeviceNode("gpu", "/dev/removed", "/dev/removed", "c", 1, 9)
    pool.adopt("d", [DeviceRequest("gpu")], [gone])  # no longer in the inventory: not counted
    assert pool.held_by("a") == ["/dev/gpu0"] and pool.held_by("d") == []


def test_admission_refuses_from_the_node_load_alone():
    load = NodeLoad(
        node="n",
        backends=("container",),
        cpu_capacity=8,
        cpu_committed=0,
        memory_capacity=1 << 40,
        memory_committed=0,
        devices={"gpu": {"total": 2, "idle": 0, "shareable": 1}},
    )
    assert load.refusal(SandboxSpec(**BASE, devices=["gpu:shared"])) is None
    for devices, pool in (
        (["gpu"], "devices:gpu"),
        (["gpu:2:shared"], "devices:gpu"),
        (
            ["tpu"],
            "devices:tpu",
        ),
    ):
        refused = load.refusal(SandboxSpec(**BASE, devices=devices))
        assert refused is not None and (refused.reason, refused.pool) == ("devices", pool)


def test_pool_keys_tell_device_needs_apart():
    plain = PoolKey("fizzbuzz", "fncall", 0.5, 256 << 20)
    gpu = PoolKey("fizzbuzz", "fncall", 0.5, 256 << 20, (DeviceRequest("gpu"),))
    assert plain != gpu
    assert gpu.name == "fizzbuzz/fncall/0.5cpu/256M/gpu:1:exclusive"


def test_a_bad_inventory_is_a_typed_error(tmp_path):
    regular = tmp_path / "not-a-device"
    regular.write_text("")
    for path, why in ((tmp_path / "missing", "No such file"), (regular, "not a char or block")):
        config = NodeConfig(home=tmp_path / "home", devices={"gpu": (os.fspath(path),)})
        with pytest.raises(InvalidSpec, match=why) as e:
            DevicePool.probe(config)
        assert e.value.context["path"] == os.fspath(path)
        assert e.value.context["field"] == "DSEC_DEVICES"


# --- a real node with stand-in devices ---------------------------------------------------------
STANDINS = {"null": (1, 3), "zero": (1, 5), "full": (1, 7)}


@pytest.fixture
def standins() -> Iterator[dict[str, str]]:
    """Char device nodes with the numbers of /dev/null, /dev/zero and /dev/full, mode 0666, in
    a fresh directory under the host's /dev (where real accelerators' nodes are, and which
    runc's init can walk to)."""
    d = Path(tempfile.mkdtemp(prefix="dsec-test-devices-", dir="/dev"))
    d.chmod(0o755)
    out = {}
    try:
        for name, (major, minor) in STANDINS.items():
            path = d / name
            os.mknod(path, 0o666 | stat.S_IFCHR, os.makedev(major, minor))
            path.chmod(0o666)  # past the umask
            out[name] = os.fspath(path)
        yield out
    finally:
        shutil.rmtree(d)


def _hex_numbers(name: str) -> str:
    """``stat -c '%t:%T'``'s answer for a stand-in: major and minor in hex."""
    major, minor = STANDINS[name]
    return f"{major:x}:{minor:x}"


@root_only
async def test_devices_reach_sandboxes_by_mode_and_go_back_at_kill(standins):
    inventory = {"gpu": (standins["null"], standins["zero"])}
    with node_home("dsec-devices-", devices=inventory, device_share_cap=2) as config:
        node = Node(config)
        await node.open()
        try:
            a = await node.create(SandboxSpec(**BASE, devices=["gpu"]))
            b = await node.create(SandboxSpec(**BASE, devices=["gpu"]))
            assert {a.devices, b.devices} == {(standins["null"],), (standins["zero"],)}
            with pytest.raises(AdmissionRejected) as e:
                await node.create(SandboxSpec(**BASE, devices=["gpu:shared"]))
            assert (e.value.reason, e.value.pool) == ("devices", "devices:gpu")
            assert a.id in str(e.value) and b.id in str(e.value)
            assert len(node.sandboxes) == 2  # refused before anything was made

            by_path = {a.devices[0]: a.id, b.devices[0]: b.id}
            null_sb, zero_sb = by_path[standins["null"]], by_path[standins["zero"]]
            r = await node.exec(
                null_sb,
                f"stat -c '%t:%T' {standins['null']} && echo data > {standins['null']} && "
                f"echo wrote; test -e {standins['zero']} || echo absent; "
                f"mknod /tmp/z c 1 5 || echo no-mknod",
            )
            assert r.stdout.split() == [
                _hex_numbers("null").encode(),
                b"wrote",
                b"absent",
                b"no-mknod",
            ], r
            r = await node.exec(
                zero_sb,
                f"stat -c '%t:%T' {standins['zero']} && head -c 8 {standins['zero']} | od -An -tx1",
            )
            assert r.stdout.split() == [_hex_numbers("zero").encode(), *[b"00"] * 8], r
            cgroup = Path("/sys/fs/cgroup/devices/dsec") / zero_sb / "devices.list"
            if cgroup.exists():
                assert "c 1:5 rw" in cgroup.read_text()

            await node.kill(a.id)
            c = await node.create(SandboxSpec(**BASE, devices=["gpu:shared"]))
            d = await node.create(SandboxSpec(**BASE, devices=["gpu:shared"]))
            assert c.devices == d.devices == a.devices  # the one not held exclusively, twice
            with pytest.raises(AdmissionRejected, match="shared by 2 of 2"):
                await node.create(SandboxSpec(**BASE, devices=["gpu:shared"]))
            load = node.load()
            assert load.devices == {"gpu": {"total": 2, "idle": 0, "shareable": 0}}
        finally:
            await node.close(kill_all=True)
        assert node.devices.usage() == {"gpu": {"total": 2, "idle": 2, "shareable": 2}}


@root_only
async def test_a_sandbox_keeps_its_device_across_a_daemon_restart(standins):
    with node_home("dsec-devices-", devices={"gpu": (standins["full"],)}) as config:
        node = Node(config)
        await node.open()
        try:
            a = await node.create(SandboxSpec(**BASE, devices=["gpu"]))
            await node.close()  # the daemon goes; the sandbox stays
            node = Node(config)
            await node.open()
            assert node.get(a.id).devices == (standins["full"],)
            assert node.devices.held_by(a.id) == [standins["full"]]
            with pytest.raises(AdmissionRejected, match=f"exclusive to {a.id}"):
                await node.create(SandboxSpec(**BASE, devices=["gpu"]))
            r = await node.exec(a.id, f"echo x > {standins['full']}")
            assert b"No space left" in r.stderr  # /dev/full's own answer: the device is there
            await node.kill(a.id)
            b = await node.create(SandboxSpec(**BASE, devices=["gpu"]))
            assert b.devices == (standins["full"],)
        finally:
            await node.close(kill_all=True)


@root_only
async def test_a_bad_inventory_stops_the_node_before_it_does_anything(tmp_path):
    regular = tmp_path / "gpu0"
    regular.write_text("")
    with node_home("dsec-devices-", devices={"gpu": (os.fspath(regular),)}) as config:
        with pytest.raises(InvalidSpec, match="not a char or block device"):
            await Node(config).open()
        assert not os.path.ismount(config.run_dir)


class _NoDevices(ContainerBackend):
    name = "container-without-devices"
    features = ContainerBackend.features - {Feature.DEVICES}


@root_only
async def test_a_backend_that_cannot_pass_devices_refuses_them(standins):
    with node_home("dsec-devices-", devices={"gpu": (standins["null"],)}) as config:
        node = Node(config)
        await node.open()
        try:
            node._backends[_NoDevices.name] = _NoDevices(config)
            with pytest.raises(BackendUnavailable, match=r"Feature\.DEVICES"):
                await node.create(SandboxSpec(**BASE, backend=_NoDevices.name, devices=["gpu"]))
            assert node.devices.usage()["gpu"]["idle"] == 1
        finally:
            await node.close(kill_all=True)


@root_only
async def test_a_pool_with_exclusive_devices_grows_no_further_than_them(standins):
    inventory = {"gpu": (standins["null"], standins["zero"])}
    with node_home("dsec-devices-", devices=inventory) as config:
        CatalogStore(config.catalog_dir).save(
            Catalog(name="dev", environments=(Environment(name="bb", base="kit-base@1"),))
        )
        node = Node(config)
        node.pools = Pools(node, PoolSettings(max=8, checkout_timeout=1.0))
        await node.open()
        try:
            call = dict(cmd="sleep 2; ls /dev/dsec-test-devices-*", memory="64M", devices=["gpu"])
            held = [asyncio.ensure_future(node.fncall("bb", **call)) for _ in range(2)]
            key = PoolKey("bb", "fncall", 1.0, 64 << 20, (DeviceRequest("gpu"),))
            await async_until(
                lambda: (
                    (p := node.pools.pools.get(key)) is not None
                    and len(p.members) == 2
                    and not p.free
                ),
                what="both members started and busy",
            )
            # a third member would need a third device: the call waits for one of the two,
            # and past the checkout timeout gets the node's refusal naming the devices
            t0 = time.monotonic()
            with pytest.raises(AdmissionRejected) as e:
                await node.fncall("bb", **call)
            assert e.value.reason == "devices" and time.monotonic() - t0 >= 0.9
            node.pools.settings = PoolSettings(max=8, checkout_timeout=10.0)
            for p in node.pools.pools.values():
                p.settings = node.pools.settings
            waiter = await node.fncall("bb", **{**call, "cmd": "ls /dev/dsec-test-devices-*"})
            assert waiter.ok and waiter.wait > 0.2  # it got a member the first two gave back
            results = await asyncio.gather(*held)
            assert all(r.ok for r in results), results
            seen = {r.stdout.strip() for r in results}
            assert seen == {b"null", b"zero"}  # each member its own device
            pool = node.pools.pools[key]
            assert pool.size == 2
            r = await node.fncall("bb", **call)  # a member is free again: no new one needed
            assert r.ok and pool.size == 2
            plain = await node.fncall(
                "bb", cmd="ls /dev/dsec-test-devices-* || echo none", memory="64M"
            )
            assert plain.stdout.strip() == b"none"  # another pool, without devices
        finally:
            await node.close(kill_all=True)


@root_only
def test_devices_through_the_http_api_sdk_and_node_status():
    """The same through a node daemon: a spec's devices, an FnCall's, and ``node status``."""
    with running_kit_node("dsec-devices-kit-") as kit:
        assert kit.device is not None
        path = os.fspath(kit.device)
        CatalogStore(kit.config.catalog_dir).save(
            Catalog(name="dev", environments=(Environment(name="bb", base=kit.layer.ref),))
        )
        with kit.client() as client:
            r = client.fncall(
                "bb", f"stat -c '%t:%T' {path}", memory="64M", devices=[KIT_DEVICE_KIND]
            )
            assert r.ok and r.stdout == b"1:3\n", r
            assert r.pool.endswith(f"/{KIT_DEVICE_KIND}:1:exclusive")
            [dev] = client.node_info()["devices"]
            assert (dev["kind"], dev["path"], dev["exclusive"]) == (
                KIT_DEVICE_KIND,
                path,
                [r.member],  # the pool's member holds it between calls
            )
            with pytest.raises(AdmissionRejected) as e:
                client.create(layers=(kit.layer.ref,), memory="64M", devices=[KIT_DEVICE_KIND])
            assert e.value.pool == f"devices:{KIT_DEVICE_KIND}" and r.member in str(e.value)


@root_only
async def test_judge_mode_runs_in_a_member_holding_the_device(standins):
    inventory = {"gpu": (standins["null"],)}
    with node_home("dsec-devices-", devices=inventory) as config:
        CatalogStore(config.catalog_dir).save(
            Catalog(name="dev", environments=(Environment(name="bb", base="kit-base@1"),))
        )
        node = Node(config)
        node.pools = Pools(node, PoolSettings(max=2))
        await node.open()
        try:
            spec = JudgeSpec(
                environment="bb",
                run="ls /dev/dsec-test-devices-* && for d in /dev/dsec-test-devices-*/null; "
                "do echo data > $d; done",
                cases=(JudgeCase(b"", b"null\n"),),
                memory="96M",
                memory_limit="32M",
                devices=("gpu",),
            )
            r = await node.judge(spec)
            assert r.verdict == "AC", r.cases
            assert node.sandboxes[r.member].rt.devices[0].host_path == standins["null"]
            without = await node.judge(dataclasses.replace(spec, devices=()))
            assert without.verdict in ("RE", "WA") and without.member != r.member
        finally:
            await node.close(kill_all=True)
