"""IAM: nested projects and inherited quotas, roles, hashed keys, revocation, concurrent
creates, and the ``dsec iam`` CLI, on both stores (SQLite and a real etcd on loopback)."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from click.testing import CliRunner

from dsec_core.cli.iam import iam as iam_cli
from dsec_core.errors import (
    AuthenticationFailed,
    DsecError,
    InvalidSpec,
    KeyExists,
    PermissionDenied,
    ProjectExists,
    ProjectInUse,
    QuotaExceeded,
    UnknownKey,
    UnknownProject,
    error_from_wire,
)
from dsec_core.iam import (
    ROOT,
    EtcdStore,
    Iam,
    KeyInfo,
    Principal,
    Project,
    Quota,
    SqliteStore,
    Usage,
    can_manage,
    can_reach,
)
from dsec_core.testing.etcd import EtcdServer, etcd_server

G = 1 << 30


@pytest.fixture(scope="module")
def etcd() -> Iterator[EtcdServer]:
    with etcd_server() as server:
        yield server


@pytest.fixture(params=["sqlite", "etcd"])
def iam_url(request, tmp_path) -> str:
    """A fresh, empty store: a new SQLite file, or a new prefix in the module's etcd."""
    if request.param == "sqlite":
        return f"sqlite://{tmp_path / 'iam.db'}"
    server: EtcdServer = request.getfixturevalue("etcd")
    return server.url(f"test/{uuid.uuid4().hex}")


@pytest.fixture
def iam(iam_url) -> Iterator[Iam]:
    with Iam.open(iam_url) as opened:
        yield opened


def _tree(iam: Iam) -> None:
    iam.create_project("org", Quota(sandboxes=10, cpu=8, memory=16 * G))
    iam.create_project("org/team", Quota(sandboxes=6))
    iam.create_project("org/team/job", Quota(sandboxes=5, cpu=4))
    iam.create_project("org/team/other")
    iam.create_project("org/lab")


# --- projects and quotas -------------------------------------------------------------------


def test_projects_nest_under_existing_parents(iam):
    _tree(iam)
    assert [p.path for p in iam.projects()] == [
        "org",
        "org/lab",
        "org/team",
        "org/team/job",
        "org/team/other",
    ]
    assert [p.path for p in iam.projects("org/team")] == [
        "org/team",
        "org/team/job",
        "org/team/other",
    ]
    assert iam.project("org/team/job").quota == Quota(sandboxes=5, cpu=4)
    with pytest.raises(UnknownProject) as err:
        iam.create_project("org/nope/job")
    assert err.value.name == "org/nope"
    with pytest.raises(ProjectExists):
        iam.create_project("org/team")
    with pytest.raises(ProjectExists):
        iam.create_project(ROOT)
    with pytest.raises(UnknownProject):
        iam.project("elsewhere")
    assert iam.projects("elsewhere") == []


@pytest.mark.parametrize(
    "bad", ["Org", "org//team", "", "-org", "org/", "/org", "a" * 64, "org team", None, 7]
)
def test_bad_project_names_are_invalid_spec(iam, bad):
    with pytest.raises(InvalidSpec) as err:
        iam.create_project(bad)
    assert err.value.field == "project"
    with pytest.raises(InvalidSpec):
        iam.create_key(bad, "admin")
    assert iam.projects() == []


