"""The E2B API as a real ``dsec apiserver`` process serves it (over a named node), its calls
going back through the apiserver with the caller's IAM key. The stock SDK then
works with a project's key, a wrong key is the SDK's ``AuthenticationException``, and another
project's sandbox is not found, on the control plane and on envd's paths alike."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator

import pytest

pytest.importorskip("e2b")

from e2b import (
    AuthenticationException,
    Sandbox,
    SandboxException,
    SandboxNotFoundException,
    SandboxNotRunningException,
    SandboxQuery,
)

from dsec_core.iam import Iam
from dsec_core.testing.apiserver import named_nodes, start_apiserver

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root")


class Plane:
    def __init__(self, url: str, iam: Iam) -> None:
        self.url, self.iam = url, iam

    def key(self, project: str, role: str = "member") -> str:
        known = {p.path for p in self.iam.projects()}
        parts = project.split("/")
        for i in range(1, len(parts) + 1):
            if "/".join(parts[:i]) not in known:
                self.iam.create_project("/".join(parts[:i]))
        return self.iam.create_key(project, role)[1]


@pytest.fixture(scope="module")
def plane(tmp_path_factory) -> Iterator[Plane]:
    """The apiserver itself serves the E2B API, on its one listener."""
    iam_url = f"sqlite://{tmp_path_factory.mktemp('iam') / 'iam.db'}"
    iam = Iam.open(iam_url)
    with named_nodes({"e1": {}}) as nodes:
        environment = nodes[0].node.environment("e2b-kit")
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("DSEC_E2B_TEMPLATES", f"base={environment}")  # read as it starts
            api = start_apiserver(nodes, iam_url)
        try:
            with pytest.MonkeyPatch.context() as mp:
                mp.setenv("E2B_API_URL", api.url)
                mp.setenv("E2B_SANDBOX_URL", api.url)
                mp.delenv("E2B_API_KEY", raising=False)
                yield Plane(api.url, iam)
        finally:
            api.stop()
            api.log.unlink(missing_ok=True)
    iam.close()


def test_a_project_key_works_and_other_projects_cannot_reach_its_sandbox(plane):
    a, b = plane.key("e2b/a"), plane.key("e2b/b")
    sb = Sandbox.create(api_key=a, metadata={"who": "a"})
    try:
        seen: list[str] = []
        r = sb.commands.run("echo one; sleep 0.5; echo two", on_stdout=seen.append)
        assert r.stdout == "one\ntwo\n" and seen[0] == "one\n"
        sb.files.write("/data/x.txt", "through the apiserver")
        assert sb.files.read("/data/x.txt") == "through the apiserver"
        assert sb.get_info().metadata == {"who": "a"}
        mine = Sandbox.list(api_key=a, query=SandboxQuery(metadata={"who": "a"})).next_items()
        assert [s.sandbox_id for s in mine] == [sb.sandbox_id]
        # project b: not found, never forbidden, on every path
        assert Sandbox.list(api_key=b, query=SandboxQuery(metadata={"who": "a"})).next_items() == []
        with pytest.raises(SandboxNotFoundException):
            Sandbox.get_info(sb.sandbox_id, api_key=b)
        with pytest.raises(SandboxNotFoundException):
            Sandbox.connect(sb.sandbox_id, api_key=b)
        assert Sandbox.kill(sb.sandbox_id, api_key=b) is False
        stolen = Sandbox(
            sandbox_id=sb.sandbox_id,
            sandbox_domain=None,
            envd_version=sb._envd_version,
            envd_access_token=b,
            connection_config=type(sb.connection_config)(
                api_key=b,
                extra_sandbox_headers={"X-Access-Token": b, "E2b-Sandbox-Id": sb.sandbox_id},
            ),
        )
        with pytest.raises(SandboxNotRunningException):
            stolen.commands.run("echo stolen")
        with pytest.raises(SandboxNotRunningException):
            stolen.files.read("/data/x.txt")
        assert sb.is_running()
    finally:
        assert sb.kill() is True


def test_a_wrong_key_is_the_sdks_authentication_error(plane):
    with pytest.raises(AuthenticationException):
        Sandbox.create(api_key="dsk_0000000000000000_" + "0" * 64)
    with pytest.raises(AuthenticationException):
        Sandbox.list(api_key="nonsense").next_items()


def test_internet_access_is_a_loosening_that_a_member_key_may_not_ask_for(plane):
    """``allow_internet_access=True`` opens the network (``network="internet"``): the IAM rule
    for every network mode but "none" holds, so a member key is refused with the reason and a
    builder key (one that may loosen) gets it."""
    with pytest.raises(SandboxException) as e:
        Sandbox.create(api_key=plane.key("org/net"), allow_internet_access=True)
    assert e.value.status_code == 403 and "network 'internet'" in str(e.value)
    sb = Sandbox.create(api_key=plane.key("org/net", "builder"), allow_internet_access=True)
    try:
        assert sb.commands.run("cat /sys/class/net/eth0/operstate").stdout.strip() == "up"
    finally:
        sb.kill()


def test_watch_dir_through_the_apiserver(plane):
    """The watch runs as a streamed exec through the apiserver, held between polls."""
    key = plane.key("org/watch")
    sb = Sandbox.create(api_key=key)
    try:
        h = sb.files.watch_dir("/tmp")
        sb.files.write("/tmp/seen.txt", "x")
        seen: list[tuple[str, str]] = []
        deadline = time.monotonic() + 10
        while ("create", "seen.txt") not in seen:
            assert time.monotonic() < deadline, seen
            seen += [(e.type.value, e.name) for e in h.get_new_events()]
            time.sleep(0.05)
        h.stop()
    finally:
        sb.kill()
