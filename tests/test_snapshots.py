"""pack_diff snapshots and restores (issue 10, deliverables 1 and 2), on real sandboxes of an
in-process node: what survives a pack, n restored siblings with their own writable layers over
shared layer mounts, chains, excluded paths, and the typed errors of bad input."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import subprocess
import sys
import time

import pytest

import dsec
from dsec_core.catalog.model import Catalog, Environment
from dsec_core.catalog.store import CatalogStore
from dsec_core.errors import (
    InvalidSpec,
    LayerInUse,
    LeakFound,
    MissingParentLayers,
    SandboxNotRunning,
    ToolError,
    UnknownSandbox,
    UnknownSource,
)
from dsec_core.layers.store import LayerStore
from dsec_core.linux.cgroups import freeze, frozen
from dsec_core.linux.mounts import MS_BIND, mount, mounted_under
from dsec_core.node import snapshots
from dsec_core.node.node import Node
from dsec_core.node.snapshots import exclude_paths
from dsec_core.records import LayerInfo, SandboxSpec
from dsec_core.testing import node_home

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root")

BASE = SandboxSpec(layers=("kit-base@1",), memory="128M", disk="64M", ttl=None)

# Changes of every kind over the busybox base layer: new files and directories, a hard link, a
# symlink, modes and owners, a deleted lower file (whiteout), a replaced lower directory
# (opaque), and scratch that pack_diff leaves out.
CHANGES = """
set -e
mkdir -p /data/sub /data/cache
echo hello > /data/f
ln /data/f /data/hl
ln -s f /data/link
chmod 640 /data/f
chown 1234:2345 /data/f
chmod 751 /data/sub
chown 7:8 /data/sub
rm /etc/group
rm -rf /var
mkdir /var
echo only > /var/only
echo secret > /tmp/secret
echo 'history' > /root/.ash_history
echo junk > /data/cache/junk
"""


async def _node(config) -> Node:
    node = Node(config)
    await node.open()
    return node


async def sh(node: Node, sid: str, script: str) -> str:
    r = await node.exec(sid, ["sh", "-c", script], timeout=30)
    assert r.exit_code == 0, (script, r.stderr)
    return r.stdout.decode()


def rootfs(node: Node, sid: str):
    rt = node.sandboxes[sid].rt
    assert rt.rootfs is not None
    return rt.rootfs


async def check_changes(node: Node, sid: str) -> None:
    """``sid`` sees exactly the state ``CHANGES`` left, scratch excluded."""
    out = await sh(
        node,
        sid,
        "cat /data/f; stat -c '%a %u %g %h %i' /data/f /data/hl; stat -c '%a %u %g' /data/sub;"
        "readlink /data/link; ls /var; test ! -e /etc/group && echo no-group;"
        "test -e /etc/passwd && echo passwd; ls -A /tmp | wc -l; test ! -e /root/.ash_history"
        " && echo no-history; test ! -e /data/cache && echo no-cache; stat -c '%u %g' /var/only",
    )
    lines = out.splitlines()
    assert lines[0] == "hello"
    f, hl = lines[1].split(), lines[2].split()
    assert f[:4] == ["640", "1234", "2345", "2"] and f == hl  # one inode, two names
    assert lines[3] == "751 7 8"
    assert lines[4] == "f"
    assert lines[5] == "only"  # /var replaced: the base's /var/tmp is hidden (opaque)
    assert lines[6:] == ["no-group", "passwd", "0", "no-history", "no-cache", "0 0"]
    # an xattr written into the writable layer travels too
    assert os.getxattr(rootfs(node, sid) / "data" / "f", "user.color") == b"blue"


async def test_pack_and_restore_keeps_every_kind_of_change(tmp_path):
    with node_home("dsec-snap-") as config:
        node = await _node(config)
        try:
            a = (await node.create(BASE)).id
            await sh(node, a, CHANGES)
            upper = node.sandboxes[a].rt.data_dir / "upper"
            os.setxattr(upper / "data" / "f", "user.color", b"blue")
            t0 = time.perf_counter()
            snap = await node.pack_diff(a, exclude=["/data/cache"])
            pack_ms = 1e3 * (time.perf_counter() - t0)
            print(f"\npack_diff of a small change: {pack_ms:.1f} ms, {snap.size} bytes")
            assert snap.kind == "snapshot" and snap.parents == ("kit-base@1",)
            base = LayerStore(config.layer_dir).resolve("kit-base@1")
            assert snap.parent_digests == (base.digest,)
            # the source keeps running, thawed
            assert (await sh(node, a, "echo alive")).strip() == "alive"

            kids = [i.id for i in await node.restore(snap.ref, n=3, spec=BASE)]
            assert len(set(kids)) == 3
            for sid in kids:
                await check_changes(node, sid)
                assert node.sandboxes[sid].layers == [snap, base]
            # siblings share each layer's one mount, and each writes to its own upper
            image = node.mounts.path_for(snap.digest)  # the snapshot as mounted, from the host
            assert (image / "data" / "f").is_file() and not (image / ".dsec").exists()
            assert not (image / "tmp").exists()
            counts = node.mounts.refcounts()
            assert counts[snap.digest] == 3 and counts[base.digest] == 4
            uppers = {node.sandboxes[s].rt.data_dir / "upper" for s in kids}
            assert len(uppers) == 3
            await sh(node, kids[0], "echo mine > /data/f; touch /data/new")
            for sid in kids[1:]:
                assert (await sh(node, sid, "cat /data/f; ls /data")).split() == [
                    "hello",
                    "f",
                    "hl",
                    "link",
                    "sub",
                ]
        finally:
            await node.close(kill_all=True)


async def test_a_chain_of_snapshots(tmp_path):
    with node_home("dsec-snap-") as config:
        node = await _node(config)
        try:
            a = (await node.create(BASE)).id
            # /etc/passwd is copied up from the base: the upper's copy carries overlay's
            # trusted.overlay.origin, which then sits in a lower layer and is copied up again
            await sh(node, a, "echo one > /one; echo keep > /gone; chmod 600 /etc/passwd")
            first = await node.pack_diff(a, name="step", version="1")
            b = (await node.restore(first.ref))[0].id  # no spec: the defaults
            await sh(node, b, "echo two > /two; rm /gone; echo changed > /one")
            await sh(node, b, "echo 'x:x:5:5::/:/bin/sh' >> /etc/passwd")
            second = await node.pack_diff(b, name="step", version="2")
            assert second.parents == ("step@1", "kit-base@1")
            c = (await node.restore(second.ref, spec=BASE))[0].id
            out = await sh(node, c, "cat /one /two; test ! -e /gone && echo gone")
            assert out.split() == ["changed", "two", "gone"]
            out = await sh(node, c, "stat -c %a /etc/passwd; tail -n1 /etc/passwd")
            assert out.split() == ["600", "x:x:5:5::/:/bin/sh"]
            assert [i.ref for i in node.sandboxes[c].layers] == ["step@2", "step@1", "kit-base@1"]
        finally:
            await node.close(kill_all=True)


async def test_a_restore_keeps_the_environment_s_env_and_workdir(tmp_path):
    with node_home("dsec-snap-") as config:
        CatalogStore(config.catalog_dir).save(
            Catalog(
                name="snap",
                environments=(
                    Environment(
                        name="snap-env",
                        base="kit-base@1",
                        env={"A": "1", "B": "2"},
                        workdir="/home",
                    ),
                ),
            )
        )
        node = await _node(config)
        try:
            spec = SandboxSpec(environment="snap-env", memory="128M", disk="64M")
            a = (await node.create(spec)).id
            await sh(node, a, "echo here > mark")
            snap = await node.pack_diff(a)
            assert snap.env == ("A=1", "B=2") and snap.workdir == "/home"
            b = (await node.restore(snap.ref))[0].id
            assert (await sh(node, b, "pwd; cat mark; echo $A$B")).split() == [
                "/home",
                "here",
                "12",
            ]
            # the restore's own spec goes on top
            own = SandboxSpec(layers=("x@1",), env={"B": "3"}, workdir="/", memory="128M")
            c = (await node.restore(snap.ref, spec=own))[0].id
            assert (await sh(node, c, "pwd; echo $A$B")).split() == ["/home", "13"]
        finally:
            await node.close(kill_all=True)


async def test_a_snapshot_of_a_sandbox_that_writes_is_consistent(tmp_path):
    with node_home("dsec-snap-") as config:
        node = await _node(config)
        try:
            a = (await node.create(BASE)).id
            # each step writes a whole new file and renames it over the last
            await node.exec(
                a,
                [
                    "sh",
                    "-c",
                    "(i=0; while :; do i=$((i+1)); seq 1 $i > /c.tmp; mv /c.tmp /c; done)"
                    " </dev/null >/dev/null 2>&1 &",
                ],
                background=True,
            )
            await asyncio.sleep(0.3)
            snap = await node.pack_diff(a)
            assert not frozen(f"dsec/{a}")
            before = int((await sh(node, a, "tail -n1 /c")).strip())
            await asyncio.sleep(0.2)
            assert int((await sh(node, a, "tail -n1 /c")).strip()) > before  # still writing
            b = (await node.restore(snap.ref, spec=BASE))[0].id
            lines = (await sh(node, b, "cat /c")).split()
            assert lines == [str(k) for k in range(1, len(lines) + 1)] and lines
        finally:
            await node.close(kill_all=True)


async def test_a_paused_sandbox_packs_and_stays_paused(tmp_path):
    with node_home("dsec-snap-") as config:
        node = await _node(config)
        try:
            a = (await node.create(BASE)).id
            await sh(node, a, "echo at-k > /step")
            await node.pause(a)
            snap = await node.pack_diff(a)
            assert frozen(f"dsec/{a}") and node.sandboxes[a].paused
            await node.resume(a)
            assert await sh(node, a, "cat /step") == "at-k\n"
            b = (await node.restore(snap.ref, spec=BASE))[0].id
            assert await sh(node, b, "cat /step") == "at-k\n"
        finally:
            await node.close(kill_all=True)


async def test_bad_input_is_a_typed_error(tmp_path):
    with node_home("dsec-snap-") as config:
        store = LayerStore(config.layer_dir)
        node = await _node(config)
        try:
            a = (await node.create(BASE)).id
            await node.kill(a)
            with pytest.raises(UnknownSandbox):
                await node.pack_diff(a)
            b = (await node.create(BASE)).id
            node.sandboxes[b].status = "stopping"  # as a kill in progress leaves it
            with pytest.raises(SandboxNotRunning):
                await node.pack_diff(b)
            node.sandboxes[b].status = "running"
            # a snapshot over a layer that then goes away
            base = store.resolve("kit-base@1")
            snap = await node.pack_diff(b)
            await node.kill(b)
            with pytest.raises(LayerInUse) as used:
                store.remove("kit-base@1")
            assert used.value.dependents == [snap.ref]
            store.remove("kit-base@1", force=True)
            with pytest.raises(MissingParentLayers) as e:
                await node.restore(snap.ref, n=2, spec=BASE)
            assert e.value.digests == [base.digest]
            assert base.digest in str(e.value)
            assert not node.sandboxes
        finally:
            await node.close(kill_all=True)


async def test_a_snapshot_in_a_shared_source_restores_on_another_node(tmp_path):
    shared = f"local:{tmp_path / 'shared'}"
    with node_home("dsec-snap-", layer_sources=("local", shared)) as config:
        node = await _node(config)
        try:
            a = (await node.create(BASE)).id
            await sh(node, a, "echo far > /far")
            with pytest.raises(UnknownSource):
                await node.pack_diff(a, source="local:/nowhere")
            snap = await node.pack_diff(a, name="far", version="1", source=shared)
        finally:
            await node.close(kill_all=True)
    # a node whose only source is the shared one: the snapshot and its parent come from it
    with node_home("dsec-snap2-", layer_sources=(shared,)) as config:
        node = await _node(config)
        try:
            b = (await node.restore(snap.ref, spec=BASE))[0].id
            assert (await sh(node, b, "cat /far")).strip() == "far"
            layers = node.sandboxes[b].layers
            assert [i.digest for i in layers] == [snap.digest, *snap.parent_digests]
        finally:
            await node.close(kill_all=True)


async def test_a_node_restores_what_it_packed_whatever_its_sources(tmp_path):
    """Found by the chaos soak: nodes whose sources leave their own store out (a shared store,
    S3, OCI) packed into their own store and could not find it again: every restore of a
    snapshot they had just made was ``UnknownSnapshot``. The own store is asked last."""
    from dsec_core.plugins import open_source
    from dsec_core.sources.transfer import push_layer

    shared = f"local:{tmp_path / 'shared'}"
    with node_home("dsec-snap-", layer_sources=(shared,)) as config:
        push_layer("kit-base@1", open_source(shared), LayerStore(config.layer_dir))
        node = await _node(config)
        try:
            assert node.layer_sources[-1].url == f"local:{config.layer_dir}"
            a = (await node.create(BASE)).id
            await sh(node, a, "echo mine > /mine")
            snap = await node.pack_diff(a)
            forks = await node.restore(snap.ref, 2, spec=BASE)
            for f in forks:
                assert (await sh(node, f.id, "cat /mine")).strip() == "mine"
        finally:
            await node.close(kill_all=True)


async def test_a_kill_during_a_pack_waits_for_it():
    with node_home("dsec-snap-") as config:
        node = await _node(config)
        try:
            a = (await node.create(BASE)).id
            await sh(node, a, "head -c 30000000 /dev/urandom > /big")
            pack = asyncio.create_task(node.pack_diff(a))
            await asyncio.sleep(0)  # the pack starts (and freezes the sandbox) first
            assert node.sandboxes[a].packing is not None
            await node.kill(a)
            info = await pack  # the pack finished before the sandbox went
            assert info.size > 30_000_000
            assert not node.sandboxes
        finally:
            await node.close(kill_all=True)


async def test_a_daemon_that_died_mid_pack_is_followed_by_one_that_recovers():
    with node_home("dsec-snap-") as config:
        node = await _node(config)
        try:
            a = (await node.create(BASE)).id
            rt = node.sandboxes[a].rt
            # what a pack leaves if the daemon dies in mkfs.erofs: a view, a frozen sandbox
            view = config.layer_dir / "tmp" / "pack-dead" / "upper"
            view.mkdir(parents=True)
            mount(os.fspath(rt.data_dir / "upper"), view, "", MS_BIND)
            (rt.dir / "packing").write_text(f"dsec/{a}")
            freeze(f"dsec/{a}")
            await node.close()  # the daemon goes; the sandbox stays
            node = await _node(config)
            assert a in node.sandboxes
            assert not frozen(f"dsec/{a}") and not (rt.dir / "packing").exists()
            assert not mounted_under(config.layer_dir) and not view.parent.exists()
            assert (await sh(node, a, "echo ok")).strip() == "ok"
        finally:
            await node.close(kill_all=True)


async def test_a_failed_pack_thaws_the_sandbox_and_leaves_nothing(monkeypatch):
    with node_home("dsec-snap-") as config:
        node = await _node(config)
        try:
            a = (await node.create(BASE)).id
            await sh(node, a, "echo x > /x")

            def broken(*args, **kw):
                raise ToolError("mkfs.erofs failed", command=["mkfs.erofs"], exit_code=1)

            monkeypatch.setattr(snapshots, "mkfs_erofs", broken)
            with pytest.raises(ToolError):
                await node.pack_diff(a)
            assert not frozen(f"dsec/{a}")
            assert (await sh(node, a, "cat /x")).strip() == "x"
            tmp = config.layer_dir / "tmp"
            assert not mounted_under(config.layer_dir)
            assert not tmp.exists() or not any(tmp.iterdir())
            assert not [i for i in LayerStore(config.layer_dir).list() if i.kind == "snapshot"]
            assert node.sandboxes[a].packing is None
        finally:
            await node.close(kill_all=True)


def test_exclude_paths_are_normalized_and_checked():
    assert exclude_paths(["/a/b/", "c//d"], scrub=False) == (".dsec", "a/b", "c/d")
    assert "tmp" in exclude_paths([], scrub=True)
    for bad in ("/", "../x", "a/../../b", ""):
        with pytest.raises(Exception, match="exclude"):
            exclude_paths([bad], scrub=False)


def test_old_layer_records_still_load():
    old = {"name": "a", "version": "1", "kind": "base", "digest": "sha256:00", "size": 1}
    info = LayerInfo.from_dict(old)
    assert info.parents == () and info.parent_digests == ()
    snap = LayerInfo.from_dict(
        {**old, "kind": "snapshot", "parents": ["a@1"], "parent_digests": ["sha256:00"]}
        | {"env": ["A=1"], "workdir": "/w"}
    )
    assert snap.parents == ("a@1",) and snap.env == ("A=1",)
    assert LayerInfo.from_dict(snap.to_dict()) == snap


# --- over the API -------------------------------------------------------------------------------


def test_pack_and_restore_through_the_sdk(dsec_client, dsec_node):
    spec = dict(layers=(dsec_node.layer.ref,), memory="128M", disk="64M", ttl=600)
    with dsec_client.create(**spec) as sb:
        assert sb.exec(["sh", "-c", "echo step-k > /state; echo s > /tmp/x"]).exit_code == 0
        snap = sb.pack_diff(name="sdk-snap", exclude=["/state-cache"])
        assert isinstance(snap, dsec.LayerInfo) and snap.kind == "snapshot"
        assert snap.parents == (dsec_node.layer.ref,)
    kids = dsec_client.restore(snap, n=2, memory="128M", disk="64M", ttl=600)
    try:
        assert len({k.id for k in kids}) == 2
        for k in kids:
            r = k.exec(["sh", "-c", "cat /state; ls -A /tmp | wc -l"])
            assert r.stdout.split() == [b"step-k", b"0"]
            assert k.info.layers == (snap.ref, dsec_node.layer.ref)
    finally:
        for k in kids:
            k.kill()
    with pytest.raises(dsec.UnknownSandbox):
        dsec_client.pack_diff(kids[0].id)
    with pytest.raises(dsec.InvalidSpec):
        dsec_client.restore(dsec_node.layer.ref)  # not a snapshot
    with pytest.raises(dsec.UnknownLayer):
        dsec_client.restore("no-such-snapshot@1")


def test_pack_and_restore_through_the_cli(dsec_client, dsec_node):
    env = dict(os.environ, DSEC_HOME=os.fspath(dsec_node.home))
    cli = [sys.executable, "-m", "dsec_core.cli", "sandbox"]

    def run(*args: str) -> subprocess.CompletedProcess:
        out = subprocess.run([*cli, *args], env=env, capture_output=True, text=True)
        assert out.returncode == 0, out
        return out

    with dsec_client.create(layers=(dsec_node.layer.ref,), memory="128M", disk="64M") as sb:
        sb.exec(["sh", "-c", "echo cli > /mark"])
        snap = json.loads(run("pack-diff", sb.id, "--name", "cli-snap", "--json").stdout)
    assert snap["kind"] == "snapshot" and snap["parents"] == [dsec_node.layer.ref]
    ref = f"{snap['name']}@{snap['version']}"
    ids = run("restore", ref, "-n", "2", "--memory", "128M", "--disk", "64M").stdout.split()
    try:
        assert len(ids) == 2
        for sid in ids:
            assert dsec_client.get(sid).exec(["cat", "/mark"]).stdout == b"cli\n"
    finally:
        for sid in ids:
            dsec_client.kill(sid)
    bad = subprocess.run([*cli, "restore", "nope@1"], env=env, capture_output=True, text=True)
    assert bad.returncode == 1 and bad.stderr.startswith("Error: ")


# --- builds: scrub and leak scan (issue 13) -------------------------------------------------

# Every kind of leftover a build leaves, for root and for a user, beside a file that must stay.
LEFTOVERS = """
set -e
for h in /root /home/user; do
    mkdir -p $h/.ssh $h/.aws $h/.cache/pip/http $h/.config/git $h/.config/gcloud $h/.docker
    echo ls > $h/.bash_history; echo ls > $h/.ash_history; echo 1+1 > $h/.python_history
    echo KEY > $h/.ssh/id_ed25519; echo 'machine m login l password p' > $h/.netrc
    echo '[default]' > $h/.aws/credentials; echo https://u:t@h > $h/.git-credentials
    echo https://u:t@h > $h/.config/git/credentials; echo tok > $h/.config/gcloud/creds
    echo '{}' > $h/.docker/config.json; echo wheel > $h/.cache/pip/http/w
    echo //r/:_authToken=t > $h/.npmrc; echo '[pypi]' > $h/.pypirc
