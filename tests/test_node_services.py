"""The node's services on their own: each runs against a fake host (``fake_host.FakeHost``, the
protocols of ``dsec_core.node.host`` over records) with no daemon, mount or process; the
integration tests (test_node, test_snapshots, test_pause, test_rollouts, ...) prove the same
behaviour through a whole node."""

from __future__ import annotations

import asyncio
import json
import os
import socket
import stat
from dataclasses import replace
from typing import Any

import pytest
from fake_host import FakeBackend, FakeCatalogs, FakeHost, PlainBackend, layer, plan_of

from dsec_core.backend import RootfsForm
from dsec_core.catalog.model import Environment
from dsec_core.errors import (
    AdmissionRejected,
    BackendUnavailable,
    FeatureUnavailable,
    InvalidSpec,
    LeaseHeld,
    MissingParentLayers,
    PolicyUnavailable,
    SandboxDied,
    SandboxNotRunning,
    SandboxPaused,
    StartTimeout,
    UnknownPolicy,
    UnknownSandbox,
    UnknownSnapshot,
    UnknownSource,
)
from dsec_core.node import admission, lifecycle
from dsec_core.node import host as host_protocols
from dsec_core.node.admission import Admission
from dsec_core.node.agents import Agents
from dsec_core.node.devices import DevicePool
from dsec_core.node.drive import DriveServer
from dsec_core.node.idpool import UidPool
from dsec_core.node.layer_snapshots import LayerSnapshots
from dsec_core.node.leases import Leases
from dsec_core.node.lifecycle import Lifecycle
from dsec_core.node.memory import MemorySnapshots
from dsec_core.node.mounts import MountCache
from dsec_core.node.pause import Pauses
from dsec_core.node.persistence import STATE_FILE, StateFiles, write_state
from dsec_core.node.policies import PolicyPlanner, enforcer
from dsec_core.node.rootfs import RootFilesystems
from dsec_core.node.sandbox import POOL_LABEL
from dsec_core.node.screen import Screens
from dsec_core.plugins import Registry
from dsec_core.records import (
    PROJECT_LABEL,
    ExecResult,
    IdMap,
    InfraEvent,
    LayerRef,
    SandboxSpec,
)
from dsec_core.security import SecurityPolicy


@pytest.fixture
def host(tmp_path) -> FakeHost:
    return FakeHost(tmp_path)


# --- policies ---------------------------------------------------------------------------------
class Guard(SecurityPolicy):
    """A default policy through "oci" that counts what the node asks of it."""

    name = "guard"
    targets = frozenset({"oci"})
    default = True
    checks = 0

    def __init__(self) -> None:
        self.applied: list[tuple[str, dict]] = []
        self.released_ids: list[str] = []
        self.adopted_ids: list[str] = []

    @classmethod
    def check_available(cls) -> None:
        cls.checks += 1

    def apply(self, target, rt, settings, subject) -> None:
        self.applied.append((target, dict(settings)))

    def released(self, rt) -> None:
        self.released_ids.append(rt.id)

    def adopted(self, rt, settings) -> None:
        self.adopted_ids.append(rt.id)


class VmOnly(SecurityPolicy):
    """A default policy no container backend can enforce."""

    name = "vm-only"
    targets = frozenset({"vm"})
    default = True


class Missing(SecurityPolicy):
    """An opt-in policy this host lacks."""

    name = "missing"
    targets = frozenset({"oci"})

    @classmethod
    def check_available(cls) -> None:
        raise PolicyUnavailable("no such tool here", policy="missing")


class Egress(SecurityPolicy):
    """An opt-in, live policy that enforces network mode "allowlist"."""

    name = "egress"
    targets = frozenset({"oci"})
    network_modes = frozenset({"allowlist"})
    live = True

    def __init__(self) -> None:
        self.updates: list[dict] = []

    def validate(self, settings) -> None:
        if not isinstance(settings.get("allow", []), list):
            raise InvalidSpec("allow is a list", field="allow")

    def update(self, rt, settings) -> None:
        self.updates.append(dict(settings))

    def stats(self, rt) -> dict[str, Any]:
        return {"denied": 3}


POLICIES: dict[str, type[SecurityPolicy]] = {p.name: p for p in (Guard, VmOnly, Missing, Egress)}


def registry(**policies: type[SecurityPolicy]) -> Registry:
    return Registry(
        backends={"fake": FakeBackend, "plain": PlainBackend},
        layer_sources={},
        security_policies=policies or POLICIES,
    )


def spec(**kw: Any) -> SandboxSpec:
    return SandboxSpec(**{"layers": ("base@1",), **kw})