def test_quota_is_enforced_on_the_project_and_every_ancestor(iam):
    _tree(iam)
    one = Usage(1, 1.0, G)
    # empty: fits everywhere
    iam.check_quota("org/team/job", {}, one)
    # within the job's own quota (5) but over the team's (6, counted over its subtree)
    usage = {"org/team/job": Usage(3, 1.0, G), "org/team/other": Usage(3, 1.0, G)}
    with pytest.raises(QuotaExceeded) as err:
        iam.check_quota("org/team/job", usage, one)
    e = err.value
    assert (e.project, e.resource, e.limit, e.used, e.requested) == (
        "org/team",
        "sandboxes",
        6,
        6,
        1,
    )
    assert e.http_status == 429
    # the job's own quota names the job
    with pytest.raises(QuotaExceeded) as err:
        iam.check_quota("org/team/job", {"org/team/job": Usage(5, 1.0, G)}, one)
    assert err.value.project == "org/team/job"
    # the org's memory bound, filled from a sibling subtree and a revoked project's leftovers
    usage = {"org/lab": Usage(1, 1.0, 10 * G), "org/gone/x": Usage(1, 1.0, 5 * G)}
    with pytest.raises(QuotaExceeded) as err:
        iam.check_quota("org/team/other", usage, Usage(1, 0.5, 2 * G))
    assert (err.value.project, err.value.resource) == ("org", "memory")
    iam.check_quota("org/team/other", usage, Usage(1, 0.5, G))  # exactly at the bound: fits
    # cpu: the job's 4 cores
    with pytest.raises(QuotaExceeded) as err:
        iam.check_quota("org/team/job", {"org/team/job": Usage(1, 3.5, G)}, Usage(1, 1.0, 0))
    assert (err.value.project, err.value.resource, err.value.limit) == ("org/team/job", "cpu", 4)
    # another org's usage never counts
    iam.create_project("org2")
    iam.check_quota("org/lab", {"org2": Usage(100, 100.0, 100 * G)}, one)
    # an unlimited project under no quota at all, and the root
    iam.check_quota("org2", {"org2": Usage(100, 100.0, 100 * G)}, one)
    iam.check_quota(ROOT, {}, one)
    assert iam.usage(2, 1.5, G) == Usage(2, 1.5, G)
    with pytest.raises(QuotaExceeded):
        iam.check_quota("org/team/job", {"org/team/job": iam.usage(5, 1.0, G)}, iam.usage(1))
    # the apiserver may pass what the nodes sent, as plain JSON
    with pytest.raises(QuotaExceeded):
        iam.check_quota("org/team/job", {"org/team/job": {"sandboxes": 5}}, {"sandboxes": 1})
    with pytest.raises(InvalidSpec):
        iam.check_quota("org/team/job", {"org/team/job": {"sandboxes": -5}}, one)
    with pytest.raises(UnknownProject):
        iam.check_quota("org/nope", {}, one)


def test_quota_errors_cross_the_wire_with_their_context(iam):
    iam.create_project("org", Quota(sandboxes=1))
    with pytest.raises(QuotaExceeded) as err:
        iam.check_quota("org", {"org": Usage(1)}, Usage(1))
    back = error_from_wire(json.loads(json.dumps(err.value.to_wire())))
    assert isinstance(back, QuotaExceeded)
    assert (back.project, back.resource, back.limit, back.used) == ("org", "sandboxes", 1, 1)


def test_set_quota_applies_at_once_here_and_within_the_ttl_elsewhere(iam_url):
    with Iam.open(iam_url) as a, Iam.open(iam_url, cache_ttl=0.3) as b:
        a.create_project("org", Quota(sandboxes=2))
        b.check_quota("org", {"org": Usage(1)}, Usage(1))  # b caches the table
        updated = a.set_quota("org", Quota(sandboxes=1))
        assert updated.quota.sandboxes == 1 and a.project("org").quota.sandboxes == 1
        with pytest.raises(QuotaExceeded):
            a.check_quota("org", {"org": Usage(1)}, Usage(1))
        time.sleep(0.35)
        with pytest.raises(QuotaExceeded):
            b.check_quota("org", {"org": Usage(1)}, Usage(1))
        # a project made elsewhere is found even inside the cache window
        a.create_project("org/new", Quota(sandboxes=0))
        with pytest.raises(QuotaExceeded):
            b.check_quota("org/new", {}, Usage(1))
        with pytest.raises(UnknownProject):
            a.set_quota("nope", Quota())
        with pytest.raises(InvalidSpec):
            a.set_quota(ROOT, Quota())


def test_quota_and_usage_records_check_their_fields():
    assert Quota(memory="8G").memory == 8 * G  # type: ignore[arg-type]
    assert Quota.from_dict(Quota(1, 2.5, 3).to_dict()) == Quota(1, 2.5, 3)
    for bad in ({"sandboxes": -1}, {"sandboxes": 1.5}, {"cpu": True}, {"cpu": float("nan")},
                {"memory": "lots"}, {"disk": 1}):  # fmt: skip
        with pytest.raises(InvalidSpec) as err:
            Quota.from_dict(bad)
        assert err.value.field in bad
    with pytest.raises(InvalidSpec):
        Usage(sandboxes=-1)
    assert Usage(1, 1.0, 2) + Usage(2, 0.5, 3) == Usage(3, 1.5, 5)
    p = Project("org/team", Quota(sandboxes=3), 1.0)
    assert Project.from_dict(json.loads(json.dumps(p.to_dict()))) == p
    k = KeyInfo("0123456789abcdef", "org", "agent", "bot", 2.0)
    assert KeyInfo.from_dict(k.to_dict()) == k
    with pytest.raises(InvalidSpec) as err:
        KeyInfo("0123456789abcdef", "org", "root")
    assert err.value.field == "role"


