"""``dsec apiserver`` over three real named node daemons (two in the home pool, one in the
overflow pool), as its own process: the SDK works through it as against a node; API keys are
checked and a project cannot see or touch another's sandboxes, not even by guessing ids;
quotas hold down the project tree; placement spreads batches and overflows only what may;
killing and restarting it loses nothing, and two run side by side; a lost node is noticed."""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

import dsec
from dsec_core.api.transport import HTTPTransport
from dsec_core.apiserver import OVERFLOW_LABEL
from dsec_core.errors import (
    AdmissionRejected,
    AuthenticationFailed,
    InvalidSpec,
    NodeLost,
    NotFound,
    PermissionDenied,
    QuotaExceeded,
    UnknownLease,
    UnknownSandbox,
)
from dsec_core.iam import Iam, Quota
from dsec_core.localnode import daemon_pid
from dsec_core.records import PROJECT_LABEL, ExecOutput, ExecResult
from dsec_core.testing.apiserver import named_nodes, running_apiserver, start_apiserver
from dsec_core.testing.etcd import etcd_server
from dsec_core.testing.procs import free_port

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root")

JSON_TYPE = "application/json"


class Cluster:
    def __init__(self, nodes, iam: Iam, iam_url: str, api) -> None:
        self.nodes, self.iam, self.iam_url, self.api = nodes, iam, iam_url, api
        self.layer = nodes[0].node.layer.ref

    def key(self, project: str, role: str = "member") -> str:
        if project not in {p.path for p in self.iam.projects()}:
            parts = project.split("/")
            for i in range(1, len(parts) + 1):
                path = "/".join(parts[:i])
                if path not in {p.path for p in self.iam.projects()}:
                    self.iam.create_project(path)
        return self.iam.create_key(project, role)[1]

    def client(self, key: str, url: str | None = None) -> dsec.Client:
        return dsec.Client(url or self.api.url, api_key=key)

    def spec(self, **kw):
        return dsec.SandboxSpec(**{"layers": (self.layer,), "memory": "64M", "cpu": 0.5, **kw})


@pytest.fixture(scope="module")
def cluster(tmp_path_factory) -> Iterator[Cluster]:
    iam_url = f"sqlite://{tmp_path_factory.mktemp('iam') / 'iam.db'}"
    iam = Iam.open(iam_url)
    spec = {"n1": {}, "n2": {}, "n3": {"dsec.pool": "overflow"}}
    with named_nodes(spec) as nodes, running_apiserver(nodes, iam_url) as api:
        yield Cluster(nodes, iam, iam_url, api)
    iam.close()


def _wait(predicate, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.1)


def test_the_sdk_works_through_the_apiserver(cluster):
    with cluster.client(cluster.key("acme/rl")) as c:
        assert set(c.node_info()["backends"]) >= {"container"}
        with c.create(cluster.spec(labels={"run": "7"})) as sb:
            assert sb.id.rsplit("-", 1)[1] in {"n1", "n2"}  # the home pool
            assert sb.info.labels == {"run": "7", PROJECT_LABEL: "acme/rl"}
            r = sb.exec(["sh", "-c", "echo $X; cat"], env={"X": "hi"}, stdin=b"in")
            assert (r.exit_code, r.stdout) == (0, b"hi\nin")
            items = list(sb.exec_stream("echo a; sleep 1; echo b"))
            assert [i.data for i in items if isinstance(i, ExecOutput)] == [b"a\n", b"b\n"]
            assert isinstance(items[-1], ExecResult)
            big = os.urandom(5 << 20)
            sb.write_file("/tmp/big", big)
            assert sb.read_file("/tmp/big") == big
            assert [e.name for e in sb.list_dir("/tmp")] == ["big"]
            with sb.session() as ses:
                ses.exec("cd /tmp; Y=2")
                assert ses.exec("echo $PWD $Y").stdout == b"/tmp 2\n"
            assert sb.set_ttl(100).expires is not None
            assert sb.id in {i.id for i in c.list()}
        assert sb.id not in {i.id for i in c.list()}


def test_exec_output_streams_through_while_the_command_runs(cluster):
    with cluster.client(cluster.key("acme/stream")) as c, c.create(cluster.spec()) as sb:
        t0 = time.monotonic()
        stream = sb.exec_stream("echo first; sleep 2; echo second")
        first = next(stream)
        assert first.data == b"first\n" and time.monotonic() - t0 < 1.5
        rest = list(stream)
        assert rest[-1].exit_code == 0 and time.monotonic() - t0 >= 2