def test_a_plan_has_the_defaults_the_backend_can_enforce_and_says_why_not_the_others():
    plan = PolicyPlanner(registry()).plan(spec(), FakeBackend())
    assert [p.name for p, _ in plan.chosen] == ["guard"]
    assert plan.skipped["vm-only"].startswith("skipped: security policy 'vm-only' cannot be")
    assert plan.states() == {"guard": "enforced", "vm-only": plan.skipped["vm-only"]}


def test_a_policy_asked_for_that_cannot_run_fails_the_plan_unless_best_effort():
    planner = PolicyPlanner(registry())
    with pytest.raises(PolicyUnavailable, match="no such tool"):
        planner.plan(spec(policies={"missing": {}}), FakeBackend())
    plan = planner.plan(spec(policies={"missing": {"best_effort": True}}), FakeBackend())
    assert plan.skipped["missing"] == "skipped: no such tool here"
    off = planner.plan(spec(policies={"guard": {"enabled": False}}), FakeBackend())
    assert off.skipped["guard"] == "off: the sandbox's spec turned it off"
    with pytest.raises(UnknownPolicy):
        planner.plan(spec(policies={"nope": {}}), FakeBackend())


def test_a_network_mode_needs_a_policy_that_enforces_it_or_the_backends_namespace():
    planner = PolicyPlanner(registry())
    with pytest.raises(PolicyUnavailable, match=r"needs a security policy.*\(egress\)"):
        planner.plan(spec(network="allowlist"), FakeBackend())
    plan = planner.plan(
        spec(network="allowlist", policies={"egress": {"allow": []}}), FakeBackend()
    )
    assert plan.find("egress") is not None
    with pytest.raises(PolicyUnavailable, match="does not isolate the network"):
        planner.plan(spec(), PlainBackend())


def test_a_policys_availability_is_asked_once_in_a_while():
    planner = PolicyPlanner(registry())
    Guard.checks = 0
    for _ in range(5):
        planner.plan(spec(), FakeBackend())
    assert Guard.checks == 1


def test_a_plan_read_back_has_the_same_instances_and_settings():
    planner = PolicyPlanner(registry())
    saved = {"chosen": {"guard": {}, "egress": {"allow": ["x"]}}, "skipped": {"vm-only": "no"}}
    plan = planner.recorded("sb", saved, spec(), FakeBackend())
    assert [(p, s) for p, s in plan.chosen] == [
        (planner.policy("guard"), {}),
        (planner.policy("egress"), {"allow": ["x"]}),
    ]
    assert plan.skipped == {"vm-only": "no"}
    assert planner.recorded("sb", None, spec(), FakeBackend()).find("guard") is not None
    # a policy that is gone since: the sandbox keeps running with none on record
    assert planner.recorded("sb", {"chosen": {"gone": {}}}, spec(), FakeBackend()).chosen == []


def test_a_live_policys_settings_change_on_a_running_sandbox_only(host):
    planner = PolicyPlanner(registry())
    egress = planner.policy("egress")
    sb = host.add(policies=plan_of((egress, {"allow": []}), (planner.policy("guard"), {})))
    state = planner.change(sb, "egress", {"allow": ["example.org"], "best_effort": True})
    assert state.settings == {"allow": ["example.org"]} and state.stats == {"denied": 3}
    assert egress.updates == [{"allow": ["example.org"]}]
    assert sb.policies.find("egress") == (egress, {"allow": ["example.org"]})
    with pytest.raises(InvalidSpec):
        planner.change(sb, "egress", {"allow": "all"})
    with pytest.raises(PolicyUnavailable, match="cannot change on a running sandbox"):
        planner.change(sb, "guard", {})
    with pytest.raises(PolicyUnavailable, match="not in force"):
        planner.change(sb, "missing", {})
    assert [p.name for p in planner.states(sb)] == ["egress", "guard"]
    sb.status = "stopping"
    with pytest.raises(SandboxNotRunning):
        planner.change(sb, "egress", {})


def test_the_enforcer_applies_the_policies_of_a_target_and_the_plan_releases_them(host):
    planner = PolicyPlanner(registry())
    guard = planner.policy("guard")
    sb = host.add(policies=plan_of((guard, {"k": 1})))
    enforce = enforcer(lambda: sb)
    enforce("oci", {})
    enforce("vm", {})
    assert guard.applied == [("oci", {"k": 1})]
    sb.policies.release(sb.rt)
    assert guard.released_ids == [sb.rt.id]