def test_revoking_a_project_with_children_or_keys_needs_force(iam):
    _tree(iam)
    _, secret = iam.create_key("org/team/job", "agent", "bot")
    with pytest.raises(ProjectInUse) as err:
        iam.revoke_project("org/team")
    assert err.value.children == ["org/team/job", "org/team/other"] and len(err.value.keys) == 1
    with pytest.raises(ProjectInUse):
        iam.revoke_project("org/team/job")  # its key
    assert iam.revoke_project("org/lab").projects == ("org/lab",)
    gone = iam.revoke_project("org/team", force=True)
    assert gone.projects == ("org/team/job", "org/team/other", "org/team")
    assert len(gone.keys) == 1
    assert [p.path for p in iam.projects()] == ["org"]
    assert iam.keys() == []
    with pytest.raises(AuthenticationFailed):
        iam.authenticate(secret)
    # the name is free again, and a new key of the same name works
    iam.create_project("org/team")
    iam.create_project("org/team/job")
    _, again = iam.create_key("org/team/job", "agent", "bot")
    assert iam.authenticate(again).project == "org/team/job"
    with pytest.raises(UnknownProject):
        iam.revoke_project("org/nope")
    with pytest.raises(InvalidSpec):
        iam.revoke_project(ROOT)


# --- keys ----------------------------------------------------------------------------------


def test_keys_authenticate_to_their_project_and_role(iam):
    _tree(iam)
    info, secret = iam.create_key("org/team", "member", "ci")
    assert secret.startswith(f"dsk_{info.key_id}_") and len(secret) == 4 + 16 + 1 + 64
    assert iam.authenticate(secret) == Principal(info.key_id, "org/team", "member")
    assert iam.authenticate(secret) == Principal(info.key_id, "org/team", "member")  # cached
    root, root_secret = iam.create_key(ROOT, "admin")
    assert iam.authenticate(root_secret).project == ROOT
    assert [k.key_id for k in iam.keys()] == [root.key_id, info.key_id]
    assert [k.key_id for k in iam.keys("org")] == [info.key_id]
    assert iam.keys("org/lab") == []
    listed = json.dumps([k.to_dict() for k in iam.keys()])
    assert secret not in listed and "sha256" not in listed
    with pytest.raises(KeyExists):
        iam.create_key("org/team", "agent", "ci")
    iam.create_key("org/lab", "agent", "ci")  # names are per project
    with pytest.raises(UnknownProject):
        iam.create_key("org/nope", "agent")
    with pytest.raises(InvalidSpec) as err:
        iam.create_key("org", "owner")
    assert err.value.field == "role"
    with pytest.raises(InvalidSpec) as err:
        iam.create_key("org", "agent", "no spaces")
    assert err.value.field == "name"


def test_wrong_malformed_and_revoked_keys_fail_alike(iam):
    iam.create_project("org")
    info, secret = iam.create_key("org", "admin")
    other_id = "0" * 16
    wrong_secret = secret[:-1] + ("0" if secret[-1] != "0" else "1")
    bad = [
        None,
        "",
        "garbage",
        "dsk_",
        secret.upper(),
        secret + "0",
        f"Bearer {secret}",
        wrong_secret,  # right id, wrong secret
        f"dsk_{other_id}_{secret[-64:]}",  # unknown id
    ]
    messages = set()
    for candidate in bad:
        with pytest.raises(AuthenticationFailed) as err:
            iam.authenticate(candidate)
        assert err.value.http_status == 401 and err.value.context == {}
        messages.add(str(err.value))
    assert len(messages) == 1
    iam.authenticate(secret)  # now cached: a wrong secret for the cached id still fails
    with pytest.raises(AuthenticationFailed):
        iam.authenticate(wrong_secret)
    assert iam.revoke_key(info.key_id) == info
    with pytest.raises(AuthenticationFailed) as err:
        iam.authenticate(secret)
    assert str(err.value) in messages
    with pytest.raises(UnknownKey):
        iam.revoke_key(info.key_id)
    with pytest.raises(UnknownKey):
        iam.revoke_key("../../etc")


