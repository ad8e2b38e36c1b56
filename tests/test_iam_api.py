"""IAM over the apiserver's API (``/v1/iam``), through real ``dsec apiserver`` processes: an
admin key manages its subtree, any key mints keys no wider than itself, every way a key tries
to widen itself is refused with a typed error and leaves the store as it was, the SDK's twins
and ``dsec iam --address`` do the same as the store's direct path, and a revocation through
one apiserver reaches another sharing the store within the 2 s key cache.

The apiservers front one node that does not answer: IAM needs no node, and the tests stay
fast and need no root."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
from click.testing import CliRunner
from openapi_spec_validator import validate as validate_openapi

import dsec
from dsec_core.api.iam import (
    IAM_ROUTES,
    KeyRequest,
    ProjectQuery,
    ProjectRequest,
    QuotaRequest,
    RevokeProjectQuery,
)
from dsec_core.api.openapi import openapi_document
from dsec_core.api.routes import ROUTES
from dsec_core.api.transport import HTTPTransport
from dsec_core.cli.iam import iam as iam_cli
from dsec_core.errors import (
    AuthenticationFailed,
    DsecError,
    InvalidSpec,
    KeyExists,
    PermissionDenied,
    ProjectExists,
    ProjectInUse,
    UnknownKey,
    UnknownProject,
)
from dsec_core.iam import ROLES, Iam, KeyInfo, Project, Quota
from dsec_core.testing.apiserver import ApiserverProcess, start_apiserver
from dsec_core.testing.etcd import etcd_server
from dsec_core.testing.procs import free_port

G = 1 << 30
#: The key cache's bound (``Iam``'s ``cache_ttl``), and what a poll adds to it at most here.
CACHE_TTL = 2.0
POLL = 0.05


@dataclass
class Pair:
    """Two apiservers over one IAM store, and the operator's direct handle on the store."""

    a: ApiserverProcess
    b: ApiserverProcess
    iam: Iam
    url: str
    root: str  # an admin key of the root project, made by the operator

    def client(self, key: str, which: str = "a") -> dsec.Client:
        api = self.a if which == "a" else self.b
        return dsec.Client(api.url, api_key=key, autostart=False, retry=0)

    def org(self) -> str:
        """A fresh org for one test, so the tests share the servers and not their state."""
        return "o" + uuid.uuid4().hex[:10]


def _dead_node() -> list[str]:
    return ["--node", f"n0=http://127.0.0.1:{free_port()}"]


def _pair(url: str) -> Iterator[Pair]:
    iam = Iam.open(url, cache_ttl=0)  # the test's own view: the store as it is now
    a = b = None
    try:
        a = start_apiserver([], url, args=_dead_node())
        b = start_apiserver([], url, args=_dead_node())
        _, root = iam.create_key("/", "admin", f"root-{uuid.uuid4().hex[:6]}")
        yield Pair(a, b, iam, url, root)
    finally:
        for api in (a, b):
            if api is not None:
                api.stop()
                api.log.unlink(missing_ok=True)
        iam.close()


@pytest.fixture(scope="module")
def pair(tmp_path_factory) -> Iterator[Pair]:
    """Two apiservers sharing an SQLite store in one directory."""
    yield from _pair(f"sqlite://{tmp_path_factory.mktemp('iam') / 'iam.db'}")


def _store(iam: Iam) -> dict[str, Any]:
    return {**iam.store.scan("project/"), **iam.store.scan("key")}  # keys and key names


# --- the happy paths -------------------------------------------------------------------------