# --- admission --------------------------------------------------------------------------------
def test_what_a_spec_asks_of_its_backend():
    admission.check_backend(spec(runtime="runc"), FakeBackend())
    with pytest.raises(InvalidSpec, match="no runtime 'runsc'"):
        admission.check_backend(spec(runtime="runsc"), FakeBackend())
    with pytest.raises(BackendUnavailable, match=r"Feature\.DEVICES"):
        admission.check_backend(spec(devices=["gpu"]), PlainBackend())


def test_a_driver_names_only_live_sandboxes_of_its_node(host):
    worker = host.add()
    admission.check_drives(spec(drives=[worker.rt.id]), FakeBackend(), host.sandboxes)
    with pytest.raises(BackendUnavailable, match=r"Feature\.DRIVE"):
        admission.check_drives(spec(drives=[worker.rt.id]), PlainBackend(), host.sandboxes)
    worker.status = "stopping"
    with pytest.raises(UnknownSandbox):
        admission.check_drives(spec(drives=[worker.rt.id]), FakeBackend(), host.sandboxes)


def test_project_usage_counts_live_sandboxes_and_what_their_backend_adds(host):
    class Vm(FakeBackend):
        memory_overhead = 100

    host.add(spec=spec(cpu=2, memory="64M", labels={PROJECT_LABEL: "a"}), backend=Vm())
    host.add(spec=spec(cpu=1, memory="32M", labels={PROJECT_LABEL: "a"}))
    host.add(spec=spec(labels={PROJECT_LABEL: "a"}), status="dead")
    host.add(spec=spec(labels={PROJECT_LABEL: "b"}), status="creating")
    host.add()  # no project
    usage = admission.project_usage(host.sandboxes.values())
    assert usage["a"] == (2, 3.0, (96 << 20) + 100)
    assert usage["b"][0] == 1 and set(usage) == {"a", "b"}


def test_warm_layers_and_the_environments_made_only_of_them(host):
    host.add(spec=spec(layers=("tool@1", "base@1")))
    host.add(spec=spec(layers=("gone@1",)), status="dead")
    catalogs = FakeCatalogs(
        Environment(name="e1", base="base@1", toolkits=("tool@1",), catalog="c"),
        Environment(name="e2", base="base@1", toolkits=("other@1",), catalog="c"),
    )
    layers, environments = admission.warm(host.sandboxes.values(), ["other@2"], catalogs)
    assert layers == ["base@1", "other@2", "tool@1"]
    assert environments == ["c/e1", "e1"]


def test_a_spec_with_its_environment_applied():
    env = Environment(
        name="env",
        base="base@1",
        env={"A": "1", "B": "1"},
        workdir="/w",
        backend="vm",
        kernel="linux-image-cloud-amd64",
    )
    catalogs = FakeCatalogs(env)
    resolved, kernel = admission.resolve_spec(
        SandboxSpec(environment="env", env={"B": "2"}), catalogs
    )
    assert (resolved.env, resolved.workdir, resolved.backend) == ({"A": "1", "B": "2"}, "/w", "vm")
    assert kernel == "linux-image-cloud-amd64"
    assert admission.resolve_spec(spec(), catalogs)[0].backend == "container"
    assert admission.backend_label(SandboxSpec(environment="nope"), catalogs) == "unknown"


async def test_admission_takes_a_uid_range_and_devices_and_gives_them_back(tmp_path):
    host = FakeHost(tmp_path, node_name="n1", devices={"gpu": ("/dev/null",)})
    host.catalogs = FakeCatalogs(Environment(name="env", base="base@1", toolkits=("kit@1",)))
    uids = UidPool(1 << 20, 65536, 2, 0)
    adm = Admission(host, registry(), PolicyPlanner(registry()), uids)
    adm.devices = DevicePool.probe(host.config)  # what open() does, without raising sysctls
    try:
        asked = SandboxSpec(environment="env", layers=("mine@1",), backend="fake", devices=["gpu"])
        a = adm.admit(asked)
        assert a.sid.endswith("-n1") and a.layers == ("mine@1", "kit@1", "base@1")
        assert [p.name for p, _ in a.plan.chosen] == ["guard"]
        assert uids.in_use() == 1 and adm.devices.held_by(a.sid) == ["/dev/null"]
        assert adm.load().devices == {"gpu": {"total": 1, "idle": 0, "shareable": 0}}
        adm.release(a.sid, a.idmap)
        assert uids.in_use() == 0 and adm.devices.held_by(a.sid) == []
        # a refusal takes nothing
        with pytest.raises(AdmissionRejected):
            adm.admit(spec(backend="fake", cpu=1024))
        assert uids.in_use() == 0
    finally:
        await adm.close()