def test_revocation_reaches_other_instances_within_the_cache_ttl(iam_url):
    with Iam.open(iam_url) as a, Iam.open(iam_url, cache_ttl=0.3) as b:
        a.create_project("org")
        info, secret = a.create_key("org", "member")
        assert b.authenticate(secret).key_id == info.key_id  # b caches it
        a.revoke_key(info.key_id)
        with pytest.raises(AuthenticationFailed):
            a.authenticate(secret)
        deadline = time.monotonic() + 0.3 + 0.5
        while time.monotonic() < deadline:
            try:
                b.authenticate(secret)
            except AuthenticationFailed:
                break
            time.sleep(0.05)
        else:
            pytest.fail("a revoked key still authenticated past the cache's ttl")


def test_keys_are_stored_hashed(iam_url, tmp_path):
    with Iam.open(iam_url) as iam:
        iam.create_project("org")
        info, secret = iam.create_key("org", "admin", "ops")
        iam.authenticate(secret)
        stored = iam.store.get(f"key/{info.key_id}")
    assert stored is not None
    assert stored["hash"] == "sha256:" + hashlib.sha256(secret.encode()).hexdigest()
    random_part = secret.rsplit("_", 1)[1]
    raw = b""
    if iam_url.startswith("sqlite://"):
        for f in tmp_path.glob("iam.db*"):  # the database, its WAL and shared memory
            raw += f.read_bytes()
        assert (tmp_path / "iam.db").stat().st_mode & 0o077 == 0
    else:
        store = iam.store
        assert isinstance(store, EtcdStore)
        raw += json.dumps(store.scan("")).encode()
    assert info.key_id.encode() in raw  # the scan did see the key's record
    assert random_part.encode() not in raw and secret.encode() not in raw
    assert bytes.fromhex(random_part) not in raw


# --- authorisation -------------------------------------------------------------------------


REACH = [
    # role, key's project, sandbox's project, reachable
    ("admin", "org/team", "org/team", True),
    ("admin", "org/team", "org/team/job", True),
    ("admin", "org/team", "org/team2", False),
    ("admin", "org/team", "org", False),
    ("admin", "org/team", "other/team", False),
    ("admin", ROOT, "other/team", True),
    ("member", "org/team", "org/team/job/deep", True),
    ("member", "org/team", "org/lab", False),
    ("member", "org/team", "org", False),
    ("agent", "org/team", "org/team", True),
    ("agent", "org/team", "org/team/job", False),
    ("agent", "org/team", "org/lab", False),
    ("agent", "org/team", "org", False),
    ("agent", "org/team", "org/teamx", False),
    ("agent", ROOT, "org", False),
]


@pytest.mark.parametrize(("role", "home", "target", "reachable"), REACH)
def test_can_reach(role, home, target, reachable):
    principal = Principal("0" * 16, home, role)
    assert can_reach(principal, target) is reachable
    assert Iam.can_reach(principal, target) is reachable