done
mkdir -p /var/lib/apt/lists /var/cache/apt/archives /.dsec-build /home/user/work
echo list > /var/lib/apt/lists/deb.debian.org_dists; echo deb > /var/cache/apt/archives/a.deb
echo notes > /.dsec-build/notes.md; echo t > /tmp/t; echo vt > /var/tmp/vt
echo keep > /home/user/work/kept.txt; echo keep > /root/kept.txt
"""


async def test_scrub_leaves_out_histories_caches_credentials_and_notes(tmp_path):
    with node_home("dsec-snap-") as config:
        node = await _node(config)
        try:
            env = {"PIP_INDEX_URL": "http://127.0.0.1:9/simple/", "PIP_TRUSTED_HOST": "127.0.0.1"}
            env |= {"GH_TOKEN": "t", "AWS_SECRET_ACCESS_KEY": "k", "https_proxy": "http://p"}
            env |= {"KEEP": "1", "TOKENIZERS_PARALLELISM": "false"}
            a = (await node.create(dataclasses.replace(BASE, env=env))).id
            await sh(node, a, LEFTOVERS)
            snap = await node.pack_diff(a)
            # what the snapshot records of the environment: no mirrors, proxies or tokens
            assert snap.env == ("KEEP=1", "TOKENIZERS_PARALLELISM=false")
            b = (await node.restore(snap.ref, spec=BASE))[0].id
            assert (await sh(node, b, "cat /home/user/work/kept.txt /root/kept.txt")).split() == [
                "keep",
                "keep",
            ]
            # nothing else of the leftovers: every file left is one of the two kept
            out = await sh(
                node,
                b,
                "find /root /home /tmp /var/tmp /var/lib/apt /var/cache /.dsec-build -type f"
                " 2>/dev/null; true",
            )
            assert sorted(out.split()) == ["/home/user/work/kept.txt", "/root/kept.txt"]
            # unscrubbed, they are all there
            raw = await node.pack_diff(a, scrub=False)
            assert {e.partition("=")[0] for e in raw.env} == set(env)
            c = (await node.restore(raw.ref, spec=BASE))[0].id
            out = await sh(node, c, "ls -A /home/user /home/user/.ssh /.dsec-build")
            assert {".netrc", ".git-credentials", "id_ed25519", "notes.md"} <= set(out.split())
        finally:
            await node.close(kill_all=True)


def test_exclude_globs_expand_against_the_layer(tmp_path):
    for p in ("home/a/.ssh", "home/.b/.ssh", "home/c/x", "root/.ssh"):
        (tmp_path / p).mkdir(parents=True)
    (tmp_path / "home" / "f").write_text("a file, not a home")
    os.symlink("/etc", tmp_path / "home" / "l")
    out = snapshots.expand_globs(["tmp", "home/*/.ssh", "home/*", "nothere/*/x"], tmp_path)
    assert out[:3] == ("tmp", "home/.b/.ssh", "home/a/.ssh")  # c has none: not listed
    assert set(out[3:]) == {"home/.b", "home/a", "home/c", "home/f", "home/l"}
    scrub = exclude_paths([], scrub=True)
    assert {"home/*/.ssh", "root/.netrc", "home/*/.aws", ".dsec-build"} <= set(scrub)


def test_secret_needles_are_long_lines_or_the_whole_text():
    hidden = "import pytest\n\ndef test_hidden_answer_is_forty_two():\n    assert f() == 42\n"
    needles = snapshots.secret_needles({"hidden-test": hidden, "answer": "  42\n"})
    assert needles["hidden-test"] == (b"def test_hidden_answer_is_forty_two():",)
    assert needles["answer"] == (b"42",)
    lone = snapshots.secret_needles({"odd": "a lone surrogate \ud800 in a long line"})
    assert lone["odd"] == (
        "a lone surrogate \ud800 in a long line".encode("utf-8", "surrogatepass"),
    )
    for bad in ({"": "x"}, {"l": ""}, {"l": "   \n"}):
        with pytest.raises(InvalidSpec) as e:
            snapshots.secret_needles(bad)
        assert "x" not in str(e.value).replace("text", "")  # never echoes a text


def test_scan_tree_finds_secrets_across_chunks_and_in_symlinks(tmp_path, monkeypatch):
    monkeypatch.setattr(snapshots, "SCAN_CHUNK", 64)
    secret = "the reference solution is sort(xs)[::-1] exactly"  # one line, >= 24
    needles = snapshots.secret_needles({"ref": secret, "other": "never written anywhere, ok"})
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "big").write_bytes(b"x" * 50 + secret.encode() + b"y" * 500)  # spans
    (tmp_path / "clean").write_bytes(b"z" * 1000)
    os.symlink("/" + secret, tmp_path / "link")
    os.symlink("/" + secret, tmp_path / "dirlink")  # dangling: a file name in the walk
    os.symlink("d", tmp_path / "d2")  # to a directory: not followed
    hits = snapshots.scan_tree(tmp_path, needles)
    assert sorted(h["path"] for h in hits) == ["/d/big", "/dirlink", "/link"]
    assert {h["label"] for h in hits} == {"ref"}
    assert len(snapshots.scan_tree(tmp_path, needles, limit=2)) == 2


HIDDEN = """import pytest


