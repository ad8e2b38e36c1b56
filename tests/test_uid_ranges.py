"""A host uid range of its own for every sandbox: no per-uid kernel limit is shared.

Before, every sandbox ran as host uid 100000, and the kernel's key quota for that uid (200 keys;
runc gives each container a session keyring) stopped creates after 150 to 200 live sandboxes.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from dsec_core.errors import AdmissionRejected, InvalidSpec
from dsec_core.layers.build import build_layer
from dsec_core.layers.store import LayerStore
from dsec_core.linux.mounts import UserNamespaceHandle
from dsec_core.linux.tools import compile_static
from dsec_core.node import idpool
from dsec_core.node.idpool import MAX_HOST_ID, UidPool
from dsec_core.node.node import Node
from dsec_core.records import IdMap, SandboxSpec
from dsec_core.testing import node_home

root_only = pytest.mark.skipif(os.geteuid() != 0, reason="needs root")
KEYS_SOURCE = Path(__file__).with_name("keys_probe.c")
KEYS_ALLOWED = {"seccomp": {"allow": ["add_key", "keyctl"]}}


# --- the pool (pure logic) -----------------------------------------------------------------
def test_pool_hands_out_never_used_ranges_first_then_the_longest_freed():
    pool = UidPool(100000, 10, 4, group=100000)
    a, b, c = (pool.allocate() for _ in range(3))
    assert [m.host_base for m in (a, b, c)] == [100000, 100010, 100020]
    assert all(m.size == 10 and m.group == 100000 for m in (a, b, c))
    pool.release(b)
    pool.release(a)
    assert pool.allocate().host_base == 100030  # never used yet
    assert pool.allocate().host_base == 100010  # freed first
    assert pool.allocate().host_base == 100000
    with pytest.raises(AdmissionRejected) as e:
        pool.allocate()
    assert e.value.reason == "uid-pool" and e.value.pool == "uid"
    assert "DSEC_UID_RANGES" in str(e.value)


def test_pool_ignores_foreign_and_double_releases():
    pool = UidPool(100000, 10, 2, group=100000)
    a = pool.allocate()
    pool.release(IdMap(5000, 10))  # not from this pool
    pool.release(IdMap(100005, 10))  # not a range boundary
    pool.release(a)
    pool.release(a)  # twice: still one free slot more, not two
    assert pool.free() == 2
    pool.allocate()
    pool.allocate()
    with pytest.raises(AdmissionRejected):
        pool.allocate()


def test_pool_adopts_the_ranges_of_live_sandboxes():
    pool = UidPool(100000, 10, 4, group=100000)
    pool.adopt([IdMap(100020, 10, 100000), IdMap(100000, 10)])  # the second as an old record
    assert pool.in_use() == 2
    got = {pool.allocate().host_base, pool.allocate().host_base}
    assert got == {100010, 100030}
    with pytest.raises(AdmissionRejected):
        pool.allocate()


def test_pool_refuses_what_does_not_fit_in_host_ids():
    with pytest.raises(InvalidSpec, match="DSEC_UID_RANGES"):
        UidPool(100000, 65536, 70000, group=100000)
    with pytest.raises(InvalidSpec):
        UidPool(100000, 1, 4, group=100000)
    UidPool(MAX_HOST_ID - 65536 * 2 + 1, 65536, 2, group=100000)  # ends on the last id


def test_gid_zero_maps_to_the_shared_group():
    m = IdMap(300000, 65536, 100000)
    assert m.uid_lines() == [(0, 300000, 65536)]
    assert m.gid_lines() == [(0, 100000, 1), (1, 300001, 65535)]
    assert m.root_gid == 100000
    assert IdMap(100000, 65536).gid_lines() == [(0, 100000, 65536)]  # state of older daemons


# --- a real node -----------------------------------------------------------------------------
def _host_ids(pid: int) -> tuple[int, int]:
    """(real uid, real gid) of host process ``pid``."""
    uid = gid = -1
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("Uid:"):
            uid = int(line.split()[1])
        elif line.startswith("Gid:"):
            gid = int(line.split()[1])
    return uid, gid


@pytest.fixture
def small_pool():
    """An in-process node with a pool of two uid ranges."""
    with node_home("dsec-uids-", uid_ranges=2, uid_size=65536) as config:
        yield config


@root_only
async def test_each_sandbox_runs_as_its_own_range(small_pool):
    node = Node(small_pool)
    await node.open()
    spec = SandboxSpec(layers=("kit-base@1",), memory="64M", cpu=0.2)
    try:
        a = await node.create(spec)
        b = await node.create(spec)
        bases = {}
        for info in (a, b):
            sb = node.sandboxes[info.id]
            bases[info.id] = base = sb.rt.idmap.host_base
            assert _host_ids(info.pid) == (base, small_pool.sandbox_gid)
            r = await node.exec(info.id, "id -u; id -g; stat -c %u:%g /bin/busybox; touch /made")
            assert r.stdout.split() == [b"0", b"0", b"0:0"], r  # root, and the layer is root's
            st = os.stat(small_pool.sandbox_dir / info.id / "upper" / "made")
            assert (st.st_uid, st.st_gid) == (base, small_pool.sandbox_gid)
        first = small_pool.uid_base
        assert sorted(bases.values()) == [first, first + 65536]
        # the pool is empty: a typed refusal naming it, and nothing of the third is left
        before = set(os.listdir(small_pool.runtime_dir))
        with pytest.raises(AdmissionRejected) as e:
            await node.create(spec)
        assert e.value.reason == "uid-pool"
        assert set(os.listdir(small_pool.runtime_dir)) == before
        # a range serves again only once its sandbox is gone
        await node.kill(a.id)
        assert not (small_pool.runtime_dir / a.id).exists()
        assert not (small_pool.sandbox_dir / a.id).exists()
        c = await node.create(spec)
        assert node.sandboxes[c.id].rt.idmap.host_base == bases[a.id]
        # a restarted node takes the ranges of the sandboxes it adopts as in use
        await node.close()
        node = Node(small_pool)
        await node.open()
        assert node.uids.in_use() == 2
        with pytest.raises(AdmissionRejected):
            await node.create(spec)
    finally:
        await node.close(kill_all=True)


# --- many sandboxes, each with keys of its own ---------------------------------------------
@pytest.fixture(scope="module")
def keys_layer(dsec_node, tmp_path_factory):
    """A layer with the keys probe at /usr/local/bin/keys, in the kit node's store."""
    if not shutil.which("gcc"):
        pytest.skip("the keys probe needs gcc (apt-get install gcc libc6-dev)")
    tree = tmp_path_factory.mktemp("keys-layer")
    (tree / "usr" / "local" / "bin").mkdir(parents=True)
    compile_static([KEYS_SOURCE], tree / "usr/local/bin/keys", "the keys probe")
    store = LayerStore(dsec_node.config.layer_dir)
    return build_layer(tree, name="keys-probe", version="1", kind="toolkit", store=store)