# --- root filesystems ------------------------------------------------------------------------
class ImageBackend(FakeBackend):
    """A VM-like backend: the layers' image files and a writable disk, nothing mounted."""

    rootfs = RootfsForm.IMAGES


async def test_an_images_backend_gets_the_layer_files_and_a_sparse_disk(host):
    images = {"tool@1": host.tmp / "tool.erofs", "base@1": host.tmp / "base.erofs"}
    source = Source("local", layer("tool@1"), layer("base@1"))
    source.image_path = lambda info: images[info.ref]
    fs = RootFilesystems(host.config, UidPool(1 << 20, 65536, 1, 0))
    fs.mounts = MountCache(host.tmp / "mnt")
    fs.sources = [source]
    sb = host.add(spec=spec(layers=("tool@1", "base@1"), disk="64M"))
    sb.rt.dir.mkdir(parents=True)
    taken: list[str] = []
    rt = await fs.prepare(sb.rt, ImageBackend(), fs.resolve(sb.rt.spec.layers), taken)
    assert [(i.ref, i.image, i.device) for i in rt.images] == [
        ("tool@1", images["tool@1"], None),
        ("base@1", images["base@1"], None),
    ]
    assert rt.rootfs is None and taken == [] and rt.disk_size == 64 << 20
    assert rt.disk.stat().st_size == 64 << 20 and rt.disk.stat().st_blocks == 0  # sparse
    assert await fs.prefetch(["base@1"]) == [
        {"layer": "base@1", "source": "local", "fetched": 0, "mode": "local"}
    ]
    await fs.undo(taken, rt)
    assert not rt.data_dir.exists() and not rt.dir.exists()


async def test_concurrent_fetches_of_one_image_run_once(host):
    fs = RootFilesystems(host.config, UidPool(1 << 20, 65536, 1, 0))
    calls = []

    def fetch(what):
        calls.append(what)
        return what * 2

    got = await asyncio.gather(*(fs.once(("image", "d1"), fetch, 21) for _ in range(5)))
    assert got == [42] * 5 and calls == [21]
    assert await fs.once(("image", "d1"), fetch, 1) == 2  # done: the next one runs again


# --- lifecycle: TTLs, exits, deaths -----------------------------------------------------------
async def test_a_sandbox_is_killed_when_its_ttl_runs_out_and_a_new_ttl_moves_the_end(host):
    life = Lifecycle(host)
    sb = host.add()
    life.set_ttl(sb, 0.05)
    other = host.add()
    life.set_ttl(other, 0.05)
    life.set_ttl(other, None)  # lives until killed
    assert other.expires is None and other.ttl_handle is None
    await asyncio.sleep(0.15)
    await asyncio.gather(*life.tasks)
    assert host.killed == [(sb.rt.id, "ttl")]
    with pytest.raises(InvalidSpec):
        life.set_ttl(other, 0)
    with pytest.raises(InvalidSpec):
        life.set_ttl(other, float("inf"))
    other.status = "creating"
    with pytest.raises(SandboxNotRunning):
        life.set_ttl(other, 10)
    life.unwatch(other)
    await life.close()


async def test_a_sandbox_that_exits_is_heard_of_and_an_expected_exit_is_not(host):
    life = Lifecycle(host)
    quiet, loud = host.add(), host.add()
    (old_r, old_w), (new_r, new_w), (loud_r, loud_w) = os.pipe(), os.pipe(), os.pipe()
    host.fake.exit_fds = {quiet.rt.id: old_r, loud.rt.id: loud_r}
    life.watch(quiet)
    life.watch(loud)
    assert quiet.exit_fd is not None and loud.exit_fd is not None
    with life.expect_exit(quiet):
        assert quiet.exit_fd is None
        os.write(old_w, b"x")  # its process ends (a VM's save or pause)...
        host.fake.exit_fds[quiet.rt.id] = new_r  # ...and it runs on in a new one
    await asyncio.sleep(0.05)
    assert host.killed == [] and quiet.exit_fd is not None
    os.write(loud_w, b"x")
    await asyncio.sleep(0.05)
    await asyncio.gather(*life.tasks)
    assert host.killed == [(loud.rt.id, "died")]
    await life.close()
    for fd in (old_r, old_w, new_r, new_w, loud_r, loud_w):
        os.close(fd)