def test_only_admins_manage_their_subtree(iam):
    _tree(iam)
    admin = iam.authenticate(iam.create_key("org/team", "admin")[1])
    member = iam.authenticate(iam.create_key("org/team", "member")[1])
    agent = iam.authenticate(iam.create_key("org/team", "agent")[1])
    other_admin = iam.authenticate(iam.create_key("org/lab", "admin")[1])
    assert can_manage(admin, "org/team") and can_manage(admin, "org/team/job/x")
    assert not can_manage(admin, "org") and not can_manage(admin, "org/lab")
    assert not can_manage(member, "org/team") and not can_manage(agent, "org/team")

    made = iam.create_project("org/team/new", actor=admin)
    assert made.path == "org/team/new"
    with pytest.raises(PermissionDenied) as err:
        iam.create_project("org/team/new2", actor=other_admin)
    assert err.value.http_status == 403
    # a key that is no admin's makes projects only below its own (a sub-agent's), with a
    # quota no larger than its own project's (org/team: 6 sandboxes)
    for who in (member, agent):
        with pytest.raises(PermissionDenied):
            iam.create_project("org/team", actor=who)
        with pytest.raises(PermissionDenied) as err:
            iam.create_project("org/team/new2", Quota(sandboxes=7), actor=who)
        assert err.value.context["resource"] == "sandboxes"
    assert iam.create_project("org/team/sub", Quota(sandboxes=6), actor=agent).path
    with pytest.raises(PermissionDenied):
        iam.create_project("org2", actor=admin)
    with pytest.raises(PermissionDenied):
        iam.require_manage(member, "org/team")
    iam.require_manage(admin, "org/team/job")

    key, _ = iam.create_key("org/team/job", "agent", actor=admin)
    with pytest.raises(PermissionDenied):
        iam.create_key("org/team/job", "admin", actor=agent)
    with pytest.raises(PermissionDenied):
        iam.set_quota("org/team", Quota(sandboxes=1), actor=member)
    # another org's admin cannot tell the key exists
    with pytest.raises(UnknownKey):
        iam.revoke_key(key.key_id, actor=other_admin)
    assert key.key_id not in {k.key_id for k in iam.keys(actor=other_admin)}
    assert key.key_id in {k.key_id for k in iam.keys(actor=admin)}
    assert iam.keys(actor=member) == []
    assert [p.path for p in iam.projects(actor=other_admin)] == ["org/lab"]
    assert [p.path for p in iam.projects("org/team/job", actor=admin)] == ["org/team/job"]
    assert iam.projects("org/team", actor=other_admin) == []
    with pytest.raises(PermissionDenied):
        iam.revoke_project("org/team", force=True, actor=other_admin)
    assert iam.revoke_key(key.key_id, actor=admin).key_id == key.key_id
    assert iam.revoke_project("org/team/new", actor=admin).projects == ("org/team/new",)


# --- several writers -------------------------------------------------------------------------


def _race(n: int, attempt) -> list[object]:
    """Run ``attempt(i)`` in ``n`` threads released together; each one's result or error."""
    barrier = threading.Barrier(n)
    results: list[object] = [None] * n

    def run(i: int) -> None:
        barrier.wait()
        try:
            results[i] = attempt(i)
        except DsecError as e:
            results[i] = e

    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results


def test_instances_share_state_and_a_create_race_has_one_winner(iam_url):
    n = 8
    instances = [Iam.open(iam_url) for _ in range(n)]
    try:
        instances[0].create_project("org")
        # each sees the others' writes
        instances[1].create_project("org/team")
        assert [p.path for p in instances[2].projects()] == ["org", "org/team"]
        info, secret = instances[3].create_key("org/team", "member")
        assert instances[4].authenticate(secret).key_id == info.key_id

        made = _race(n, lambda i: instances[i].create_project("org/race"))
        assert sum(isinstance(r, Project) for r in made) == 1
        assert all(isinstance(r, (Project, ProjectExists)) for r in made), made

        keys = _race(n, lambda i: instances[i].create_key("org/race", "agent", "worker"))
        winners = [r for r in keys if isinstance(r, tuple)]
        assert len(winners) == 1
        assert all(isinstance(r, (tuple, KeyExists)) for r in keys), keys
        assert [k.name for k in instances[5].keys("org/race")] == ["worker"]
        assert instances[6].authenticate(winners[0][1]).project == "org/race"
    finally:
        for one in instances:
            one.close()


# --- opening stores ------------------------------------------------------------------------


def test_open_picks_the_store_from_the_url_or_environment(tmp_path, monkeypatch):
    monkeypatch.delenv("DSEC_IAM", raising=False)
    monkeypatch.setenv("DSEC_HOME", str(tmp_path / "home"))
    with Iam.open() as default:
        assert isinstance(default.store, SqliteStore)
        assert default.store.path == tmp_path / "home" / "iam.db"
    monkeypatch.setenv("DSEC_IAM", f"sqlite://{tmp_path / 'other.db'}")
    with Iam.open() as from_env:
        assert from_env.store.url == f"sqlite://{tmp_path / 'other.db'}"
    with Iam.open("etcd://127.0.0.1:9/some/prefix") as etcd:  # no connection until used
        assert isinstance(etcd.store, EtcdStore) and etcd.store.prefix == "some/prefix/"
    for bad in ("sqlite://relative.db", "mysql://x", "etcd://", "iam.db"):
        with pytest.raises(InvalidSpec) as err:
            Iam.open(bad)
        assert err.value.field == "iam"


# --- the CLI -------------------------------------------------------------------------------


