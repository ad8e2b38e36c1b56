"""Tenants against each other through ``dsec apiserver`` (issue 20): keys of one project try to
read, change, drive, lease, restore from, list and guess another project's objects over two
real node daemons, with only documented interfaces (the node API, the E2B API and envd), as a
hostile tenant would. Each attempt's answer is compared with the answer to the same request
for a made-up name: status and body must be the same once the name is put aside, and nothing
of the victim's may change. The bad-input cases at the end measure the apiserver's memory
around oversized, deeply nested and endless requests.

The victim is project ``corp/victim`` (a member key, a builder key); the attackers are a member
and an agent key of ``evil/team``, a builder key of ``evil/team`` for builds, and an agent key
of ``corp/other`` (the victim's own org)."""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import os
import re
import secrets
import shutil
import socket
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

import dsec
from dsec_core.apiserver import scope_tag
from dsec_core.errors import PermissionDenied, QuotaExceeded
from dsec_core.iam import Iam, Quota
from dsec_core.records import BUILD_LABEL, STAGED_PREFIX
from dsec_core.testing.apiserver import ApiserverProcess, named_nodes, running_apiserver

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root")

VICTIM = "corp/victim"
SECRET = b"the victim's secret"
URL_RE = re.compile(rb"(https?|unix)://")