async def test_the_watch_loop_polls_sandboxes_without_an_exit_descriptor(host, monkeypatch):
    monkeypatch.setattr(lifecycle, "WATCH_PERIOD", 0.01)
    swept = []
    life = Lifecycle(host, sweep=lambda: swept.append(1))
    sb = host.add()
    life.start()
    host.fake.dead.add(sb.rt.id)
    for _ in range(100):
        if host.killed:
            break
        await asyncio.sleep(0.01)
    life.stop()
    await life.close()
    assert host.killed == [(sb.rt.id, "died")] and swept


async def test_the_watch_loop_leaves_a_sandbox_alone_while_its_exit_is_expected(host, monkeypatch):
    """A VM's pause ends QEMU before it records the saved state: a poll of the watch loop in
    between saw a dead sandbox and killed it (a CI run paused a microVM into "stopping").
    Inside ``expect_exit`` the loop does not poll it; after, it does again."""
    monkeypatch.setattr(lifecycle, "WATCH_PERIOD", 0.01)
    life = Lifecycle(host)
    sb = host.add()
    life.start()
    with life.expect_exit(sb):
        host.fake.dead.add(sb.rt.id)  # its process is gone, its new state not yet recorded
        await asyncio.sleep(0.1)  # ten rounds of the loop
        assert host.killed == []
    for _ in range(100):
        if host.killed:
            break
        await asyncio.sleep(0.01)
    life.stop()
    await life.close()
    assert host.killed == [(sb.rt.id, "died")]


def test_a_request_to_a_sandbox_that_died_is_sandbox_died_while_the_node_cleans_up(host):
    """Once the node finds a sandbox dead it is stopping until its clean-up ends: a request
    meanwhile is SandboxDied with the cause, not SandboxNotRunning (the soak's QEMU kill got
    SandboxNotRunning, which names no fault); one being killed on request stays
    SandboxNotRunning."""
    life, agents = Lifecycle(host), Agents(host)
    died, killed = host.add(), host.add()
    life.death_of(died)
    for sb in (died, killed):
        sb.status = "stopping"
    with pytest.raises(SandboxDied, match="the OOM killer took its init") as e:
        agents.agent(died.rt.id)
    assert e.value.context["kind"] == "oom"
    with pytest.raises(SandboxNotRunning) as e:
        agents.agent(killed.rt.id)
    assert not isinstance(e.value, SandboxDied)


def test_what_a_sandbox_died_of_is_remembered_for_a_while(host, monkeypatch):
    monkeypatch.setattr(lifecycle, "MAX_DEATHS", 2)
    life = Lifecycle(host)
    sbs = [host.add() for _ in range(3)]
    event = life.death_of(sbs[0])
    assert (event.kind, event.sandbox_id) == ("crashed", sbs[0].rt.id)
    assert event.detail == "oom: the OOM killer took its init"
    host.fake.cause = None
    life.death_of(sbs[1])
    life.death_of(sbs[2])
    assert isinstance(life.missing(sbs[0].rt.id), UnknownSandbox)  # forgotten: the oldest
    died = life.missing(sbs[1].rt.id)
    assert isinstance(died, SandboxDied) and "crashed" in str(died)
    assert not isinstance(life.missing("never"), SandboxDied)


async def test_a_start_over_its_timeout_stops_the_backend(host):
    life = Lifecycle(host)
    sb = host.add(spec=spec(start_timeout=1.0))
    await life.check_start(sb, 0.5)
    with pytest.raises(StartTimeout, match="over its start_timeout of 1s"):
        await life.check_start(sb, 1.5)
    assert host.fake.stopped == [sb.rt.id]
    await life.check_start(host.add(), 1e6)  # no bound


# --- persistence and adoption -----------------------------------------------------------------
def _state_host(tmp_path) -> tuple[FakeHost, PolicyPlanner]:
    host = FakeHost(tmp_path)
    host.config.runtime_dir.mkdir(parents=True)
    host.config.sandbox_dir.mkdir(parents=True)
    return host, PolicyPlanner(registry())


def _written(host: FakeHost, planner: PolicyPlanner, **fields: Any):
    sb = host.add(
        spec=spec(env={"A": "1"}, labels={"l": "v"}),
        policies=plan_of((planner.policy("guard"), {"k": 1}), **{"vm-only": "skipped: no"}),
        **fields,
    )
    sb.rt.dir.mkdir()
    write_state(sb)
    return sb