def test_an_admin_manages_its_subtree_through_the_api(pair):
    org = pair.org()
    with pair.client(pair.root) as root:
        made = root.create_project(org, {"sandboxes": 10, "cpu": 8, "memory": "16G"})
        assert made == pair.iam.project(org)
        assert made.quota == Quota(sandboxes=10, cpu=8.0, memory=16 * G)
        minted = root.create_key(org, "admin", "ops")
        assert isinstance(minted, dsec.MintedKey) and minted.secret.startswith("dsk_")
        assert minted.key.minted_by is None  # an admin's key is the project's, not a delegation
    with pair.client(minted.secret) as admin:
        me = admin.whoami()
        assert (me.key_id, me.project, me.role, me.name) == (minted.key.key_id, org, "admin", "ops")
        team = admin.create_project(f"{org}/team", Quota(sandboxes=4))
        assert isinstance(team, dsec.Project) and team.quota.sandboxes == 4
        assert admin.create_project(f"{org}/team/job").path == f"{org}/team/job"
        assert [p.path for p in admin.projects()] == [org, f"{org}/team", f"{org}/team/job"]
        assert [p.path for p in admin.projects(f"{org}/team")] == [f"{org}/team", f"{org}/team/job"]
        assert admin.project(f"{org}/team") == team
        changed = admin.set_quota(f"{org}/team", {"sandboxes": 6, "cpu": 2})
        assert changed.quota == Quota(sandboxes=6, cpu=2.0)
        assert pair.iam.project(f"{org}/team").quota == changed.quota  # in the store at once

        keys = {role: admin.create_key(f"{org}/team", role) for role in ROLES}
        for role, k in keys.items():
            assert pair.iam.authenticate(k.secret).role == role
            assert k.secret not in json.dumps([i.to_dict() for i in admin.keys()])
        listed = admin.keys(f"{org}/team")
        assert {k.key_id for k in listed} == {k.key.key_id for k in keys.values()}
        assert all(isinstance(k, dsec.KeyInfo) for k in listed)
        gone = admin.revoke_key(keys["member"].key.key_id)
        assert gone.role == "member"
        with pytest.raises(AuthenticationFailed):
            pair.iam.authenticate(keys["member"].secret)

        with pytest.raises(ProjectInUse):
            admin.revoke_project(f"{org}/team")
        revoked = admin.revoke_project(f"{org}/team", force=True)
        assert isinstance(revoked, dsec.ProjectRevocation)
        assert revoked.projects == (f"{org}/team/job", f"{org}/team")
        assert set(revoked.keys) == {k.key.key_id for r, k in keys.items() if r != "member"}
        assert [p.path for p in pair.iam.projects(org)] == [org]


def test_an_agent_mints_a_narrower_key_for_a_sub_agent(pair):
    org = pair.org()
    pair.iam.create_project(org, Quota(sandboxes=4, cpu=4))
    pair.iam.create_project(f"{org}/team", Quota(sandboxes=3))
    _, agent_secret = pair.iam.create_key(f"{org}/team", "agent", ttl=3600)
    with pair.client(agent_secret) as agent:
        me = agent.whoami()
        assert me.role == "agent" and me.expires is not None
        # a sub-agent in its own project, expiring sooner
        sub = agent.create_key(f"{org}/team", "agent", "sub", ttl=60)
        assert sub.key.minted_by == me.key_id and sub.key.expires < me.expires
        # a sub-agent's own project below its own, with a smaller quota
        box = agent.create_project(f"{org}/team/box", {"sandboxes": 1})
        assert box.quota == Quota(sandboxes=1)
        boxed = agent.create_key(f"{org}/team/box", "agent", ttl=60)
        assert [k.key_id for k in agent.keys()] == sorted(
            [sub.key.key_id, boxed.key.key_id],
            key=lambda i: (pair.iam.key(i).project, pair.iam.key(i).created),
        )
        with pair.client(sub.secret) as sub_client:
            assert sub_client.whoami().minted_by == me.key_id
            assert sub_client.keys() == []
            # a sub-agent mints in turn, no wider; its minter sees the whole chain
            subsub = sub_client.create_key(f"{org}/team", "agent", ttl=30)
        assert subsub.key.key_id in {k.key_id for k in agent.keys()}
        agent.revoke_key(sub.key.key_id)  # and what it minted with it
        for secret in (sub.secret, subsub.secret):
            with pytest.raises(AuthenticationFailed):
                pair.iam.authenticate(secret)
        assert pair.iam.authenticate(boxed.secret).project == f"{org}/team/box"