def _timing(header: str) -> dict[str, float]:
    out = {}
    for part in header.split(","):
        name, _, dur = part.strip().partition(";dur=")
        out[name] = float(dur)
    return out


def test_answers_say_where_their_time_went(cluster):
    """Server-Timing: a create's and an exec's stages through the apiserver, the node's own
    time (its ``total``) as ``upstream`` and the rest of the wait for it as ``hop``; a small
    answer is passed on whole (a Content-Length, not chunks), and the node's answer to the
    same exec directly gives its ``total`` too."""
    t = HTTPTransport(cluster.api.url, token=cluster.key("acme/timing"))
    try:
        spec = json.dumps({"spec": cluster.spec().to_dict()}).encode()
        r = t.request("POST", "/v1/sandboxes", body=spec, content_type="application/json")
        assert r.status_code == 201, r.text
        st = _timing(r.headers["server-timing"])
        assert {"auth", "admit", "place", "node", "upstream", "hop", "relay", "apiserver"} <= set(
            st
        )
        assert st["node"] == pytest.approx(st["upstream"] + st["hop"], abs=0.01)
        own = st["auth"] + st["admit"] + st["place"] + st["relay"]
        assert st["apiserver"] == pytest.approx(own, abs=0.01)
        assert st["total"] >= st["node"] + st["apiserver"] - 0.01
        sid = r.json()["sandboxes"][0]["id"]
        run = json.dumps({"cmd": ["true"]}).encode()
        r = t.request("POST", f"/v1/sandboxes/{sid}/exec", body=run, content_type=JSON_TYPE)
        assert r.status_code == 200 and r.json()["exit_code"] == 0
        assert "transfer-encoding" not in r.headers and r.headers["content-length"].isdigit()
        st = _timing(r.headers["server-timing"])
        assert {"auth", "admit", "node", "upstream", "hop", "relay"} <= set(st)
        assert "place" not in st
        node = next(n for n in cluster.nodes if sid.endswith("-" + n.name))
        direct = HTTPTransport(node.url, token=node.token)
        try:
            d = direct.request(
                "POST", f"/v1/sandboxes/{sid}/exec", body=run, content_type=JSON_TYPE
            )
            assert set(_timing(d.headers["server-timing"])) == {"total"}
        finally:
            direct.close()
        assert t.request("DELETE", f"/v1/sandboxes/{sid}").status_code == 200
    finally:
        t.close()


def test_async_sdk_and_batches_spread_over_the_home_pool(cluster):
    key = cluster.key("acme/batch")

    async def main() -> list[str]:
        async with dsec.AsyncClient(cluster.api.url, api_key=key) as c:
            sbs = await c.create_many(cluster.spec(), n=6)
            try:
                outs = await asyncio.gather(*(sb.exec(["echo", sb.id]) for sb in sbs))
                assert [o.stdout for o in outs] == [f"{sb.id}\n".encode() for sb in sbs]
                return [sb.id for sb in sbs]
            finally:
                await asyncio.gather(*(sb.kill() for sb in sbs))

    ids = asyncio.run(main())
    assert {i.rsplit("-", 1)[1] for i in ids} == {"n1", "n2"}


def test_keys_are_checked(cluster):
    for key in (None, "", "nonsense", "dsk_0000000000000000_" + "0" * 64):
        with dsec.Client(cluster.api.url, api_key=key) as c, pytest.raises(AuthenticationFailed):
            c.list()
    cluster.key("acme")  # the project, whichever test came first
    info, secret = cluster.iam.create_key("acme", "member")
    with cluster.client(secret) as c:
        c.list()
        cluster.iam.revoke_key(info.key_id)
        time.sleep(2.5)  # the apiserver remembers a good key for at most 2 s
        with pytest.raises(AuthenticationFailed):
            c.list()
    # a node's own token is no key
    with dsec.Client(cluster.api.url, api_key=cluster.nodes[0].token) as c:
        with pytest.raises(AuthenticationFailed):
            c.list()