@pytest.fixture
def dsec_backend_name():
    return "container"


@root_only
@pytest.mark.slow
def test_500_sandboxes_each_with_a_session_keyring(dsec_sandboxes, dsec_node, keys_layer):
    spec = {
        "layers": (keys_layer.ref, dsec_node.layer.ref),
        "memory": "32M",
        "cpu": 0.05,
        "pids": 64,
        "policies": KEYS_ALLOWED,
    }
    sandboxes = []
    for _ in range(5):
        sandboxes += dsec_sandboxes.create_many(100, **spec)
    assert len(sandboxes) == 500
    uids = {_host_ids(sb.info.pid)[0] for sb in sandboxes}
    assert len(uids) == 500  # 500 ranges, no uid shared
    for i, sb in enumerate(sandboxes):
        r = sb.exec(f"keys session s{i}")
        assert r.exit_code == 0 and int(r.stdout) > 0, r
    # one sandbox spends its whole key quota; another's is untouched
    hog, other = sandboxes[0], sandboxes[1]
    count, err = hog.exec("keys fill").stdout.split()
    assert err == b"EDQUOT" and int(count) > 100, (count, err)
    assert hog.exec("keys add").stdout.strip() == b"EDQUOT"
    assert other.exec("keys add").stdout.strip() == b"ok"
    assert dsec_sandboxes.create(**spec).exec("keys add").stdout.strip() == b"ok"


@pytest.mark.skipif(os.geteuid() != 0, reason="writing a user namespace's maps needs root")
def test_a_ranges_user_namespace_is_made_once_and_kept_for_its_next_sandbox(monkeypatch):
    made: list[UserNamespaceHandle] = []

    def counted(*maps):
        made.append(UserNamespaceHandle(*maps))
        return made[-1]

    monkeypatch.setattr(idpool, "UserNamespaceHandle", counted)
    monkeypatch.setattr(idpool, "KEPT_NAMESPACES", 2)
    pool = UidPool(base=1_000_000_000, size=65536, count=3, group=1_000_000_000)
    try:
        a = pool.allocate()
        pool.warm()  # the next range's, off the create path
        assert len(made) == 1
        ns_a = pool.namespace(a)  # none made ahead for a: made now, and kept
        assert len(made) == 2 and ns_a.fd >= 0
        assert (ns_a.uid_map, ns_a.gid_map) == (a.uid_lines(), a.gid_lines())
        pool.release(a)
        b = pool.allocate()
        assert pool.namespace(b) is made[0]  # the warmed one: no new process
        c = pool.allocate()
        ns_c = pool.namespace(c)
        assert len(made) == 3
        # beyond KEPT_NAMESPACES the least recently used is closed (a's)
        assert ns_a.fd == -1 and made[0].fd >= 0 and ns_c.fd >= 0
        pool.release(b)
        again = pool.allocate()  # a's range, freed longest ago
        assert again == a and pool.namespace(again).fd >= 0 and len(made) == 4
    finally:
        pool.close()
    assert all(ns.fd == -1 for ns in made)