def test_a_key_expires_and_a_delegation_dies_with_its_minter(pair):
    org = pair.org()
    pair.iam.create_project(org)
    _, member = pair.iam.create_key(org, "member")
    with pair.client(member) as c:
        short = c.create_key(org, "agent", ttl=0.5)
        lasting = c.create_key(org, "agent")
    with pair.client(short.secret) as s:
        assert s.whoami().key_id == short.key.key_id
        time.sleep(0.6)
        with pytest.raises(AuthenticationFailed):
            s.whoami()
    # the member's key revoked by the operator: what it minted stops too (another process)
    pair.iam.revoke_key(pair.iam.authenticate(member).key_id)
    with pair.client(lasting.secret) as lc, pytest.raises(AuthenticationFailed):
        lc.whoami()


def test_the_async_client_has_the_same_methods(pair):
    org = pair.org()
    pair.iam.create_project(org)
    _, admin = pair.iam.create_key(org, "admin")

    async def main() -> tuple[KeyInfo, list[Project], list[KeyInfo], KeyInfo]:
        async with dsec.AsyncClient(pair.a.url, api_key=admin, autostart=False) as c:
            await c.create_project(f"{org}/a", Quota(memory=G))
            minted = await c.create_key(f"{org}/a", "builder", "b1")
            listed = await c.keys(f"{org}/a")
            gone = await c.revoke_key(minted.key.key_id)
            return await c.whoami(), await c.projects(), listed, gone

    me, projects, listed, gone = asyncio.run(main())
    assert me.project == org and me.role == "admin"
    assert [p.path for p in projects] == [org, f"{org}/a"]
    assert [k.name for k in listed] == ["b1"] and gone.name == "b1"
    assert pair.iam.keys(f"{org}/a") == []


# --- the ways a key tries to widen itself ----------------------------------------------------


@pytest.fixture
def tree(pair) -> dict[str, Any]:
    """org (4 sandboxes, 4 CPUs) > org/team (3 sandboxes) > org/team/job; org/lab; a key of
    each role in org/team, an agent there that expires, and what that agent minted."""
    org = pair.org()
    iam = pair.iam
    iam.create_project(org, Quota(sandboxes=4, cpu=4))
    iam.create_project(f"{org}/team", Quota(sandboxes=3))
    iam.create_project(f"{org}/team/job")
    iam.create_project(f"{org}/lab")
    keys = {role: iam.create_key(f"{org}/team", role)[1] for role in ROLES}
    keys["lab-admin"] = iam.create_key(f"{org}/lab", "admin")[1]
    keys["lab-key"] = iam.create_key(f"{org}/lab", "agent", "victim")[1]
    _, keys["short"] = iam.create_key(f"{org}/team", "agent", ttl=600)
    with pair.client(keys["short"]) as c:
        keys["sub"] = c.create_key(f"{org}/team", "agent", ttl=300).secret
    return {
        "org": org,
        "keys": keys,
        "ids": {k: iam.authenticate(v).key_id for k, v in keys.items()},
    }