def test_a_project_can_neither_see_nor_touch_another_projects_sandboxes(cluster):
    a = cluster.client(cluster.key("orga/x"))
    b = cluster.client(cluster.key("orgb/y"))
    agent_sibling = cluster.client(cluster.key("orga/z", "agent"))
    with a.create(cluster.spec()) as sb:
        a.write_file(sb.id, "/tmp/secret", b"s3cret")
        for other in (b, agent_sibling):
            assert sb.id not in {i.id for i in other.list()}
            for call in (
                lambda c: c.get(sb.id),
                lambda c: c.exec(sb.id, "true"),
                lambda c: list(c.exec_stream(sb.id, "true")),
                lambda c: c.read_file(sb.id, "/tmp/secret"),
                lambda c: c.write_file(sb.id, "/tmp/secret", b"x"),
                lambda c: c.list_dir(sb.id, "/tmp"),
                lambda c: c.usage(sb.id),
                lambda c: c.set_ttl(sb.id, 1),
                lambda c: c.pause(sb.id),
                lambda c: c.kill(sb.id),
            ):
                with pytest.raises(UnknownSandbox) as e:
                    call(other)
                assert "secret" not in str(e.value)
        # guessed ids: on a real node, on a made-up node, with path tricks; all the same 404
        node = sb.id.rsplit("-", 1)[1]
        for guess in (
            f"{secrets.token_hex(6)}-{node}",
            f"{sb.id[:12]}-nosuchnode",
            "../../v1/sandboxes",
            f"{sb.id}/../x",
            sb.id.upper(),
        ):
            with pytest.raises(NotFound):  # UnknownSandbox, or no such route: a 404 each
                b.exec(guess, "true")
        assert a.read_file(sb.id, "/tmp/secret") == b"s3cret"  # untouched
        # the parent's member reaches the child's sandboxes; the agent of the same project too
        with cluster.client(cluster.key("orga")) as parent:
            assert parent.exec(sb.id, "echo ok").stdout == b"ok\n"
        with cluster.client(cluster.key("orga/x", "agent")) as agent:
            assert agent.exec(sb.id, "echo ok").stdout == b"ok\n"
    a.close()
    b.close()
    agent_sibling.close()


def test_a_create_sent_again_is_made_once_on_the_node_it_went_to(cluster):
    """A trainer sends a create again under its key (after NodeUnavailable, say): the
    apiserver sends it where it went first and that node answers with what it made; the
    same key from another project is that project's own create."""
    with cluster.client(cluster.key("orgk/a")) as a, cluster.client(cluster.key("orgk/b")) as b:
        first = a.create(cluster.spec(), key="rollout-17")
        try:
            again = [a.create(cluster.spec(), key="rollout-17").id for _ in range(6)]
            assert set(again) == {first.id}
            assert [i.id for i in a.list()] == [first.id]
            assert dsec.CREATE_KEY_LABEL not in first.info.labels  # the node's own
            theirs = b.create(cluster.spec(), key="rollout-17")
            assert theirs.id != first.id and first.id not in {i.id for i in b.list()}
            theirs.kill()
            with pytest.raises(InvalidSpec, match="create key"):
                a.create(cluster.spec(), key="x" * 200)
        finally:
            first.kill()


def test_an_apiserver_that_took_over_sends_a_create_again_where_it_went(cluster):
    """A keyed create went to a node through an apiserver that then died; sent again to the
    apiserver that took over (which never saw the key), it goes to the node that made it, found
    by asking the nodes, and not to another that would make a second sandbox. The node here is
    the overflow one, where a fresh placement of the spec never goes."""
    key, project = cluster.key("orgk/over"), "orgk/over"
    spec = cluster.spec(labels={OVERFLOW_LABEL: "true"})
    n3 = next(n for n in cluster.nodes if n.name == "n3")
    with n3.node.client() as direct:  # what the apiserver that died sent
        made = direct.create(
            cluster.spec(labels={OVERFLOW_LABEL: "true", PROJECT_LABEL: project}), key="r-3"
        ).id
    try:
        with (
            running_apiserver(cluster.nodes, cluster.iam_url) as api,
            cluster.client(key, api.url) as c,
        ):
            assert {c.create(spec, key="r-3").id for _ in range(3)} == {made}
            assert [i.id for i in c.list()] == [made]
            with cluster.client(cluster.key("orgk/other"), api.url) as other:
                with other.create(spec, key="r-3") as theirs:  # another project's own
                    assert theirs.id != made
                    assert [i.id for i in other.list()] == [theirs.id]
    finally:
        with cluster.client(key) as c:
            c.kill(made)


