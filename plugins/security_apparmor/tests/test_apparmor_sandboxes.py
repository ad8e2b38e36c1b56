"""The policy on a real node. Where the host cannot enforce AppArmor (this kernel has none): asking
for it fails the create with the reason and leaves nothing, and ``best_effort`` creates the
sandbox without it, saying so. Where it can: the profile confines every process of the
sandbox, root included, and goes when the sandbox does."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from dsec_security_apparmor.kernel import Kernel
from dsec_security_apparmor.policy import AppArmorPolicy
from dsec_security_apparmor.profile import render

from dsec_core.errors import PolicyUnavailable
from dsec_core.security import FileRules
from dsec_core.testing import leftovers

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="sandboxes need root")

SETTINGS = {"read_only": ["/usr/bin"], "hidden": ["/etc/group"], "scope": ["signal"]}


def why_unavailable() -> str | None:
    try:
        AppArmorPolicy.check_available()
    except PolicyUnavailable as e:
        return str(e)
    return None


WHY = why_unavailable()
without_apparmor = pytest.mark.skipif(WHY is None, reason="this host can enforce AppArmor")
with_apparmor = pytest.mark.skipif(WHY is not None, reason=str(WHY))


@without_apparmor
def test_asking_for_it_fails_the_create_with_the_reason(dsec_sandboxes, dsec_client, dsec_node):
    before = {s.id for s in dsec_client.list()}
    dirs_before = set(leftovers(dsec_node.home)["sandbox_dirs"])
    with pytest.raises(PolicyUnavailable) as e:
        dsec_sandboxes.create(policies={"apparmor": SETTINGS})
    assert str(e.value) == WHY and e.value.policy == "apparmor"
    assert e.value.reasons and all(r in str(e.value) for r in e.value.reasons)
    assert {s.id for s in dsec_client.list()} == before
    assert set(leftovers(dsec_node.home)["sandbox_dirs"]) == dirs_before
    assert not (dsec_node.home / "run" / "apparmor").exists()


@without_apparmor
def test_best_effort_creates_the_sandbox_without_it_and_says_why(dsec_sandboxes, dsec_client):
    sb = dsec_sandboxes.create(policies={"apparmor": {**SETTINGS, "best_effort": True}})
    assert sb.info.policies["apparmor"] == f"skipped: {WHY}"
    assert sb.info.policies["seccomp"] == "enforced"  # the other policies are untouched
    (state,) = [p for p in dsec_client.policies(sb.id) if p.name == "apparmor"]
    assert state.state == f"skipped: {WHY}"
    assert sb.exec("echo ok > /usr/bin/written && cat /etc/group").exit_code == 0


@with_apparmor
def test_the_profile_confines_every_process(dsec_sandboxes, dsec_node):
    name = render(FileRules.parse(SETTINGS, "apparmor")).name
    sb = dsec_sandboxes.create(policies={"apparmor": SETTINGS})
    assert sb.info.policies["apparmor"] == "enforced"
    # the agent (its /proc entry is out of the sandbox's reach: read it from the host) and
    # what it runs
    assert Path(f"/proc/{sb.info.pid}/attr/current").read_text().strip() == f"{name} (enforce)"
    assert sb.exec("cat /proc/self/attr/current").text.strip() == f"{name} (enforce)"
    assert sb.exec("ls /usr/bin && /usr/bin/env true").exit_code == 0  # read, run
    for attack in (
        "echo x > /usr/bin/new",
        "rm /usr/bin/env",
        "mv /usr/bin /usr/bin2",
        "mv /usr /usr2",  # moving the protected path out from under its rule
        "ln /usr/bin/env /tmp/env",  # a hard link would carry the write elsewhere
        "cat /etc/group",
        "cp /etc/group /tmp/g",
        "mount -t tmpfs none /mnt",
    ):
        assert sb.exec(attack).exit_code != 0, attack
    assert name in Kernel().loaded()
    sb.kill()
    assert name not in Kernel().loaded()


@with_apparmor
def test_scoped_abstract_sockets_keep_the_sandbox_working(dsec_sandboxes):
    if Kernel().missing_for_scope(("abstract_unix",)):
        pytest.skip("this kernel's AppArmor has no unix socket mediation")
    settings = {"scope": ["abstract_unix", "signal"]}
    sb = dsec_sandboxes.create(policies={"apparmor": settings})
    assert sb.info.policies["apparmor"] == "enforced"
    # the agent serves through its inherited socket; socketpairs (pipes of a shell) work
    assert sb.exec("echo a | cat && sleep 0.1 & wait").exit_code == 0