def _attempts(org: str, ids: dict[str, str]) -> list[tuple[str, str, str, dict[str, Any], type]]:
    """(who, route, what it tries, its arguments, the error it must get)."""
    team, lab = f"{org}/team", f"{org}/lab"
    mint = "create_key"
    return [
        ("agent", mint, "an admin key", {"body": KeyRequest(team, "admin")}, PermissionDenied),
        ("agent", mint, "a member key", {"body": KeyRequest(team, "member")}, PermissionDenied),
        ("agent", mint, "a builder key", {"body": KeyRequest(team, "builder")}, PermissionDenied),
        ("agent", mint, "another project's", {"body": KeyRequest(lab, "agent")}, PermissionDenied),
        ("agent", mint, "its parent's", {"body": KeyRequest(org, "agent")}, PermissionDenied),
        ("agent", mint, "the root's", {"body": KeyRequest("/", "agent")}, PermissionDenied),
        (
            "agent",
            "create_project",
            "a sub-agent's project with a larger quota",
            {"body": ProjectRequest(f"{team}/big", Quota(sandboxes=4))},
            PermissionDenied,
        ),
        (
            "agent",
            "create_project",
            "a larger CPU quota than its org's",
            {"body": ProjectRequest(f"{team}/big", Quota(cpu=5))},
            PermissionDenied,
        ),
        (
            "agent",
            "create_project",
            "a project beside its own",
            {"body": ProjectRequest(f"{org}/beside", Quota())},
            PermissionDenied,
        ),
        (
            "short",
            mint,
            "a key that never expires",
            {"body": KeyRequest(team, "agent")},
            PermissionDenied,
        ),
        (
            "short",
            mint,
            "a key outliving it",
            {"body": KeyRequest(team, "agent", ttl=3600)},
            PermissionDenied,
        ),
        (
            "sub",
            mint,
            "wider again: a member key",
            {"body": KeyRequest(team, "member")},
            PermissionDenied,
        ),
        (
            "sub",
            mint,
            "wider again: an admin key",
            {"body": KeyRequest(team, "admin")},
            PermissionDenied,
        ),
        (
            "sub",
            mint,
            "wider again: outliving its minter",
            {"body": KeyRequest(team, "agent")},
            PermissionDenied,
        ),
        ("member", mint, "an admin key", {"body": KeyRequest(team, "admin")}, PermissionDenied),
        ("member", mint, "a builder key", {"body": KeyRequest(team, "builder")}, PermissionDenied),
        ("builder", mint, "an admin key", {"body": KeyRequest(team, "admin")}, PermissionDenied),
        (
            "admin",
            mint,
            "a key of its parent",
            {"body": KeyRequest(org, "agent")},
            PermissionDenied,
        ),
        ("admin", mint, "a root admin key", {"body": KeyRequest("/", "admin")}, PermissionDenied),
        (
            "member",
            "set_quota",
            "its own project's quota",
            {"body": QuotaRequest(team, Quota(sandboxes=100))},
            PermissionDenied,
        ),
        (
            "agent",
            "set_quota",
            "its own project's quota",
            {"body": QuotaRequest(team, Quota())},
            PermissionDenied,
        ),
        (
            "admin",
            "set_quota",
            "its parent's quota",
            {"body": QuotaRequest(org, Quota(sandboxes=100))},
            PermissionDenied,
        ),
        (
            "admin",
            "create_project",
            "a project in another's subtree",
            {"body": ProjectRequest(f"{lab}/x", Quota())},
            PermissionDenied,
        ),
        ("admin", "revoke_key", "a key outside its subtree", {"key": ids["lab-key"]}, UnknownKey),
        ("agent", "revoke_key", "a key it did not mint", {"key": ids["member"]}, UnknownKey),
        ("sub", "revoke_key", "its minter", {"key": ids["short"]}, UnknownKey),
        ("lab-admin", "revoke_key", "another team's key", {"key": ids["agent"]}, UnknownKey),
        ("admin", "revoke_project", "its parent", {"query": _rpq(org)}, PermissionDenied),
        ("admin", "revoke_project", "a sibling", {"query": _rpq(lab)}, PermissionDenied),
        (
            "agent",
            "revoke_project",
            "its own project",
            {"query": _rpq(f"{org}/team")},
            PermissionDenied,
        ),
        (
            "member",
            "revoke_project",
            "a project below",
            {"query": _rpq(f"{org}/team/job")},
            PermissionDenied,
        ),
        ("agent", "project", "its parent's quota", {"query": _pq(org)}, UnknownProject),
        ("lab-admin", "project", "another team", {"query": _pq(f"{org}/team")}, UnknownProject),
        # bad input and taken names: typed, never a 500
        ("admin", mint, "a role that is none", {"body": _bad_key(team, "root")}, InvalidSpec),
        ("admin", mint, "a negative ttl", {"body": _bad_key(team, "agent", ttl=-1)}, InvalidSpec),
        ("admin", "create_project", "a bad path", {"body": _bad_project("Team!")}, InvalidSpec),
        (
            "admin",
            "create_project",
            "a taken path",
            {"body": ProjectRequest(f"{org}/team/job")},
            ProjectExists,
        ),
        (
            "admin",
            "revoke_project",
            "one with keys, unforced",
            {"query": _rpq(f"{org}/team")},
            ProjectInUse,
        ),
        ("admin", "revoke_key", "a made-up key", {"key": "0123456789abcdef"}, UnknownKey),
        ("admin", "revoke_key", "a malformed id", {"key": "not-a-key-id"}, UnknownKey),
    ]