def test_a_client_cannot_choose_its_project_label(cluster):
    with cluster.client(cluster.key("orgc/p")) as c:
        with c.create(cluster.spec(labels={PROJECT_LABEL: "orga/x"})) as sb:
            assert sb.info.labels[PROJECT_LABEL] == "orgc/p"


def test_quotas_are_inherited_down_the_tree(cluster):
    cluster.iam.create_project("quota", Quota(sandboxes=3))
    cluster.iam.create_project("quota/team", Quota(sandboxes=10, memory=256 << 20))
    cluster.iam.create_project("quota/team/job")
    with cluster.client(cluster.key("quota/team/job")) as c:
        sbs = c.create_many(cluster.spec(), n=3)
        try:
            with pytest.raises(QuotaExceeded) as e:
                c.create(cluster.spec())
            assert e.value.project == "quota" and e.value.resource == "sandboxes"
        finally:
            for sb in sbs:
                sb.kill()
        with pytest.raises(QuotaExceeded) as e:
            c.create(cluster.spec(memory="512M"))
        assert e.value.project == "quota/team" and e.value.resource == "memory"
        _wait(lambda: not c.list())
        time.sleep(1.2)  # quotas count the nodes' last probe (every 0.5 s here)
        with c.create(cluster.spec()):  # room again once they are gone
            pass


def test_bad_input_gets_typed_errors(cluster):
    key = cluster.key("acme/bad")
    t = HTTPTransport(cluster.api.url, token=key)
    try:
        r = t.request(
            "POST",
            "/v1/sandboxes",
            body=json.dumps({"spec": {"cpu": "lots"}}).encode(),
            content_type="application/json",
        )
        assert r.status_code == 422
        err = r.json()["error"]
        assert err["type"] == "InvalidSpec" and "cpu" in err["context"]["field"]
        assert r.headers["x-request-id"]
        r = t.request("POST", "/v1/sandboxes", body=b"{not json", content_type="application/json")
        assert r.status_code == 422
    finally:
        t.close()
    with cluster.client(key) as c:
        with pytest.raises(AdmissionRejected) as e:
            c.create(cluster.spec(cpu=1000.0))
        assert set(e.value.nodes) >= {"n1", "n2", "n3"}
        assert "CPU" in e.value.nodes["n1"] and "overflow" in e.value.nodes["n3"]
        with pytest.raises(InvalidSpec):
            c.exec("x-n1", "")


def test_overflow_only_for_specs_that_allow_it_above_the_threshold(cluster):
    key = cluster.key("acme/burst")
    with cluster.client(key) as c:  # the default threshold (0.8) is far off
        with c.create(cluster.spec(labels={OVERFLOW_LABEL: "true"})) as sb:
            assert not sb.id.endswith("-n3")
    # an apiserver whose threshold the home pool is always over
    with running_apiserver(cluster.nodes, cluster.iam_url, args=["--overflow-at", "0"]) as api:
        with cluster.client(key, api.url) as c:
            with c.create(cluster.spec(labels={OVERFLOW_LABEL: "true"})) as sb:
                assert sb.id.endswith("-n3")
            with c.create(cluster.spec()) as sb:
                assert not sb.id.endswith("-n3")


def test_restarted_and_side_by_side_apiservers_serve_the_same_sandboxes(cluster):
    key = cluster.key("acme/restart")
    second = start_apiserver(cluster.nodes, cluster.iam_url)
    try:
        with cluster.client(key) as c:
            sb = c.create(cluster.spec())
        with cluster.client(key, second.url) as c2:
            assert sb.id in {i.id for i in c2.list()}
            assert c2.exec(sb.id, "echo two").stdout == b"two\n"
        second.stop(signal.SIGKILL)  # killed: it kept nothing
        third = start_apiserver(cluster.nodes, cluster.iam_url)
        try:
            with cluster.client(key, third.url) as c3:
                assert sb.id in {i.id for i in c3.list()}
                assert c3.exec(sb.id, "echo three").stdout == b"three\n"
                c3.kill(sb.id)
        finally:
            third.stop()
            third.log.unlink(missing_ok=True)
    finally:
        second.stop()
        second.log.unlink(missing_ok=True)