def test_a_state_read_back_is_the_sandbox_written(tmp_path):
    host, planner = _state_host(tmp_path)
    sb = _written(host, planner, events=[InfraEvent("preempted", "x", 1.0, "lease lapsed")])
    sb.preempted, sb.oom_kills, sb.expires = True, 2, 1e12
    write_state(sb)
    path = sb.rt.dir / STATE_FILE
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    back = StateFiles(host, planner).load(sb.rt.dir)
    assert back.rt.spec == sb.rt.spec and back.rt.idmap == sb.rt.idmap
    assert back.layers == sb.layers and back.events == sb.events
    assert (back.expires, back.oom_kills, back.status) == (1e12, 2, "running")
    assert back.policies.chosen == sb.policies.chosen and back.policies.skipped == {
        "vm-only": "skipped: no"
    }
    # the freezer is the truth: not paused, so not preempted either
    assert not back.paused and not back.preempted
    host.fake.paused_ids.add(sb.rt.id)
    again = StateFiles(host, planner).load(sb.rt.dir)
    assert again.paused and again.preempted


async def test_recovery_adopts_what_runs_and_cleans_up_the_rest(tmp_path):
    host, planner = _state_host(tmp_path)
    alive = _written(host, planner)
    dead = _written(host, planner)
    expired = _written(host, planner, expires=1.0)
    write_state(expired)
    host.fake.dead.add(dead.rt.id)
    (host.config.runtime_dir / "garbage").mkdir()
    host.sandboxes.clear()  # a new daemon knows none of them
    adopted = await StateFiles(host, planner).recover()
    assert [sb.rt.id for sb in adopted] == [alive.rt.id]
    guard = planner.policy("guard")
    assert guard.adopted_ids == [alive.rt.id]
    assert sorted(guard.released_ids) == sorted([dead.rt.id, expired.rt.id])
    assert sorted(host.fake.stopped) == sorted([dead.rt.id, expired.rt.id])
    assert sorted(p.name for p in host.config.runtime_dir.iterdir()) == [alive.rt.id]


# --- layer snapshots --------------------------------------------------------------------------
class Source:
    """A layer source over a dict of layers."""

    local = True

    def __init__(self, url: str, *layers) -> None:
        self.url = url
        self.layers = {i.ref: i for i in layers}
        self.pushed: list[str] = []

    def resolve(self, ref: LayerRef):
        return self.layers.get(str(ref))

    def list(self):
        return list(self.layers.values())


SNAP = layer(
    "snap@1",
    kind="snapshot",
    parents=("tool@1", "base@1"),
    parent_digests=("sha256:tool@1", "sha256:base@1"),
    env=("A=1", "B=1"),
    workdir="/work",
)


def test_a_snapshot_is_restored_only_over_the_parents_it_recorded(host):
    host.layer_sources = [Source("local", SNAP, layer("tool@1"), layer("base@1"))]
    snaps = LayerSnapshots(host)
    assert snaps.checked("snap@1") == SNAP
    host.layer_sources = [Source("local", SNAP, layer("base@1"))]
    with pytest.raises(MissingParentLayers, match=r"tool@1 \(sha256:tool@1\)"):
        snaps.checked("snap@1")
    with pytest.raises(InvalidSpec, match="not a snapshot"):
        snaps.checked("base@1")
    with pytest.raises(UnknownSource, match="none of this node's layer sources"):
        snaps.source("posix:/elsewhere")


def test_a_restored_spec_stacks_the_snapshot_and_keeps_the_callers_own(host):
    made = LayerSnapshots(host).restore_spec(SNAP, SandboxSpec(environment="e", env={"B": "2"}))
    assert made.layers == ("snap@1", "tool@1", "base@1") and made.environment is None
    assert made.env == {"A": "1", "B": "2"} and made.workdir == "/work"
    mine = LayerSnapshots(host).restore_spec(SNAP, spec(workdir="/mine"))
    assert mine.workdir == "/mine"


async def test_a_restore_is_all_or_nothing(host):
    host.layer_sources = [Source("local", SNAP, layer("tool@1"), layer("base@1"))]
    snaps = LayerSnapshots(host)
    made = await snaps.restore("snap@1", 2)
    assert len(made) == 2 and host.killed == []
    host.failing_creates = 1
    with pytest.raises(Exception, match="the fake create failed"):
        await snaps.restore("snap@1", 3)
    assert len(host.killed) == 2  # the two made are killed


async def test_what_pack_diff_refuses_before_it_freezes_anything(host):
    snaps = LayerSnapshots(host)
    with pytest.raises(SandboxNotRunning):
        await snaps.pack_diff(host.add(status="creating").rt.id)
    # no overlay (the fake's sandboxes have none), and no Feature.PACK_DIFF for its disk
    with pytest.raises(BackendUnavailable, match=r"does not claim Feature\.PACK_DIFF"):
        await snaps.pack_diff(host.add().rt.id)
    sb = host.add()
    sb.rt = replace(sb.rt, rootfs=sb.rt.dir / "rootfs")
    sb.packing = asyncio.get_running_loop().create_future()
    with pytest.raises(InvalidSpec, match="being packed already"):
        await snaps.pack_diff(sb.rt.id)
    sb.packing.cancel()