def _rpq(path: str) -> RevokeProjectQuery:
    return RevokeProjectQuery(path)


def _pq(path: str) -> ProjectQuery:
    return ProjectQuery(path)


class _Unchecked:
    """A body sent as it is, unchecked by the client: what a hand-made request may carry."""

    def __init__(self, data: dict[str, Any]) -> None:
        self.data = data


def _bad_key(project: str, role: str, ttl: float | None = None) -> _Unchecked:
    return _Unchecked({"project": project, "role": role, "name": None, "ttl": ttl})


def _bad_project(path: str) -> _Unchecked:
    return _Unchecked({"path": path, "quota": {}})


def _send(
    api: ApiserverProcess, secret: str, name: str, body: Any = None, query: Any = None, **params
):
    """Route ``name`` as raw HTTP: its status and JSON answer."""
    route = IAM_ROUTES[name]
    content = None
    if isinstance(body, _Unchecked):
        content = json.dumps(body.data).encode()
    elif body is not None:
        content = route.encode_body(body)
    http = HTTPTransport(api.url, token=secret)
    try:
        r = http.request(
            route.method,
            route.target(params, query),
            body=content,
            content_type=route.body_type,
            timeout=10,
        )
    finally:
        http.close()
    return r.status_code, json.loads(r.content)


def test_every_widening_is_refused_typed_and_changes_nothing(pair, tree):
    org, keys, ids = tree["org"], tree["keys"], tree["ids"]
    before = _store(pair.iam)
    failures = []
    for who, name, what, args, error in _attempts(org, ids):
        status, answer = _send(pair.a, keys[who], name, **args)
        got = answer.get("error", {}).get("type")
        if status != error.http_status or got != error.__name__:
            failures.append(f"{who} {name} ({what}): {status} {answer}")
    assert not failures, "\n".join(failures)
    assert _store(pair.iam) == before
    # the same refusals through the SDK are the typed errors themselves
    with pair.client(keys["agent"]) as agent:
        with pytest.raises(PermissionDenied) as err:
            agent.create_key(f"{org}/team", "admin")
        assert err.value.http_status == 403 and "may not mint admin keys" in str(err.value)
        with pytest.raises(UnknownKey):
            agent.revoke_key(ids["member"])
    with pair.client(keys["member"]) as member, pytest.raises(PermissionDenied):
        member.set_quota(f"{org}/team", {"sandboxes": 100})
    with pair.client(keys["admin"]) as admin:
        with pytest.raises(PermissionDenied):  # not its subtree: refused whatever exists there
            admin.create_key(f"{org}/lab", "agent", "victim")
    assert _store(pair.iam) == before


def test_a_name_taken_in_ones_own_project_is_key_exists(pair):
    org = pair.org()
    pair.iam.create_project(org)
    _, admin = pair.iam.create_key(org, "admin", "first")
    with pair.client(admin) as c, pytest.raises(KeyExists) as err:
        c.create_key(org, "member", "first")
    assert err.value.http_status == 409


def test_a_revoked_key_is_refused_at_once_and_replaying_it_changes_nothing(pair):
    org = pair.org()
    pair.iam.create_project(org)
    _, admin = pair.iam.create_key(org, "admin")
    with pair.client(admin) as c:
        victim = c.create_key(org, "agent")
        with pair.client(victim.secret) as v:
            v.whoami()
            c.revoke_key(victim.key.key_id)
            before = _store(pair.iam)
            for attempt in (
                v.whoami,
                lambda: v.create_key(org, "agent"),
                lambda: v.create_project(f"{org}/x"),
                v.keys,
            ):
                with pytest.raises(AuthenticationFailed) as err:
                    attempt()
                assert err.value.http_status == 401
        with pytest.raises(UnknownKey):  # revoked once is gone
            c.revoke_key(victim.key.key_id)
    assert _store(pair.iam) == before


def test_iam_routes_are_not_the_node_apis():
    """A node has no tenants: IAM's routes are the apiserver's own table, and the SDK's
    methods of both tables never share a name."""
    assert not set(IAM_ROUTES) & set(ROUTES)
    assert all(r.path.startswith("/v1/iam/") for r in IAM_ROUTES.values())