def test_a_node_that_registers_under_another_name_is_never_used(cluster, tmp_path):
    n1 = cluster.nodes[0]
    wrong = type(n1)("impostor", n1.url, n1.token, n1.node)
    with running_apiserver([wrong], cluster.iam_url) as api:
        with cluster.client(cluster.key("acme/impostor"), api.url) as c:
            time.sleep(1.5)
            with pytest.raises(AdmissionRejected) as e:
                c.create(cluster.spec())
            assert "calls itself 'n1'" in e.value.nodes["impostor"]
            with pytest.raises(UnknownSandbox):  # and n1's ids are not routed anywhere
                c.get(f"{secrets.token_hex(6)}-n1")


def test_a_lost_node_is_noticed_and_creates_go_elsewhere(cluster):
    key = cluster.key("acme/lost")
    n2 = next(n for n in cluster.nodes if n.name == "n2")
    with cluster.client(key) as c:
        sbs = c.create_many(cluster.spec(), n=10)  # past what warm layers draw to one node
        on_n2 = [sb for sb in sbs if sb.id.endswith("-n2")]
        on_n1 = [sb for sb in sbs if sb.id.endswith("-n1")]
        assert on_n1 and on_n2
        pid = daemon_pid(n2.node.config)
        t0 = time.monotonic()
        os.kill(pid, signal.SIGKILL)
        try:
            _wait(lambda: _lost(c, on_n2[0].id), timeout=5)
            detected = time.monotonic() - t0
            assert detected <= 5
            with pytest.raises(NodeLost) as e:
                c.exec(on_n2[0].id, "true")
            assert e.value.node == "n2"
            made = c.create_many(cluster.spec(), n=3)
            assert all(not sb.id.endswith("-n2") for sb in made)
            for sb in on_n1:  # the survivors did not notice
                assert sb.exec("echo fine").stdout == b"fine\n"
            for sb in made:
                sb.kill()
        finally:
            n2.node.ensure_running()  # it comes back and re-adopts its sandboxes
        _wait(lambda: _answers(c, on_n2[0].id), timeout=15)
        for sb in sbs:
            sb.kill()


def _answers(c: dsec.Client, sid: str) -> bool:
    """The sandbox answers through the apiserver again (its node is back)."""
    try:
        return c.exec(sid, "echo back").stdout == b"back\n"
    except NodeLost:
        return False


def _lost(c: dsec.Client, sid: str) -> bool:
    try:
        c.exec(sid, "true")
    except NodeLost:
        return True
    except Exception:
        return False
    return False


def test_tls(cluster, tmp_path):
    from tests.conftest import make_self_signed

    cert, key_file = make_self_signed(tmp_path)
    port = free_port()
    api = start_apiserver(
        cluster.nodes,
        cluster.iam_url,
        port=port,
        args=["--tls-cert", os.fspath(cert), "--tls-key", os.fspath(key_file)],
        scheme="https",
    )
    try:
        with dsec.Client(api.url, api_key=cluster.key("acme/tls"), verify=cert) as c:
            with c.create(cluster.spec()) as sb:
                assert sb.exec("echo tls").stdout == b"tls\n"
    finally:
        api.stop()
        Path(api.log).unlink(missing_ok=True)


def test_two_apiservers_share_iam_in_etcd(cluster):
    with etcd_server() as etcd:
        url = etcd.url("dsec-test")
        with Iam.open(url) as shared:
            shared.create_project("shared")
            info, key = shared.create_key("shared", "member")
            with (
                running_apiserver(cluster.nodes, url) as one,
                running_apiserver(cluster.nodes, url) as two,
            ):
                with cluster.client(key, one.url) as c1, cluster.client(key, two.url) as c2:
                    sb = c1.create(cluster.spec())
                    assert c2.exec(sb.id, "echo both").stdout == b"both\n"
                    c2.kill(sb.id)
                    assert sb.id not in {i.id for i in c1.list()}
                    shared.revoke_key(info.key_id)
                    time.sleep(2.5)  # each apiserver remembers a good key for at most 2 s
                    for c in (c1, c2):
                        with pytest.raises(AuthenticationFailed):
                            c.list()


def _peak_rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) << 10
    raise AssertionError("no VmHWM")