def test_cli_round_trip(tmp_path):
    runner = CliRunner()
    env = {"DSEC_IAM": f"sqlite://{tmp_path / 'iam.db'}"}

    def run(*args: str, code: int = 0):
        result = runner.invoke(iam_cli, list(args), env=env)
        assert result.exit_code == code, (args, result.output, result.exception)
        return result

    run("project", "create", "org", "--sandboxes", "4", "--cpu", "2", "--memory", "8G")
    made = json.loads(run("project", "create", "org/team", "--json").stdout)
    assert made["path"] == "org/team" and made["quota"]["sandboxes"] is None
    listed = json.loads(run("project", "ls", "--json").stdout)
    assert listed[0]["quota"] == {"sandboxes": 4, "cpu": 2.0, "memory": 8 * G}
    assert "org/team" in run("project", "ls").stdout

    changed = json.loads(
        run("project", "set-quota", "org", "--cpu", "none", "--memory", "4G", "--json").stdout
    )
    assert changed["quota"] == {"sandboxes": 4, "cpu": None, "memory": 4 * G}

    created = json.loads(
        run(
            "key", "create", "--project", "org/team", "--role", "agent", "--name", "b", "--json"
        ).stdout
    )
    secret = created["secret"]
    plain = run("key", "create", "--project", "/", "--role", "admin")
    root_secret = plain.stdout.strip()
    assert root_secret.startswith("dsk_") and "\n" not in root_secret
    with Iam.open(env["DSEC_IAM"]) as check:
        assert check.authenticate(secret).role == "agent"
        assert check.authenticate(root_secret).project == ROOT

    keys_out = run("key", "ls").stdout + run("key", "ls", "--json").stdout
    assert created["key"]["key_id"] in keys_out
    assert secret not in keys_out and root_secret not in keys_out and "sha256" not in keys_out
    only = json.loads(run("key", "ls", "--project", "org/team", "--json").stdout)
    assert [k["key_id"] for k in only] == [created["key"]["key_id"]]

    refused = run("project", "revoke", "org", code=1)
    assert isinstance(refused.exception, ProjectInUse)
    run("key", "revoke", created["key"]["key_id"])
    with Iam.open(env["DSEC_IAM"]) as check, pytest.raises(AuthenticationFailed):
        check.authenticate(secret)
    gone = json.loads(run("project", "revoke", "org", "--force", "--json").stdout)
    assert gone == {"projects": ["org/team", "org"], "keys": []}
    assert json.loads(run("project", "ls", "--json").stdout) == []
    bad = run("project", "create", "Bad", code=1)
    assert isinstance(bad.exception, InvalidSpec) and bad.exception.field == "project"
    run("key", "create", "--project", "org", "--role", "root", code=2)  # click's choice


def test_dsec_iam_is_a_dsec_command(tmp_path):
    env_url = f"sqlite://{tmp_path / 'iam.db'}"

    def dsec(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "dsec_core.cli", "iam", "--iam", env_url, *args],
            capture_output=True,
            text=True,
            timeout=60,
        )

    ok = dsec("project", "create", "org")
    assert ok.returncode == 0, ok.stderr
    bad = dsec("project", "create", "org/Team")
    assert bad.returncode == 1
    assert bad.stderr.startswith("Error: project: 'org/Team' is not a project path")
    assert "Traceback" not in bad.stderr
    assert Path(tmp_path / "iam.db").exists()


RACER = """
import sys
from dsec_core.errors import KeyExists, ProjectExists
from dsec_core.iam import Iam
iam = Iam.open(sys.argv[1])
sys.stdin.readline()  # the go signal: every process is open by then
try:
    iam.create_project("org/race")
    print("project")
except ProjectExists:
    print("exists")
try:
    iam.create_key("org", "agent", "worker")
    print("key")
except KeyExists:
    print("exists")
"""


def test_sqlite_is_safe_for_several_processes(tmp_path):
    url = f"sqlite://{tmp_path / 'iam.db'}"
    with Iam.open(url) as iam:
        iam.create_project("org")
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", RACER, url],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(4)
    ]
    time.sleep(0.5)
    outputs = [p.communicate("go\n", timeout=60) for p in procs]
    assert all(p.returncode == 0 for p in procs), [err for _, err in outputs]
    lines = [line for out, _ in outputs for line in out.split()]
    assert lines.count("project") == 1 and lines.count("key") == 1
    assert lines.count("exists") == 2 * len(procs) - 2
    with Iam.open(url) as iam:
        assert [p.path for p in iam.projects()] == ["org", "org/race"]
        assert [k.name for k in iam.keys()] == ["worker"]