@dataclass
class Tenants:
    """The cluster, the keys, and the victim's objects."""

    api: ApiserverProcess
    iam: Iam
    layer: str
    keys: dict[str, str]
    nodes: list[str]
    node_clients: list[dsec.Client] = field(default_factory=list)
    victim: dict[str, str] = field(default_factory=dict)

    def http(self, who: str) -> httpx.Client:
        return httpx.Client(
            base_url=self.api.url, headers={"Authorization": f"Bearer {self.keys[who]}"}
        )

    def client(self, who: str) -> dsec.Client:
        return dsec.Client(self.api.url, api_key=self.keys[who])

    def spec(self, **kw: Any) -> dsec.SandboxSpec:
        return dsec.SandboxSpec(**{"layers": (self.layer,), "memory": "64M", "cpu": 0.25, **kw})

    def rss(self) -> int:
        for line in Path(f"/proc/{self.api.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
        raise AssertionError("no VmRSS")


@pytest.fixture(scope="module")
def tenants(tmp_path_factory) -> Iterator[Tenants]:
    iam_url = f"sqlite://{tmp_path_factory.mktemp('iam') / 'iam.db'}"
    iam = Iam.open(iam_url)
    for p in ("corp", VICTIM, "corp/other", "evil", "evil/team"):
        iam.create_project(p)
    keys = {
        "victim": iam.create_key(VICTIM, "member")[1],
        "victim-builder": iam.create_key(VICTIM, "builder")[1],
        "victim-agent": iam.create_key(VICTIM, "agent")[1],
        "member": iam.create_key("evil/team", "member")[1],
        "agent": iam.create_key("evil/team", "agent")[1],
        "builder": iam.create_key("evil/team", "builder")[1],
        "sibling": iam.create_key("corp/other", "agent")[1],
        "admin": iam.create_key("evil", "admin")[1],
    }
    env = {"DSEC_HEADER_TIMEOUT": "2", "DSEC_BODY_TIMEOUT": "2"}
    with named_nodes({"n1": {}, "n2": {}}) as nodes:
        for n in nodes:
            n.node.environment("kitenv")
        with pytest.MonkeyPatch.context() as mp:
            for k, v in env.items():
                mp.setenv(k, v)
            api_cm = running_apiserver(nodes, iam_url)
            api = api_cm.__enter__()
        try:
            t = Tenants(api, iam, nodes[0].node.layer.ref, keys, [n.name for n in nodes])
            t.node_clients = [n.node.client() for n in nodes]  # the operator's, on the node
            _make_victims_objects(t)
            yield t
        finally:
            for client in t.node_clients:
                client.close()
            api_cm.__exit__(None, None, None)
    iam.close()


def _make_victims_objects(t: Tenants) -> None:
    with t.client("victim") as c:
        sb = c.create(t.spec(ttl=900))
        sb.write_file("/root/secret", SECRET)
        t.victim["sandbox"] = sb.id
        r = sb.exec("echo step-zero", trajectory="vtraj")
        assert not r.replayed
        t.victim["trajectory"] = "vtraj"
        snap = sb.pack_diff(name="vsnap")
        t.victim["snapshot"] = snap.ref
        lease = c.lease([sb.id], ttl=600, renew=False)
        t.victim["lease"] = lease.info.id
    with t.client("victim-builder") as c:
        build = c.create(t.spec(ttl=900, labels={BUILD_LABEL: "vbuild"}))
        t.victim["build"] = build.id
        staged = build.pack_diff(name=STAGED_PREFIX + "venv", version="1")
        t.victim["staged"] = staged.ref
    # a memory snapshot name as the victim's project would hold it (VM snapshots are the
    # microvm tests' business; here the name is what is attacked)
    t.victim["memory"] = f"{scope_tag(VICTIM)}-{t.victim['sandbox'][:12]}-1700000000"


def _fake_sid(real: str) -> str:
    return f"{secrets.token_hex(6)}-{real.rsplit('-', 1)[1]}"


def _fake_name(real: str) -> str:
    """A made-up name of the same shape: the same tag and version, another name."""
    name, at, version = real.partition("@")
    head, _, _tail = name.rpartition("-")
    return f"{head}-made{secrets.token_hex(3)}{at}{version}"


def answer(r: httpx.Response, *names: str) -> tuple[int, bytes]:
    """A response as compared: its status and body with the names that were asked about put
    aside, checked to name no node address and nothing of the victim's."""
    body = r.content
    assert not URL_RE.search(body), body[:300]
    assert scope_tag(VICTIM).encode() not in body or any(scope_tag(VICTIM) in n for n in names)
    for i, name in enumerate(names):
        body = body.replace(name.encode(), f"<name{i}>".encode())
    return r.status_code, body


def same_as_made_up(
    r_real: httpx.Response, real: str, r_fake: httpx.Response, fake: str, refused: bool = True
):
    got, expected = answer(r_real, real), answer(r_fake, fake)
    assert got == expected, (got, expected)
    if refused:
        assert got[0] >= 400, got  # refused (envd's "not found" is E2B's 502)
    return got


def _victim_intact(t: Tenants) -> None:
    with t.client("victim") as c:
        sid = t.victim["sandbox"]
        assert c.get(sid).info.state == "running"
        assert c.read_file(sid, "/root/secret") == SECRET
        assert [e.result.stdout for e in c.trajectory("vtraj")] == [b"step-zero\n"]
        assert c.lease_get(t.victim["lease"]).sandboxes == (sid,)


# --- every route of one sandbox, for each attacking key ---------------------------------------

SANDBOX_ROUTES = [
    ("read its info", "GET", "", None),
    ("run a command in it", "POST", "/exec", {"cmd": "cat /root/secret"}),
    ("stream a command's output", "POST", "/exec/stream", {"cmd": "cat /root/secret"}),
    ("read its file", "GET", "/file?path=/root/secret", None),
    ("overwrite its file", "PUT", "/file?path=/root/secret", b"pwned"),
    ("remove its file", "DELETE", "/file?path=/root/secret", None),
    ("list its directory", "GET", "/ls?path=/root", None),
    ("stat its file", "GET", "/stat?path=/root/secret", None),
    ("read its usage", "GET", "/usage", None),
    ("read its infrastructure events", "GET", "/events", None),
    ("read its policies", "GET", "/policies", None),
    ("change its policy live", "PUT", "/policies/landlock", {"settings": {}}),
    ("pause it", "POST", "/pause", None),
    ("resume it", "POST", "/resume", None),
    ("cut its ttl", "PUT", "/ttl", {"ttl": 1}),
    ("open a shell in it", "POST", "/sessions", {}),
    ("list its shells", "GET", "/sessions", None),
    ("run in a guessed shell", "POST", "/sessions/0/exec", {"cmd": "id"}),
    ("pack its disk", "POST", "/pack_diff", {"name": "stolen"}),
    ("snapshot its memory", "POST", "/memory_snapshot", {"name": "stolen"}),
    ("screenshot it", "GET", "/screenshot", None),
    ("type into it", "POST", "/input", {"events": [{"type": "key", "key": "a"}]}),
    ("kill it", "DELETE", "", None),
]


def _send(c: httpx.Client, method: str, path: str, body: Any) -> httpx.Response:
    if body is None:
        return c.request(method, path)
    if isinstance(body, bytes):
        return c.request(method, path, content=body)
    return c.request(method, path, json=body)


@pytest.mark.parametrize("who", ["member", "sibling"])
@pytest.mark.parametrize(
    "what, method, suffix, body", SANDBOX_ROUTES, ids=[r[0] for r in SANDBOX_ROUTES]
)
def test_another_projects_sandbox_is_a_made_up_one(
    request, tenants, who, what, method, suffix, body
):
    request.node.add_marker(pytest.mark.attack(f"{who} key: {what} (another project's sandbox)"))
    real = tenants.victim["sandbox"]
    fake = _fake_sid(real)
    with tenants.http(who) as c:
        r_real = _send(c, method, f"/v1/sandboxes/{real}{suffix}", body)
        r_fake = _send(c, method, f"/v1/sandboxes/{fake}{suffix}", body)
    same_as_made_up(r_real, real, r_fake, fake)
    _victim_intact(tenants)


@pytest.mark.attack("member key of the same project: drive the project's build sandbox")
@pytest.mark.parametrize(
    "what, method, suffix, body", SANDBOX_ROUTES[:8], ids=[r[0] for r in SANDBOX_ROUTES[:8]]
)
def test_a_build_sandbox_is_a_made_up_one_to_runtime_keys(tenants, what, method, suffix, body):
    real = tenants.victim["build"]
    fake = _fake_sid(real)
    with tenants.http("victim") as c:
        r_real = _send(c, method, f"/v1/sandboxes/{real}{suffix}", body)
        r_fake = _send(c, method, f"/v1/sandboxes/{fake}{suffix}", body)
    same_as_made_up(r_real, real, r_fake, fake)


# --- lists and guesses ------------------------------------------------------------------------


@pytest.mark.attack("list another project's sandboxes, layers and builds")
@pytest.mark.parametrize("who", ["member", "agent", "sibling", "builder"])
def test_lists_show_only_the_callers_own(tenants, who):
    with tenants.client(who) as c:
        assert not {tenants.victim["sandbox"], tenants.victim["build"]} & {i.id for i in c.list()}
        refs = {i.ref for i in c.layers()}
        assert tenants.layer in refs  # everyone's layers stay listed
        assert tenants.victim["snapshot"] not in refs and tenants.victim["staged"] not in refs
        assert not any(scope_tag(VICTIM) in r for r in refs)
    # the apiserver's node info counts the caller's sandboxes, not the cluster's
    fresh = f"evil/fresh-{who}"
    tenants.iam.create_project(fresh)
    key = tenants.iam.create_key(fresh, "member")[1]
    with dsec.Client(tenants.api.url, api_key=key) as c:
        assert c.node_info()["sandboxes"] == 0
    with tenants.client("victim") as c:  # the victim's own member: not the build's
        assert tenants.victim["build"] not in {i.id for i in c.list()}
        assert tenants.victim["staged"] not in {i.ref for i in c.layers()}


@pytest.mark.attack("guess sandbox ids: unknown node, path tricks, case")
def test_guessed_ids_all_answer_alike(tenants):
    real = tenants.victim["sandbox"]
    with tenants.http("member") as c:
        for guess in (f"{real[:12]}-nosuchnode", real.upper(), f"{real}x", "x", f"-{real}"):
            r = c.get(f"/v1/sandboxes/{guess}/file", params={"path": "/root/secret"})
            assert r.status_code == 404 and SECRET not in r.content
            assert r.json()["error"]["type"] == "UnknownSandbox"
            assert r.json()["error"]["message"] == f"no sandbox {guess!r}"


# --- objects that are not sandboxes -----------------------------------------------------------


@pytest.mark.attack("create a sandbox that drives another project's sandbox")
@pytest.mark.parametrize("target", ["sandbox", "build"])
def test_drives_names_only_sandboxes_the_caller_reaches(tenants, target):
    who = "member" if target == "sandbox" else "victim"
    real = tenants.victim[target]
    fake = _fake_sid(real)
    spec = tenants.spec(drives=[real]).to_dict()
    with tenants.client(who) as c:
        before = {i.id for i in c.list()}
    with tenants.http(who) as c:
        r_real = c.post("/v1/sandboxes", json={"spec": spec, "count": 1})
        r_fake = c.post("/v1/sandboxes", json={"spec": {**spec, "drives": [fake]}, "count": 1})
    same_as_made_up(r_real, real, r_fake, fake)
    with tenants.client(who) as c:
        assert {i.id for i in c.list()} == before  # nothing was made


@pytest.mark.attack("read, replay and append to another project's trajectory log")
def test_trajectories_live_in_each_projects_namespace(tenants):
    name = tenants.victim["trajectory"]
    scoped_name = f"{scope_tag(VICTIM)}-{name}"
    with tenants.client("member") as c, tenants.http("member") as h:
        for guess in (name, scoped_name):
            assert c.trajectory(guess) == []
            fake = f"made{secrets.token_hex(3)}-{guess}"
            r_real, r_fake = h.get(f"/v1/trajectories/{guess}"), h.get(f"/v1/trajectories/{fake}")
            # an empty log, as for any name nobody logged to
            assert same_as_made_up(r_real, guess, r_fake, fake, refused=False)[0] == 200
            r_real = h.delete(f"/v1/trajectories/{guess}")
            r_fake = h.delete(f"/v1/trajectories/{fake}")
            same_as_made_up(r_real, guess, r_fake, fake)
        with c.create(tenants.spec(ttl=120)) as sb:
            # replay: step 0 of the same name runs here, it is not the victim's answer
            r = sb.exec("echo mine", trajectory=name, step=0)
            assert not r.replayed and r.stdout == b"mine\n"
            # the tag spelled out, and the key spelled with a JSON escape: both still ours
            r = sb.exec("echo tagged", trajectory=scoped_name, step=0)
            assert not r.replayed and r.stdout == b"tagged\n"
            key = "traj\\u0065ctory"  # "trajectory" with one letter escaped
            raw = json.dumps({"cmd": "echo escaped", "step": 1, "KEY": name}).replace("KEY", key)
            e = h.post(
                f"/v1/sandboxes/{sb.id}/exec",
                content=raw.encode(),
                headers={"content-type": "application/json"},
            )
            assert e.status_code == 200 and not e.json()["replayed"], e.text
            # a sandbox whose spec names the victim's log by its tagged name: ours again
            spec = tenants.spec(ttl=60, trajectory=scoped_name)
            with c.create(spec):
                pass
        assert [x.result.stdout for x in c.trajectory(name)] == [b"mine\n", b"escaped\n"]
        c.remove_trajectory(name)
        c.remove_trajectory(scoped_name)
    _victim_intact(tenants)


@pytest.mark.attack("use another project's snapshot layer: create, restore, prefetch")
@pytest.mark.parametrize("who", ["member", "agent", "sibling"])
def test_another_projects_snapshot_is_a_made_up_one(tenants, who):
    real = tenants.victim["snapshot"]
    fake = _fake_name(real)
    spec = tenants.spec(ttl=60).to_dict()
    with tenants.http(who) as c:
        attempts = [
            ("POST", "/v1/sandboxes", lambda ref: {"spec": {**spec, "layers": [ref]}}),
            ("POST", "/v1/restore", lambda ref: {"snapshot": ref, "count": 1}),
        ]
        if who != "agent":  # agent keys may not prefetch at all
            attempts.append(("POST", "/v1/layers/prefetch", lambda ref: {"refs": [ref]}))
        for method, path, body in attempts:
            r_real = c.request(method, path, json=body(real))
            r_fake = c.request(method, path, json=body(fake))
            same_as_made_up(r_real, real, r_fake, fake)
    with tenants.client(who) as c:
        assert not c.list()


@pytest.mark.attack("another project's builder key uses the victim's staged layer")
def test_another_projects_staged_layer_is_a_made_up_one(tenants):
    real = tenants.victim["staged"]
    fake = _fake_name(real)
    spec = tenants.spec(ttl=60).to_dict()
    with tenants.http("builder") as c:
        for method, path, body in (
            ("POST", "/v1/sandboxes", lambda ref: {"spec": {**spec, "layers": [ref]}}),
            ("POST", "/v1/restore", lambda ref: {"snapshot": ref, "count": 1}),
            ("POST", "/v1/layers/prefetch", lambda ref: {"refs": [ref]}),
        ):
            same_as_made_up(
                c.request(method, path, json=body(real)),
                real,
                c.request(method, path, json=body(fake)),
                fake,
            )


@pytest.mark.attack("read, renew and release another project's lease (release with kill)")
@pytest.mark.parametrize("who", ["member", "sibling"])
@pytest.mark.parametrize(
    "method, suffix", [("GET", ""), ("POST", "/renew"), ("DELETE", "?kill=true")]
)
def test_another_projects_lease_is_a_made_up_one(tenants, who, method, suffix):
    real = tenants.victim["lease"]
    fake = _fake_sid(real)
    with tenants.http(who) as c:
        r_real = c.request(method, f"/v1/leases/{real}{suffix}")
        r_fake = c.request(method, f"/v1/leases/{fake}{suffix}")
    same_as_made_up(r_real, real, r_fake, fake)
    _victim_intact(tenants)


@pytest.mark.attack("take a lease on another project's sandbox")
def test_a_lease_on_another_projects_sandbox_is_refused_as_made_up(tenants):
    real = tenants.victim["sandbox"]
    fake = _fake_sid(real)
    with tenants.http("member") as c:
        r_real = c.post("/v1/leases", json={"sandboxes": [real], "ttl": 60})
        r_fake = c.post("/v1/leases", json={"sandboxes": [fake], "ttl": 60})
    same_as_made_up(r_real, real, r_fake, fake)


@pytest.mark.attack("remove and restore another project's memory snapshot by its name")
def test_another_projects_memory_snapshot_is_a_made_up_one(tenants):
    real = tenants.victim["memory"]
    fake = _fake_name(real)
    with tenants.http("member") as c:
        same_as_made_up(
            c.delete(f"/v1/memory-snapshots/{real}"),
            real,
            c.delete(f"/v1/memory-snapshots/{fake}"),
            fake,
        )
        same_as_made_up(
            c.post("/v1/restore", json={"snapshot": real}),
            real,
            c.post("/v1/restore", json={"snapshot": fake}),
            fake,
        )


@pytest.mark.attack("memory snapshots: another project's, a shared one, and the quota")
def test_memory_snapshots_of_vms_are_scoped_and_counted_at_their_own_size(tenants):
    if shutil.which("qemu-system-x86_64") is None:
        pytest.skip("QEMU is not installed")
    vm_spec = tenants.spec(backend="microvm", memory="128M", ttl=300)
    with tenants.client("victim") as v:
        vm = v.create(vm_spec)
        snap = v.snapshot_memory(vm.id, name="vsave")
        v.kill(vm.id)
    real, fake = snap.name, _fake_name(snap.name)
    with tenants.http("member") as c:
        for method, path, body in (
            ("GET", "/v1/memory-snapshots/{}", None),
            ("DELETE", "/v1/memory-snapshots/{}", None),
            ("POST", "/v1/restore", lambda n: {"snapshot": n, "count": 1}),
        ):
            same_as_made_up(
                c.request(method, path.format(real), json=body(real) if body else None),
                real,
                c.request(method, path.format(fake), json=body(fake) if body else None),
                fake,
            )
    # a restore takes the saved VM's size, whatever the request says: the quota counts that
    tenants.iam.create_project("mq", Quota(memory="1000M"))
    key = tenants.iam.create_key("mq", "member")[1]
    with dsec.Client(tenants.api.url, api_key=key) as c:
        own = c.create(vm_spec)
        saved = c.snapshot_memory(own.id, name="mine")
        assert c.memory_snapshot(saved.name).spec["memory"] in ("128M", 128 << 20)
        c.kill(own.id)
        time.sleep(1.2)  # the kill counted by a probe
        with pytest.raises(QuotaExceeded):  # 3 x (128M + QEMU's 256M) > 1000M
            c.restore(saved.name, 3, memory="16M", cpu=0.01)
        (copy,) = c.restore(saved.name, 1, memory="16M")
        try:
            assert copy.info.limits["memory"] == 128 << 20
        finally:
            copy.kill()
            c.remove_memory_snapshot(saved.name)
    with tenants.client("victim") as v:
        v.remove_memory_snapshot(snap.name)


@pytest.mark.attack("remove a memory snapshot every project shares")
def test_a_shared_memory_snapshot_is_the_operators_to_remove(tenants):
    if shutil.which("qemu-system-x86_64") is None:
        pytest.skip("QEMU is not installed")
    node = tenants.node_clients[0]
    vm = node.create(tenants.spec(backend="microvm", memory="128M", ttl=300))
    shared = node.snapshot_memory(vm.id, name="golden").name  # untagged: everyone's
    node.kill(vm.id)
    try:
        with tenants.http("member") as c:
            r = c.delete(f"/v1/memory-snapshots/{shared}")
            assert r.status_code == 403 and "operator" in r.text, r.text
            assert c.get(f"/v1/memory-snapshots/{shared}").status_code == 200  # still there
        root = tenants.iam.create_key("/", "admin")[1]
        with httpx.Client(base_url=tenants.api.url) as c:
            r = c.delete(
                f"/v1/memory-snapshots/{shared}", headers={"Authorization": f"Bearer {root}"}
            )
            assert r.status_code == 200, r.text
    finally:
        with contextlib.suppress(dsec.DsecError):
            node.remove_memory_snapshot(shared)


@pytest.mark.attack("the E2B API and envd on another project's sandbox")
@pytest.mark.parametrize(
    "method, path, body",
    [
        ("GET", "/sandboxes/{sid}", None),
        ("DELETE", "/sandboxes/{sid}", None),
        ("POST", "/sandboxes/{sid}/timeout", {"timeout": 1}),
        ("POST", "/sandboxes/{sid}/pause", None),
        ("POST", "/v2/sandboxes/{sid}/connect", {"timeout": 10}),
        ("GET", "/files?path=/root/secret", None),
        ("GET", "/health", None),
        ("POST", "/filesystem.Filesystem/ListDir", {"path": "/root"}),
    ],
)
def test_e2b_and_envd_answer_another_projects_sandbox_as_made_up(tenants, method, path, body):
    real = tenants.victim["sandbox"]
    fake = _fake_sid(real)
    key = tenants.keys["member"]

    def ask(sid: str) -> httpx.Response:
        headers = {"X-API-KEY": key, "X-Access-Token": key, "E2b-Sandbox-Id": sid}
        with httpx.Client(base_url=tenants.api.url, headers=headers) as c:
            return c.request(method, path.format(sid=sid), json=body)

    got = same_as_made_up(ask(real), real, ask(fake), fake)
    assert SECRET not in got[1]
    _victim_intact(tenants)


@pytest.mark.attack("the E2B process service runs a command in another project's sandbox")
def test_envd_process_start_answers_another_projects_sandbox_as_made_up(tenants):
    real = tenants.victim["sandbox"]
    fake = _fake_sid(real)
    key = tenants.keys["member"]
    message = json.dumps({"process": {"cmd": "/bin/cat", "args": ["/root/secret"]}}).encode()
    framed = bytes([0]) + len(message).to_bytes(4, "big") + message

    def ask(sid: str) -> httpx.Response:
        headers = {
            "X-Access-Token": key,
            "E2b-Sandbox-Id": sid,
            "content-type": "application/connect+json",
        }
        with httpx.Client(base_url=tenants.api.url, headers=headers) as c:
            return c.post("/process.Process/Start", content=framed)

    r_real, r_fake = ask(real), ask(fake)
    assert SECRET not in r_real.content
    assert answer(r_real, real) == answer(r_fake, fake)
    _victim_intact(tenants)


@pytest.mark.attack("a group of the same name in another project")
def test_groups_are_each_projects_own(tenants):
    with tenants.client("victim") as v:
        (mine,) = v.group("rollout-7").create(tenants.spec(ttl=120))
    try:
        with tenants.client("member") as c:
            theirs = c.group("rollout-7")
            assert theirs.members() == []
            assert theirs.pause() == [] and theirs.kill() == 0
        with tenants.client("victim") as v:
            assert [i.id for i in v.group("rollout-7").members()] == [mine.id]
            assert v.get(mine.id).info.state == "running"
    finally:
        with tenants.client("victim") as v:
            v.kill(mine.id)


@pytest.mark.attack("fncall pools shared across projects")
def test_fncall_pools_are_not_shared_across_projects(tenants):
    marker = ".seen-by"  # in the call's working directory, which a reset empties
    ids: dict[str, set[str]] = {}
    for who in ("victim", "member"):
        with tenants.client(who) as c:
            seen = set()
            for _ in range(3):
                r = c.fncall("kitenv", f"hostname; echo {who} >> {marker}; cat {marker}")
                assert r.exit_code == 0, r
                host, *lines = r.stdout.decode().split()
                seen.add(host)
                assert lines == [who], lines  # reset between calls, and only ours
            ids[who] = seen
    assert not ids["victim"] & ids["member"]


@pytest.mark.attack("fncall pools started past the project's quota")
def test_fncall_pool_members_count_against_the_quota(tenants):
    tenants.iam.create_project("fquota", Quota(sandboxes=1))
    key = tenants.iam.create_key("fquota", "member")[1]
    with dsec.Client(tenants.api.url, api_key=key) as c:
        with c.create(tenants.spec(ttl=120)):
            with pytest.raises(QuotaExceeded):  # no room to start a member, none to reuse
                c.fncall("kitenv", "true")
        time.sleep(1.2)  # the kill counted by a probe
        assert c.fncall("kitenv", "echo hi").stdout == b"hi\n"
        with pytest.raises(QuotaExceeded):  # the idle member holds the project's one slot
            c.create(tenants.spec(ttl=60))
        assert c.fncall("kitenv", "echo again").stdout == b"again\n"  # and serves it
        assert not c.list()  # members are nobody's to list or touch


# --- quotas and admission ---------------------------------------------------------------------


@pytest.mark.attack("concurrent restores past the project's quota")
def test_concurrent_restores_hold_the_quota(tenants):
    tenants.iam.create_project("quota", Quota(sandboxes=2))
    key = tenants.iam.create_key("quota", "member")[1]
    with dsec.Client(tenants.api.url, api_key=key) as c:
        with c.create(tenants.spec(ttl=300)) as sb:
            snap = sb.pack_diff(name="q")
        assert not c.list()
        time.sleep(1.2)  # the kill counted by a probe

        def restore(_: int) -> str:
            try:
                c2 = dsec.Client(tenants.api.url, api_key=key)
                try:
                    return c2.restore(snap.ref, 1)[0].id
                finally:
                    c2.close()
            except QuotaExceeded:
                return "quota"

        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            got = list(pool.map(restore, range(8)))
        made = [g for g in got if g != "quota"]
        try:
            assert len(made) == 2, got
            assert len(c.list()) == 2
        finally:
            for sid in made:
                c.kill(sid)


@pytest.mark.attack("a refused batch blocks another project's creates")
def test_a_refused_batch_holds_no_room(tenants):
    # placed (the apiserver cannot know the layer is missing), one per node at 90 of each
    # node's 100 CPUs of room, then refused by both nodes
    spec = tenants.spec(cpu=90.0, layers=("nothere@1",)).to_dict()
    with tenants.http("member") as c:
        r = c.post("/v1/sandboxes", json={"spec": spec, "count": 2})
    assert r.status_code < 300 and not r.json()["sandboxes"], r.text
    assert [e["type"] for e in r.json()["errors"]] == ["UnknownLayer"] * 2
    with tenants.client("victim") as v, v.create(tenants.spec(ttl=60, cpu=20.0)):
        pass  # at once, before any probe: nothing is held for the refused batch


# --- policies by role -------------------------------------------------------------------------


@pytest.mark.attack("agent and member keys loosen the node's default policies")
@pytest.mark.parametrize("who", ["agent", "member"])
@pytest.mark.parametrize(
    "loosen",
    [
        {"policies": {"seccomp": {"enabled": False}}},
        {"policies": {"seccomp": {"best_effort": True}}},
        {"policies": {"seccomp": {"allow": ["unshare"]}}},
        {"policies": {"seccomp": {"userns": True}}},
        {"network": "allowlist", "policies": {"egress": {"allow": ["192.0.2.10/32:443/tcp"]}}},
        {"runtime": "runc"},
    ],
    ids=["seccomp-off", "best-effort", "seccomp-allow", "userns", "network", "runtime"],
)
def test_only_admin_and_builder_keys_loosen_policies(tenants, who, loosen):
    with tenants.client(who) as c:
        with pytest.raises(PermissionDenied, match="only tighten"):
            c.create(tenants.spec(**loosen))
        assert not c.list()


@pytest.mark.attack("an agent key reaches kernel surfaces by turning seccomp off")
def test_seccomp_off_is_refused_and_tightening_is_allowed(tenants):
    with tenants.client("agent") as c:
        with pytest.raises(PermissionDenied):
            c.create(tenants.spec(policies={"seccomp": {"enabled": False}}))
        # tightening stays open: a file policy on top of the default
        with c.create(tenants.spec(ttl=60, policies={"landlock": {"read_only": ["/etc"]}})) as sb:
            assert sb.info.policies.get("seccomp") == "enforced"
            assert sb.info.policies.get("landlock") == "enforced"
            assert sb.exec("echo x > /etc/x").exit_code != 0
    with tenants.client("admin") as c:  # an admin of an org may
        c.create(tenants.spec(ttl=60, policies={"seccomp": {"enabled": False}})).kill()


@pytest.mark.attack("a member key widens a live network policy")
def test_live_policy_changes_that_may_loosen_are_refused(tenants):
    with tenants.client("admin") as admin:
        sb = admin.create(tenants.spec(ttl=120))
    admin.close()
    key = tenants.iam.create_key("evil", "member")[1]
    with httpx.Client(base_url=tenants.api.url, headers={"Authorization": f"Bearer {key}"}) as c:
        r = c.put(
            f"/v1/sandboxes/{sb.id}/policies/egress",
            json={"settings": {"allow": ["192.0.2.10/32:443/tcp"]}},
        )
        assert r.status_code == 403 and "only tighten" in r.text, r.text
    with tenants.client("admin") as admin:
        admin.kill(sb.id)


# --- what a tenant is told --------------------------------------------------------------------


@pytest.mark.attack("read the cluster's metrics with a tenant's key")
def test_metrics_are_the_operators(tenants):
    with tenants.http("member") as c:
        assert c.get("/metrics").status_code == 403
    root = tenants.iam.create_key("/", "admin")[1]
    with httpx.Client(base_url=tenants.api.url) as c:
        assert c.get("/metrics", headers={"Authorization": f"Bearer {root}"}).status_code == 200


@pytest.mark.attack("learn other tenants' load from placement refusals")
def test_placement_refusals_name_no_numbers(tenants):
    with tenants.http("member") as c:
        r = c.post("/v1/sandboxes", json={"spec": tenants.spec(cpu=1000.0).to_dict()})
    assert r.status_code == 429, r.text
    nodes = r.json()["error"]["context"]["nodes"]
    assert set(nodes) == set(tenants.nodes)
    assert all(why == "not enough CPU" for why in nodes.values()), nodes
    assert not re.search(r"\d+\.\d|of \d", r.json()["error"]["message"]), r.text


@pytest.mark.attack("one key checked, another acted as (Bearer and X-API-KEY differ)")
def test_the_key_checked_is_the_key_acted_as(tenants):
    real = tenants.victim["sandbox"]
    headers = {
        "Authorization": f"Bearer {tenants.keys['member']}",
        "X-API-KEY": tenants.keys["victim"],
        "X-Access-Token": tenants.keys["victim"],
        "E2b-Sandbox-Id": real,
    }
    with httpx.Client(base_url=tenants.api.url, headers=headers) as c:
        assert c.get(f"/sandboxes/{real}").status_code == 404
        assert c.get("/files", params={"path": "/root/secret"}).status_code >= 400
        assert real not in c.get("/sandboxes").text


@pytest.mark.attack("labels big enough to slow every tenant's list")
def test_labels_are_bounded(tenants):
    with tenants.http("member") as c:
        many = {f"l{i}": "v" for i in range(129)}
        big = {"x": "v" * (17 << 10)}
        for labels in (many, big):
            spec = {**tenants.spec().to_dict(), "labels": labels}
            r = c.post("/v1/sandboxes", json={"spec": spec})
            assert r.status_code == 422 and "labels" in r.text, r.text


@pytest.mark.attack("learn node addresses and other layers from error bodies")
def test_errors_name_no_node_address_and_list_nothing(tenants):
    with tenants.http("member") as c:
        for r in (
            c.post("/v1/sandboxes", json={"spec": {"layers": ["nothere@1"]}}),
            c.post("/v1/sandboxes", json={"spec": {"environment": "nothere"}}),
            c.get("/v1/sandboxes/abc-n1"),
            c.get(f"/v1/sandboxes/{tenants.victim['sandbox']}"),
            c.post("/v1/restore", json={"snapshot": "nothere@1"}),
        ):
            assert r.status_code in (404, 422), r.text
            answer(r)  # no URL, nothing of the victim's
            # what an error lists is everyone's (the catalog's layers), never another's
            listed = r.json()["error"]["context"].get("known", [])
            assert not [k for k in listed if re.match(r"p[0-9a-f]{10}-", k)], listed


# --- bad input: authentication first, bounded reads -------------------------------------------


def _raw(url: str, data: bytes, read: bool = True, timeout: float = 10.0) -> bytes:
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=timeout) as s:
        try:
            s.sendall(data)
        except (BrokenPipeError, ConnectionResetError):
            pass
        out = b""
        if read:
            try:
                while chunk := s.recv(65536):
                    out += chunk
            except (ConnectionResetError, TimeoutError):
                pass
        return out