def test_hidden_edge_case_with_the_empty_list():
    assert solve([]) == 0
"""


async def test_a_leak_keeps_no_layer_and_names_paths_and_labels_not_the_secret(tmp_path):
    with node_home("dsec-snap-") as config:
        store = LayerStore(config.layer_dir)
        node = await _node(config)
        try:
            a = (await node.create(BASE)).id
            line = HIDDEN.splitlines()[3]
            await sh(
                node,
                a,
                f"mkdir -p /workspace/x/tests /workspace/y; printf '%s' '{HIDDEN}' > "
                "/workspace/x/tests/test_hidden.py; cp /workspace/x/tests/test_hidden.py "
                f"/workspace/y/notes.txt; echo '    {line.strip()}' > /workspace/partial.py;"
                "echo fine > /workspace/ok.py",
            )
            secrets = {"hidden-test": HIDDEN, "reference-solution": "return sum(xs) if xs else 0"}
            before = {i.ref for i in store.list()}
            with pytest.raises(LeakFound) as e:
                await node.pack_diff(a, name="staged-task", version="1", secrets=secrets)
            assert sorted((h["path"], h["label"]) for h in e.value.hits) == [
                ("/workspace/partial.py", "hidden-test"),
                ("/workspace/x/tests/test_hidden.py", "hidden-test"),
                ("/workspace/y/notes.txt", "hidden-test"),
            ]
            msg = str(e.value)
            assert "/workspace/y/notes.txt (hidden-test)" in msg
            for text in (HIDDEN, *HIDDEN.splitlines(), secrets["reference-solution"]):
                if text.strip() and text.strip() not in ("import pytest",):
                    assert text.strip() not in msg
                    assert text.strip() not in json.dumps(e.value.to_wire())
            # no layer, nothing mounted, no scratch, the sandbox thawed and running
            assert {i.ref for i in store.list()} == before
            assert not mounted_under(config.layer_dir)
            tmp = config.layer_dir / "tmp"
            assert not tmp.exists() or not any(tmp.iterdir())
            assert not frozen(f"dsec/{a}") and node.sandboxes[a].packing is None
            # cleaned up, the same pack goes through and the layer is there
            await sh(node, a, "rm -r /workspace/x/tests /workspace/y /workspace/partial.py")
            snap = await node.pack_diff(a, name="staged-task", version="1", secrets=secrets)
            assert store.resolve("staged-task@1").digest == snap.digest
            assert not mounted_under(config.layer_dir)
        finally:
            await node.close(kill_all=True)


async def test_a_secret_in_the_recorded_environment_is_a_leak_too(tmp_path):
    with node_home("dsec-snap-") as config:
        node = await _node(config)
        try:
            line = HIDDEN.splitlines()[3]
            spec = dataclasses.replace(BASE, env={"HINT": line, "OK": "1"})
            a = (await node.create(spec)).id
            with pytest.raises(LeakFound) as e:
                await node.pack_diff(a, secrets={"hidden-test": HIDDEN})
            assert e.value.hits == [{"path": "env:HINT", "label": "hidden-test"}]
            assert line.strip() not in str(e.value)
            assert not [i for i in LayerStore(config.layer_dir).list() if i.kind == "snapshot"]
        finally:
            await node.close(kill_all=True)


def test_a_leak_through_the_sdk_and_the_cli(dsec_client, dsec_node, tmp_path):
    secret = "SELECT answer FROM hidden_table WHERE id = 42"
    (tmp_path / "s.sql").write_text(secret + "\n")
    env = dict(os.environ, DSEC_HOME=os.fspath(dsec_node.home))
    cli = [sys.executable, "-m", "dsec_core.cli", "sandbox"]
    with dsec_client.create(layers=(dsec_node.layer.ref,), memory="128M", disk="64M") as sb:
        sb.write_file("/srv/q.sql", secret.encode())
        with pytest.raises(dsec.LeakFound) as e:
            sb.pack_diff(name="leaky", secrets={"answer": secret})
        assert e.value.hits == [{"path": "/srv/q.sql", "label": "answer"}]
        assert secret not in str(e.value)
        out = subprocess.run(
            [*cli, "pack-diff", sb.id, "--name", "leaky", "--secret", f"answer={tmp_path}/s.sql"],
            env=env,
            capture_output=True,
            text=True,
        )
        assert out.returncode == 1 and "/srv/q.sql (answer)" in out.stderr
        assert secret not in out.stderr + out.stdout
        bad = subprocess.run(
            [*cli, "pack-diff", sb.id, "--secret", "no-equals-sign"],
            env=env,
            capture_output=True,
            text=True,
        )
        assert bad.returncode == 2 and "LABEL=FILE" in bad.stderr
        assert not [i for i in dsec_client.layers() if i.name == "leaky"]
        with pytest.raises(dsec.InvalidSpec):
            sb.pack_diff(secrets={"empty": ""})