def test_file_bodies_stream_through_without_being_held(cluster):
    """One 160 MiB PUT and one 160 MiB GET through the apiserver (single requests, not the
    SDK's 8 MiB pieces): its peak memory grows by far less than a body."""
    size = 160 << 20
    data = os.urandom(1 << 20) * (size >> 20)
    key = cluster.key("acme/big")
    with running_apiserver(cluster.nodes, cluster.iam_url) as api:
        with cluster.client(key, api.url) as c, c.create(cluster.spec(disk="1G")) as sb:
            t = HTTPTransport(api.url, token=key)
            try:
                before = _peak_rss(api.proc.pid)
                target = f"/v1/sandboxes/{sb.id}/file?path=/tmp/big&mode=0644"
                r = t.request("PUT", target, body=data, content_type="application/octet-stream")
                assert r.status_code == 200, r.text
                assert r.json()["written"] == size
                r = t.request("GET", f"/v1/sandboxes/{sb.id}/file?path=/tmp/big", timeout=120)
                assert r.status_code == 200 and r.content == data
                grown = _peak_rss(api.proc.pid) - before
            finally:
                t.close()
    assert grown < 48 << 20, f"the apiserver's peak memory grew {grown >> 20} MiB"


def test_metrics_and_a_request_id_that_follows_the_request_to_the_node(cluster):
    key = cluster.key("acme/observe")
    with cluster.client(key) as c, c.create(cluster.spec(labels={OVERFLOW_LABEL: "x"})) as sb:
        node = next(n for n in cluster.nodes if sb.id.endswith("-" + n.name))
        t = HTTPTransport(cluster.api.url, token=key)
        try:
            rid = "trace-" + secrets.token_hex(6)
            r = t.request("GET", f"/v1/sandboxes/{sb.id}/usage", timeout=10)
            assert r.status_code == 200 and r.headers["x-request-id"]
            r = _get_with_id(t, f"/v1/sandboxes/{sb.id}/usage", rid)
            assert r.status_code == 200 and r.headers["x-request-id"] == rid
            # a tenant's key may not read them: they show every tenant's traffic
            assert t.request("GET", "/metrics", timeout=10).status_code == 403
            operator = HTTPTransport(cluster.api.url, token=cluster.iam.create_key("/", "admin")[1])
            metrics = operator.request("GET", "/metrics", timeout=10)
            operator.close()
            assert metrics.status_code == 200
            text = metrics.text
        finally:
            t.close()
        assert 'dsec_apiserver_create_seconds_count{outcome="ok"}' in text
        assert f'dsec_placement_decisions_total{{node="{node.name}",pool="home"}}' in text
        assert 'dsec_node_healthy{node="n3"} 1.0' in text
        assert "dsec_apiserver_requests_total" in text
        anonymous = HTTPTransport(cluster.api.url, token="nonsense")
        try:
            assert anonymous.request("GET", "/metrics").status_code == 401
        finally:
            anonymous.close()
        # the node logged the same id for the forwarded request, as JSON
        lines = node.node.config.log_path.read_text().splitlines()
        hits = [json.loads(line) for line in lines if rid in line]
        assert hits and all(h["request_id"] == rid for h in hits)
        # and the apiserver's own log line for it is JSON with the id too
        deadline = time.monotonic() + 5
        while rid not in cluster.api.output() and time.monotonic() < deadline:
            time.sleep(0.1)
        mine = [json.loads(x) for x in cluster.api.output().splitlines() if rid in x]
        assert mine and mine[0]["request_id"] == rid


def _get_with_id(t: HTTPTransport, target: str, rid: str):
    r = t.stream("GET", target, headers={"x-request-id": rid}, timeout=10)
    with r:
        r.read()
    return r


def test_leases_and_fncall_through_the_apiserver(cluster):
    for n in cluster.nodes:
        n.node.environment("kitenv")  # on every node: placement may pick any
    with cluster.client(cluster.key("acme/lease")) as c, c.create(cluster.spec()) as sb:
        lease = c.lease([sb.id], ttl=30, renew=False)
        lease_id = lease.info.id
        assert lease_id.rsplit("-", 1)[1] == sb.id.rsplit("-", 1)[1]  # routes by its node
        assert c.lease_get(lease_id).sandboxes == (sb.id,)
        c.lease_renew(lease_id)
        c.lease_release(lease_id)
        with pytest.raises(UnknownLease):
            c.lease_get(lease_id)
        with pytest.raises(UnknownLease):  # a lease id naming no registered node
            c.lease_get("0123456789abcdef-nosuchnode")
        with cluster.client(cluster.key("acme/other")) as other:
            with pytest.raises(UnknownSandbox):  # a lease on another project's sandbox
                other.lease([sb.id], ttl=30)
        r = c.fncall("kitenv", "echo $((2+3))")
        assert (r.exit_code, r.stdout) == (0, b"5\n")