#: The apiserver's RSS when the first bad-input case began (the last case compares).
_BEFORE_BAD_INPUT: list[int] = []


class _RssWatch:
    """The apiserver's RSS sampled every 20 ms while a bad-input case runs."""

    def __init__(self, tenants: Tenants) -> None:
        self.t = tenants
        self.samples = [tenants.rss()]
        if not _BEFORE_BAD_INPUT:
            _BEFORE_BAD_INPUT.append(self.samples[0])
        self._stop = False

    def __enter__(self) -> _RssWatch:
        import threading

        def watch() -> None:
            while not self._stop:
                self.samples.append(self.t.rss())
                time.sleep(0.02)

        self._thread = threading.Thread(target=watch, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop = True
        self._thread.join()
        self.samples.append(self.t.rss())

    @property
    def rise(self) -> int:
        return max(self.samples) - self.samples[0]


def _other_tenant_still_served(t: Tenants) -> None:
    with t.client("victim") as c:
        assert c.exec(t.victim["sandbox"], "echo ok").stdout == b"ok\n"


@pytest.mark.attack("E2B create with a wrong key and a 100 MB body")
def test_a_wrong_key_is_refused_before_the_body_is_read(tenants):
    big = b'{"templateID": "base", "metadata": {"x": "' + b"a" * (100 << 20) + b'"}}'
    with _RssWatch(tenants) as w:
        t0 = time.monotonic()
        with httpx.Client(base_url=tenants.api.url) as c:
            r = c.post(
                "/sandboxes",
                content=big,
                headers={"X-API-KEY": "dsk_0000000000000000_" + "0" * 64},
            )
        took = time.monotonic() - t0
    print(f"apiserver RSS {w.samples[0] >> 20} MiB, peak +{w.rise >> 20} MiB, took {took:.2f}s")
    assert r.status_code == 401
    assert w.rise < 16 << 20


@pytest.mark.attack("envd upload with a wrong token: spooled before its 401")
def test_an_envd_upload_with_a_wrong_token_is_not_spooled(tenants, tmp_path):
    import tempfile

    spool = Path(tempfile.gettempdir())
    before = {p.name for p in spool.glob("dsec-e2b-write-*")}
    with _RssWatch(tenants) as w, httpx.Client(base_url=tenants.api.url) as c:
        r = c.post(
            "/files?path=/root/x",
            content=b"\0" * (64 << 20),
            headers={
                "X-Access-Token": "nonsense",
                "E2b-Sandbox-Id": tenants.victim["sandbox"],
                "content-type": "application/octet-stream",
            },
        )
    assert r.status_code == 401
    assert w.rise < 16 << 20
    assert {p.name for p in spool.glob("dsec-e2b-write-*")} == before


@pytest.mark.attack("a 64 MiB request header")
def test_a_huge_header_is_431(tenants):
    head = (
        f"GET /v1/sandboxes HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {tenants.keys['member']}"
        "\r\nX-Big: "
    ).encode()
    with _RssWatch(tenants) as w:
        out = _raw(tenants.api.url, head + b"a" * (64 << 20) + b"\r\n\r\n")
    assert out.startswith(b"HTTP/1.1 431"), out[:200]
    assert b"HeadersTooLarge" in out
    assert w.rise < 16 << 20
    _other_tenant_still_served(tenants)


@pytest.mark.attack("a sender that never finishes its headers")
def test_a_slow_sender_is_cut_off(tenants):
    host, port = tenants.api.url.removeprefix("http://").split(":")
    socks = []
    with _RssWatch(tenants) as w:
        for _ in range(50):
            s = socket.create_connection((host, int(port)), timeout=10)
            s.sendall(b"GET /v1/sandboxes HTTP/1.1\r\nHost: x\r\n")
            socks.append(s)
        _other_tenant_still_served(tenants)  # served meanwhile
        t0 = time.monotonic()
        replies = []
        for s in socks:
            try:
                replies.append(s.recv(4096))
            except (ConnectionResetError, TimeoutError):
                replies.append(b"")
            s.close()
        took = time.monotonic() - t0
    assert took < 8, took  # DSEC_HEADER_TIMEOUT=2 in this apiserver's environment
    assert all(r == b"" or r.startswith(b"HTTP/1.1 408") for r in replies), replies[:3]
    assert w.rise < 16 << 20


@pytest.mark.attack("a JSON body that never ends")
def test_a_stalled_body_is_cut_off(tenants):
    host, port = tenants.api.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=15) as s:
        s.sendall(
            b"POST /v1/sandboxes HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            + f"Authorization: Bearer {tenants.keys['member']}\r\n".encode()
            + b'Content-Length: 1000\r\n\r\n{"spec":'
        )
        t0 = time.monotonic()
        reply = s.recv(4096)
    assert reply.startswith(b"HTTP/1.1 408"), reply[:200]
    assert time.monotonic() - t0 < 8