# --- memory snapshots -------------------------------------------------------------------------
async def test_a_memory_snapshot_is_saved_read_restored_and_removed(host):
    memory = MemorySnapshots(host)
    sb = host.add(spec=spec(ttl=100, labels={"a": "1"}))
    snap = await memory.save(sb.rt.id, "snap-1")
    assert host.quiet == [sb.rt.id]  # its process may stop for the save: no death
    assert snap.bytes >= 8192 and memory.get("snap-1") == snap and memory.exists("snap-1")
    with pytest.raises(InvalidSpec, match="exists already"):
        await memory.save(sb.rt.id, "snap-1")
    made = await memory.restore("snap-1", 2, spec(ttl=5, labels={"b": "2"}))
    assert len(made) == 2
    made_spec, saved = host.created[-1]
    assert made_spec.ttl == 5 and made_spec.labels == {"a": "1", "b": "2"}
    assert saved == memory.directory("snap-1")
    memory.remove("snap-1")
    with pytest.raises(UnknownSnapshot):
        memory.get("snap-1")


async def test_what_a_memory_snapshot_refuses(host):
    memory = MemorySnapshots(host)
    with pytest.raises(InvalidSpec, match="1-64 of letters"):
        memory.directory("../x")
    assert not memory.exists("base@1")  # a layer's name: restore looks for a layer then
    with pytest.raises(FeatureUnavailable, match="only VM backends"):
        await memory.save(host.add(backend=PlainBackend()).rt.id)
    with pytest.raises(SandboxPaused):
        await memory.save(host.add(paused=True).rt.id)


# --- pause ------------------------------------------------------------------------------------
async def test_a_pause_stops_a_sandbox_where_it_is_and_a_resume_lets_it_go_on(host):
    pauses = Pauses(host)
    sb = host.add()
    info = await pauses.pause(sb.rt.id, preempted=True)
    assert info.state == "paused" and sb.preempted and host.fake.paused(sb.rt, {})
    assert host.saves == [sb.rt.id] and host.quiet == [sb.rt.id]
    await pauses.pause(sb.rt.id)  # a paused one changes nothing
    assert host.saves == [sb.rt.id]
    assert (await pauses.resume(sb.rt.id)).state == "running" and not sb.preempted
    with pytest.raises(InvalidSpec, match="pool member"):
        await pauses.pause(host.add(spec=spec(labels={POOL_LABEL: "p"})).rt.id)
    with pytest.raises(BackendUnavailable, match="cannot pause"):
        await pauses.pause(host.add(backend=PlainBackend()).rt.id)
    with pytest.raises(SandboxNotRunning):
        await pauses.resume(host.add(status="stopping").rt.id)


# --- agents and screens -----------------------------------------------------------------------
async def test_a_command_the_oom_killer_struck_is_marked_and_noted(host):
    agents = Agents(host)
    sb = host.add()
    result = ExecResult(137, b"", b"", 0.1, command="big")
    assert agents.note_oom(sb, result) is result  # no kills yet
    host.fake.oom_kills[sb.rt.id] = 1
    marked = agents.note_oom(sb, result)
    assert marked.oom_killed and host.recorded[0].kind == "out_of_memory"
    assert agents.note_oom(sb, result) is result  # the same kill counts once
    plain = host.add(backend=PlainBackend())
    assert agents.note_oom(plain, result) is result  # no cgroups: no count to read


async def test_an_agent_is_asked_only_of_a_running_unpaused_sandbox(host):
    agents = Agents(host)
    with pytest.raises(SandboxPaused):
        agents.agent(host.add(paused=True).rt.id)
    with pytest.raises(SandboxNotRunning):
        agents.agent(host.add(status="creating").rt.id)
    sb = host.add()
    assert agents.agent(sb.rt.id) is agents.agent(sb.rt.id)  # one client per sandbox
    with pytest.raises(InvalidSpec, match="step needs a trajectory"):
        await agents.exec(sb.rt.id, "true", step=1)