# --- revocation reaches every apiserver --------------------------------------------------------


def _refused_within(pair: Pair, revoke_on: str, check_on: str) -> float:
    """Revoke a key (and the key it minted) through one apiserver while the other holds both
    in its cache; how long until the other refuses both."""
    org = pair.org()
    pair.iam.create_project(org)
    _, admin = pair.iam.create_key(org, "admin")
    _, agent = pair.iam.create_key(org, "agent")
    with pair.client(agent, check_on) as c:
        sub = c.create_key(org, "agent").secret
    with pair.client(agent, check_on) as c1, pair.client(sub, check_on) as c2:
        c1.projects(), c2.projects()  # both cached there now
        with pair.client(admin, revoke_on) as a:
            a.revoke_key(pair.iam.authenticate(agent).key_id)
        t0 = time.monotonic()
        pending = {"agent": c1, "sub": c2}
        while pending:
            for name, c in list(pending.items()):
                try:
                    c.projects()  # only the key's check: whoami reads the store itself
                except AuthenticationFailed:
                    del pending[name]
            assert time.monotonic() - t0 < CACHE_TTL + 2, f"still accepted: {sorted(pending)}"
            if pending:
                time.sleep(POLL)
        return time.monotonic() - t0


def test_revocation_reaches_the_other_apiserver_within_the_key_cache(pair):
    took = _refused_within(pair, "a", "b")
    # the other apiserver had both keys cached a moment before: it refuses them once its
    # cache lapses, not sooner (so this is the cache's bound) and not later
    assert 1.0 < took <= CACHE_TTL + 0.3, took
    # and on the apiserver that revoked it, at once
    assert _refused_within(pair, "a", "a") <= 0.3


def test_revocation_reaches_the_other_apiserver_over_etcd():
    with etcd_server() as etcd:
        pairs = _pair(etcd.url(f"test/{uuid.uuid4().hex}"))
        p = next(pairs)
        try:
            took = _refused_within(p, "b", "a")
            assert 1.0 < took <= CACHE_TTL + 0.3, took
        finally:
            pairs.close()


# --- dsec iam over the API --------------------------------------------------------------------


def test_dsec_iam_over_the_api_prints_what_the_store_path_prints(pair, monkeypatch):
    for var in ("DSEC_ADDRESS", "DSEC_API_KEY", "DSEC_IAM"):
        monkeypatch.delenv(var, raising=False)
    runner = CliRunner()
    org = pair.org()
    pair.iam.create_project(org)
    _, admin = pair.iam.create_key(org, "admin", "cli")
    store = ["--iam", pair.url]
    api = ["--address", pair.a.url, "--api-key", admin]

    def run(where: list[str], *args: str, code: int = 0, env: dict[str, str] | None = None):
        result = runner.invoke(iam_cli, [*where, *args], env=env)
        assert result.exit_code == code, (args, result.output, result.exception)
        return result

    made = json.loads(
        run(api, "project", "create", f"{org}/team", "--sandboxes", "3", "--json").stdout
    )
    assert made["quota"] == {"sandboxes": 3, "cpu": None, "memory": None}
    run(api, "project", "set-quota", f"{org}/team", "--memory", "2G")
    key = json.loads(
        run(
            api,
            "key",
            "create",
            "--project",
            f"{org}/team",
            "--role",
            "agent",
            "--name",
            "bot",
            "--json",
        ).stdout
    )
    assert pair.iam.authenticate(key["secret"]).role == "agent"
    plain = run(api, "key", "create", "--project", f"{org}/team", "--role", "member")
    assert plain.stdout.strip().startswith("dsk_")
    for args in (
        ("project", "ls", org),
        ("project", "ls", org, "--json"),
        ("key", "ls", "--project", org),
        ("key", "ls", "--project", org, "--json"),
    ):
        assert run(api, *args).stdout == run(store, *args).stdout, args
    # the environment names the apiserver and the key as well
    env = {"DSEC_ADDRESS": pair.a.url, "DSEC_API_KEY": key["secret"]}
    who = json.loads(run([], "whoami", "--json", env=env).stdout)
    assert who["key_id"] == key["key"]["key_id"] and who["role"] == "agent"
    # an agent's key is refused what it may not do, as the API refuses it
    refused = run([], "key", "create", "--project", org, "--role", "agent", code=1, env=env)
    assert isinstance(refused.exception, PermissionDenied)
    refused = run([], "project", "set-quota", f"{org}/team", "--sandboxes", "9", code=1, env=env)
    assert isinstance(refused.exception, DsecError)
    run(api, "key", "revoke", key["key"]["key_id"])
    gone = json.loads(run(api, "project", "revoke", f"{org}/team", "--force", "--json").stdout)
    assert gone["projects"] == [f"{org}/team"] and len(gone["keys"]) == 1
    assert run(api, "project", "ls", org).stdout == run(store, "project", "ls", org).stdout
    run(store, "whoami", code=1)  # the store knows no caller
    run(["--address", pair.a.url], "project", "ls", code=2)  # an address without a key