JSON_ROUTES = [
    ("POST", "/v1/sandboxes"),
    ("POST", "/v1/restore"),
    ("POST", "/v1/leases"),
    ("POST", "/v1/fncall"),
    ("POST", "/v1/judge"),
    ("POST", "/v1/layers/prefetch"),
    ("POST", "/v1/sandboxes/{sid}/exec"),
    ("POST", "/v1/sandboxes/{sid}/exec/stream"),
    ("PUT", "/v1/sandboxes/{sid}/ttl"),
    ("POST", "/v1/sandboxes/{sid}/sessions"),
    ("POST", "/v1/sandboxes/{sid}/pack_diff"),
    ("POST", "/v1/sandboxes/{sid}/memory_snapshot"),
    ("PUT", "/v1/sandboxes/{sid}/policies/landlock"),
    ("POST", "/v1/sandboxes/{sid}/input"),
    ("POST", "/sandboxes"),
    ("POST", "/sandboxes/{sid}/timeout"),
    ("POST", "/v2/sandboxes/{sid}/connect"),
    ("POST", "/filesystem.Filesystem/ListDir"),
]


@pytest.mark.attack("deeply nested JSON bodies on every JSON route")
def test_deeply_nested_bodies_are_422_and_leave_the_node_connection_alone(tenants):
    key = tenants.keys["victim"]
    with tenants.client("victim") as v:
        own = v.create(tenants.spec(ttl=300))
    nested = b'{"spec": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    statuses = {}
    with _RssWatch(tenants) as w:
        headers = {
            "Authorization": f"Bearer {key}",
            "X-API-KEY": key,
            "X-Access-Token": key,
            "E2b-Sandbox-Id": own.id,
            "content-type": "application/json",
        }
        with httpx.Client(base_url=tenants.api.url, headers=headers) as c:
            for method, path in JSON_ROUTES:
                r = c.request(method, path.format(sid=own.id), content=nested)
                statuses[path] = r.status_code
                # another tenant's exec right after: the pooled node connection is whole
                _other_tenant_still_served(tenants)
    own.kill()
    bad = {p: s for p, s in statuses.items() if not 400 <= s < 500}
    assert not bad, bad
    assert statuses["/v1/sandboxes"] == 422
    assert w.rise < 32 << 20