def test_snapshots_and_trajectories_are_the_projects_own(cluster):
    a = cluster.client(cluster.key("snap/a"))
    b = cluster.client(cluster.key("snap/b"))
    try:
        with a.create(cluster.spec()) as sb:
            sb.write_file("/root/state", b"a's work")
            snap = sb.pack_diff(name="mine")
            assert snap.name.endswith("-mine") and snap.name != "mine"
            r = sb.exec("echo secret-output", trajectory="t1")
            assert not r.replayed
            assert [e.result.stdout for e in a.trajectory("t1")] == [b"secret-output\n"]
        (copy,) = a.restore(snap.ref, 1)
        try:
            assert copy.read_file("/root/state") == b"a's work"
            assert copy.info.labels[PROJECT_LABEL] == "snap/a"
        finally:
            copy.kill()
        with pytest.raises(NotFound):
            b.restore(snap.ref, 1)
        with b.create(cluster.spec()) as other:
            # the same trajectory name is b's own log: nothing of a's is replayed
            r = other.exec("echo b-output", trajectory="t1", step=0)
            assert not r.replayed and r.stdout == b"b-output\n"
            assert [e.result.stdout for e in b.trajectory("t1")] == [b"b-output\n"]
        b.remove_trajectory("t1")
        assert [e.result.stdout for e in a.trajectory("t1")] == [b"secret-output\n"]
        a.remove_trajectory("t1")
    finally:
        a.close()
        b.close()


@pytest.mark.parametrize(
    "args, says",
    [
        ([], "needs nodes"),
        (["--node", "n1"], "NAME=URL"),
        (["--node", "n1=http://127.0.0.1:1", "--listen", "https://127.0.0.1:1"], "--tls-cert"),
        (["--node", "n1=http://127.0.0.1:1", "--listen", "unix:///tmp/x"], "TCP"),
        (["--node", "n1=http://127.0.0.1:1", "--node-token", "s3cret"], "DSEC_NODE_TOKEN"),
        (["--node", "n1=http://127.0.0.1:1", "--node-token-file", "/nonexistent"], "cannot read"),
    ],
)
def test_the_apiserver_refuses_a_bad_command_line(args, says, tmp_path):
    r = subprocess.run(
        [sys.executable, "-m", "dsec_core.cli", "apiserver", "--iam", f"sqlite://{tmp_path}/i.db"]
        + (["--listen", f"http://127.0.0.1:{free_port()}"] if "--listen" not in args else [])
        + args,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode in (1, 2) and says in r.stderr, r.stderr  # 2: a usage error


def test_the_node_token_is_never_on_a_command_line(cluster, tmp_path):
    token = cluster.nodes[0].token
    cmdline = Path(f"/proc/{cluster.api.proc.pid}/cmdline").read_bytes()
    assert token.encode() not in cmdline  # from DSEC_NODE_TOKEN
    # from a file, with no token in the environment at all: it reaches the nodes
    path = tmp_path / "node-token"
    path.write_text(token + "\n")
    path.chmod(0o644)
    api = start_apiserver(
        cluster.nodes, cluster.iam_url, args=["--node-token-file", str(path)], token_env=False
    )
    try:
        assert token.encode() not in Path(f"/proc/{api.proc.pid}/cmdline").read_bytes()
        with cluster.client(cluster.key("acme/tokenfile"), api.url) as c:
            with c.create(cluster.spec()) as sb:
                assert sb.exec("echo ok").stdout == b"ok\n"
        assert "can be read by other users" in api.output()  # 644: warned
    finally:
        api.stop()
        api.log.unlink(missing_ok=True)


def test_warm_pools_are_the_operators_and_set_on_every_node(cluster):
    spec = cluster.spec(memory="64M", disk="64M")
    with cluster.client(cluster.key("acme/rl")) as c, pytest.raises(PermissionDenied):
        c.set_warm([(spec, 1)])
    with cluster.client(cluster.iam.create_key("/", "admin")[1]) as op:
        try:
            assert op.set_warm([(spec, 1)]).targets[0].count == 1
            for n in cluster.nodes:
                with n.node.client() as direct:
                    assert [t.count for t in direct.warm().targets] == [1]
            assert [t.count for t in op.warm().targets] == [1]
        finally:
            op.set_warm([])