# --- malformed requests --------------------------------------------------------------------

#: (method, target, body) of requests no client of ours would send.
MALFORMED = [
    ("GET", "/v1/iam/projects?under=", None),
    ("GET", "/v1/iam/projects?under=Not%20A%20Path", None),
    ("GET", "/v1/iam/projects?nonsense=1", None),
    ("GET", "/v1/iam/project", None),
    ("GET", "/v1/iam/project?path=%2F..%2Fx", None),
    ("DELETE", "/v1/iam/project?path=x&force=maybe", None),
    ("DELETE", "/v1/iam/project?path=%2F", None),
    ("POST", "/v1/iam/projects", b"[]"),
    ("POST", "/v1/iam/projects", b"{"),
    ("POST", "/v1/iam/projects", b'{"path": 7}'),
    ("POST", "/v1/iam/projects", b'{"path": "x", "quota": {"sandboxes": 1e400}}'),
    ("POST", "/v1/iam/projects", b'{"path": "x", "quota": {"memory": "lots"}}'),
    ("POST", "/v1/iam/projects", b'{"path": "x", "quota": {"cpu": -1}}'),
    ("POST", "/v1/iam/projects", b'{"path": "x", "extra": 1}'),
    ("POST", "/v1/iam/projects", b'{"path": "' + b"a/" * 5000 + b'a"}'),
    ("PUT", "/v1/iam/project/quota", b'{"path": "/", "quota": {}}'),
    ("PUT", "/v1/iam/project/quota", b'{"path": "x"}'),
    ("POST", "/v1/iam/keys", b'{"project": "x", "role": ["admin"]}'),
    ("POST", "/v1/iam/keys", b'{"project": "/", "role": "admin", "ttl": 1e300}'),
    ("POST", "/v1/iam/keys", b'{"project": "/", "role": "admin", "name": "a b"}'),
    ("POST", "/v1/iam/keys", b'{"project": "/", "role": "admin", "ttl": true}'),
    ("POST", "/v1/iam/keys", b"[" * 10000),
    ("DELETE", "/v1/iam/keys/%00", None),
    ("DELETE", "/v1/iam/keys/" + "f" * 5000, None),
]


@pytest.mark.parametrize("method, target, body", MALFORMED, ids=range(len(MALFORMED)))
def test_malformed_requests_are_typed_errors_never_a_500(pair, method, target, body):
    before = _store(pair.iam)
    http = HTTPTransport(pair.a.url, token=pair.root)
    try:
        r = http.request(
            method, target, body=body, content_type="application/json" if body else None, timeout=10
        )
    finally:
        http.close()
    assert 400 <= r.status_code < 500, (r.status_code, r.content[:300])
    assert json.loads(r.content)["error"]["type"]
    assert _store(pair.iam) == before


def test_the_apiservers_openapi_document_has_iams_routes(pair):
    with pair.client(pair.root) as c:
        http = c._http
        doc = json.loads(http.request("GET", "/v1/openapi.json", timeout=10).content)
    validate_openapi(doc)
    assert doc == openapi_document(IAM_ROUTES)
    for route in IAM_ROUTES.values():
        assert doc["paths"][route.path][route.method.lower()]["operationId"] == route.name