@pytest.mark.attack("a 60 MiB body of separators, to make the apiserver build a huge list")
def test_a_body_of_separators_is_refused_before_it_is_built(tenants):
    body = b'{"cmd": [' + b"0," * (30 << 20) + b"0]}"
    headers = {"content-type": "application/json"}
    with _RssWatch(tenants) as w, tenants.http("victim") as c:
        r = c.post(f"/v1/sandboxes/{tenants.victim['sandbox']}/exec", content=body, headers=headers)
    print(f"apiserver RSS {w.samples[0] >> 20} MiB, peak +{w.rise >> 20} MiB")
    assert r.status_code == 422 and r.json()["error"]["context"]["limit"] == 1 << 20, r.text
    assert w.rise < 160 << 20  # the body as read (within exec's bound), not 7 times it
    _other_tenant_still_served(tenants)


@pytest.mark.attack("names that are no text (lone surrogates) in mapping keys")
def test_mapping_keys_that_are_no_text_are_422(tenants):
    sid = tenants.victim["sandbox"]
    with tenants.http("victim") as c:
        for path, body in (
            (f"/v1/sandboxes/{sid}/exec", '{"cmd": "true", "env": {"\\ud800": "x"}}'),
            (f"/v1/sandboxes/{sid}/sessions", '{"env": {"\\ud800": "x"}}'),
            ("/v1/fncall", '{"environment": "kitenv", "cmd": "true", "env": {"\\ud800": "x"}}'),
            ("/v1/sandboxes", '{"spec": {"layers": ["kit-base@1"], "env": {"\\ud800": "x"}}}'),
        ):
            r = c.post(path, content=body.encode(), headers={"content-type": "application/json"})
            assert r.status_code == 422, (path, r.text)
    _other_tenant_still_served(tenants)