async def test_a_screen_is_there_only_on_backends_that_have_one(host):
    screens = Screens(host)
    sb = host.add()
    assert await screens.screenshot(sb.rt.id) == b"\x89PNG fake"
    sent = await screens.input(sb.rt.id, [{"type": "key", "key": "a"}])
    assert sent == 1 and len(host.fake.inputs) == 1
    with pytest.raises(InvalidSpec):
        await screens.input(sb.rt.id, [{"type": "nonsense"}])
    with pytest.raises(FeatureUnavailable, match="has no screen"):
        await screens.screenshot(host.add(backend=PlainBackend()).rt.id)


# --- trainer leases ---------------------------------------------------------------------------
async def test_a_lapsed_lease_pauses_its_sandboxes_and_a_new_one_resumes_them(host):
    leases = Leases(host)
    worker = host.add()
    agent = host.add(spec=spec(drives=[worker.rt.id]))
    lease = await leases.take([worker.rt.id, agent.rt.id], ttl=0.2, holder="trainer-1")
    with pytest.raises(LeaseHeld):
        await leases.take([worker.rt.id], ttl=1, holder="trainer-2")
    await asyncio.sleep(0.3)
    await host.settle()
    assert leases.get(lease.id).state == "lapsed"
    assert worker.preempted and agent.preempted
    assert [e.kind for e in host.recorded] == ["preempted", "preempted"]
    assert host.recorded[0].sandbox_id == agent.rt.id  # drivers first
    new = await leases.take([worker.rt.id, agent.rt.id], ttl=5, holder="trainer-2")
    assert not worker.paused and not agent.paused
    with pytest.raises(Exception, match="no lease"):
        leases.get(lease.id)  # handed over whole
    leases.forget(worker.rt.id)
    assert leases.get(new.id).sandboxes == (agent.rt.id,)
    await leases.release(new.id, kill=True)
    assert host.killed == [(agent.rt.id, "request")]
    leases.close()


async def test_a_lease_names_sandboxes_that_exist_for_a_sane_time(host):
    leases = Leases(host)
    with pytest.raises(UnknownSandbox):
        await leases.take(["nope"], ttl=1)
    with pytest.raises(InvalidSpec):
        await leases.take([host.add().rt.id], ttl=0)
    with pytest.raises(InvalidSpec):
        await leases.take([], ttl=1)


# --- the drive socket -------------------------------------------------------------------------
def _ask(path, *requests: dict) -> list[dict]:
    with socket.socket(socket.AF_UNIX) as s:
        s.connect(os.fspath(path))
        f = s.makefile("rwb")
        answers = []
        for req in requests:
            try:
                f.write(json.dumps(req).encode() + b"\n")
                f.flush()
            except BrokenPipeError:  # a caller it serves nothing: answered and closed at once
                pass
            answers.append(json.loads(f.readline()))
        return answers


@pytest.mark.skipif(os.geteuid() != 0, reason="the test takes its caller, root, for a sandbox")
async def test_the_drive_socket_serves_the_sandbox_that_holds_the_callers_uid(tmp_path):
    host = FakeHost(tmp_path)
    drive = DriveServer(host, tmp_path / "drive")
    await drive.start()
    try:
        stranger = await asyncio.to_thread(_ask, drive.socket_path, {"op": "workers"})
        assert "serves sandboxes that drive others" in stranger[0]["error"]["message"]
        worker = host.add()
        # this test's own uid (root's 0) is in the driver's range: the socket takes us for it
        driver = host.add(spec=spec(drives=[worker.rt.id]), idmap=IdMap(0, 65536))
        workers, run, other = await asyncio.to_thread(
            _ask,
            drive.socket_path,
            {"op": "workers"},
            {"op": "exec", "sandbox": worker.rt.id, "cmd": "cat", "stdin": "aGk="},
            {"op": "exec", "sandbox": driver.rt.id, "cmd": "true"},
        )
        assert workers == {"result": [worker.rt.id]}
        assert run["result"]["stdout"] == "aGk=" and run["result"]["exit_code"] == 0
        assert host.execs[0][0] == worker.rt.id
        assert host.execs[0][2]["trajectory"] == driver.rt.id  # its own log, named by its id
        assert other["error"]["type"] == "UnknownSandbox"
    finally:
        await drive.close()


# --- the fake itself -------------------------------------------------------------------------
def test_the_fake_host_has_every_member_of_the_host_protocols(tmp_path):
    """The services type their host with these protocols; a member added to one shows up
    here first, before a test of a service fails on it."""
    members = {
        m
        for name in host_protocols.__all__
        if isinstance(proto := getattr(host_protocols, name), type)
        for m in dir(proto)
        if not m.startswith("_")
    }
    fake = FakeHost(tmp_path)
    assert "kill" in members and sorted(m for m in members if not hasattr(fake, m)) == []