@pytest.mark.attack("bodies over each route's bound")
def test_oversized_bodies_are_413_before_they_are_read(tenants):
    key = tenants.keys["victim"]
    with (
        _RssWatch(tenants) as w,
        httpx.Client(
            base_url=tenants.api.url, headers={"Authorization": f"Bearer {key}", "X-API-KEY": key}
        ) as c,
    ):
        for path in ("/v1/sandboxes", "/v1/leases", "/sandboxes"):
            r = c.post(path, content=b" " * (8 << 20), headers={"content-type": "application/json"})
            assert r.status_code == 413, (path, r.text)
    assert w.rise < 32 << 20


@pytest.mark.attack("a batch of a billion sandboxes to keep the apiserver busy")
def test_a_huge_count_is_refused_at_once(tenants):
    with tenants.http("member") as c:
        t0 = time.monotonic()
        r = c.post("/v1/sandboxes", json={"spec": tenants.spec().to_dict(), "count": 10**9})
        took = time.monotonic() - t0
    assert r.status_code == 429 and r.json()["error"]["context"]["reason"] == "count", r.text
    assert took < 1.0, took
    _other_tenant_still_served(tenants)


@pytest.mark.attack("a file upload cut off half-way, to break the node connection")
def test_an_upload_cut_off_leaves_other_tenants_served(tenants):
    with tenants.client("member") as c:
        own = c.create(tenants.spec(ttl=120))
    host, port = tenants.api.url.removeprefix("http://").split(":")
    for _ in range(3):
        with socket.create_connection((host, int(port)), timeout=10) as s:
            s.sendall(
                f"PUT /v1/sandboxes/{own.id}/file?path=/root/x HTTP/1.1\r\nHost: x\r\n".encode()
                + f"Authorization: Bearer {tenants.keys['member']}\r\n".encode()
                + b"Content-Type: application/octet-stream\r\nContent-Length: 10485760\r\n\r\n"
                + b"x" * (1 << 20)
            )
        _other_tenant_still_served(tenants)  # right after: the node connection is whole
    with tenants.client("member") as c:
        c.kill(own.id)


@pytest.mark.attack("an upload declared larger than the bound")
def test_an_upload_over_the_bound_is_413_before_it_is_read(tenants):
    with tenants.client("member") as c:
        own = c.create(tenants.spec(ttl=120))
    host, port = tenants.api.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as s:
        s.sendall(
            f"PUT /v1/sandboxes/{own.id}/file?path=/root/x HTTP/1.1\r\nHost: x\r\n".encode()
            + f"Authorization: Bearer {tenants.keys['member']}\r\n".encode()
            + b"Content-Type: application/octet-stream\r\n"
            + f"Content-Length: {1 << 45}\r\n\r\n".encode()
        )
        reply = s.recv(4096)
    assert reply.startswith(b"HTTP/1.1 413"), reply[:300]
    with tenants.client("member") as c:
        assert c.exec(own.id, "test -e /root/x").exit_code != 0  # nothing written
        c.kill(own.id)


def test_the_apiserver_keeps_no_memory_of_the_bad_input(tenants):
    """Last: the apiserver's RSS after every bad-input case above, against before them."""
    if not _BEFORE_BAD_INPUT:
        pytest.skip("no bad-input case ran")
    time.sleep(1)
    after = tenants.rss()
    print(
        f"apiserver RSS before the bad-input cases {_BEFORE_BAD_INPUT[0] / 2**20:.1f} MiB, "
        f"after {after / 2**20:.1f} MiB"
    )
    assert after - _BEFORE_BAD_INPUT[0] < 32 << 20
