"""The file policy in real sandboxes: settings checked before anything starts, what read-only and
hidden paths refuse and what they leave alone (siblings, the rest of the tree), what the
construction cannot express, the node's own file operations, one Landlock domain for every
command and session, a policy the agent cannot enforce failing the create, and a daemon
restart. The attacks themselves are in tests/adversarial/test_landlock.py."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from dsec_security_landlock.testing import ANSWER, HARNESS_LOG, JUDGE, TASK_FILES, TASK_POLICY

from dsec_core.errors import InvalidSpec, PolicyUnavailable
from dsec_core.localnode import daemon_pid
from dsec_core.testing import leftovers

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="sandboxes need root")


def ok(sb, cmd: str) -> bool:
    """Whether ``cmd`` (a shell command, as root in the sandbox) succeeds."""
    return sb.exec(cmd).exit_code == 0


def refused(sb, cmd: str) -> bool:
    """Whether ``cmd`` fails, and for want of permission (not a typo in the test)."""
    r = sb.exec(cmd)
    return r.exit_code != 0 and b"ermission denied" in r.stderr + r.stdout


@pytest.fixture
def guarded(dsec_sandboxes, task):
    sb = dsec_sandboxes.create(layers=task, policies={"landlock": TASK_POLICY})
    assert sb.info.policies["landlock"] == "enforced"
    return sb


def test_bad_settings_fail_the_create_and_leave_nothing(dsec_sandboxes, dsec_client, dsec_node):
    before = {s.id for s in dsec_client.list()}
    dirs_before = set(leftovers(dsec_node.home)["sandbox_dirs"])
    for settings, field in (
        ({"read_only": ["usr/bin"]}, "policies.landlock.read_only[0]"),
        ({"hidden": ["/a", "/b/../c"]}, "policies.landlock.hidden[1]"),
        ({"hidden": ["/"]}, "policies.landlock.hidden[0]"),
        ({"scope": ["everything"]}, "policies.landlock.scope"),
        ({"writable": ["/tmp"]}, "policies.landlock.writable"),
    ):
        with pytest.raises(InvalidSpec) as e:
            dsec_sandboxes.create(policies={"landlock": settings})
        assert e.value.field == field, e.value
    assert {s.id for s in dsec_client.list()} == before
    assert set(leftovers(dsec_node.home)["sandbox_dirs"]) == dirs_before


def test_the_policy_is_reported_with_its_settings(guarded, dsec_client):
    (state,) = [p for p in dsec_client.policies(guarded.id) if p.name == "landlock"]
    assert state.state == "enforced"
    assert state.stats["hidden"] == TASK_POLICY["hidden"]
    assert state.stats["scope"] == sorted(TASK_POLICY["scope"]) and state.stats["abi"] >= 6


def test_read_only_paths_refuse_writes_and_allow_reading_and_running(guarded):
    assert guarded.exec(JUDGE).stdout == b"judged: all cases passed\n"
    assert ok(guarded, f"cat {JUDGE} >/dev/null && ls /usr/local/bin /bin >/dev/null")
    for cmd in (
        f"echo evil > {JUDGE}",
        f"echo evil >> {JUDGE}",
        f"truncate -s 0 {JUDGE}",
        f"rm {JUDGE}",
        "touch /usr/local/bin/new",
        "mkdir /usr/local/bin/d",
        "ln -s /tmp /usr/local/bin/l",
        "mkfifo /usr/local/bin/f",
        "rm /bin/busybox",  # (writing it would meet ETXTBSY first: the shell runs it)
    ):
        assert refused(guarded, cmd), cmd
    assert guarded.read_file(JUDGE) == TASK_FILES[JUDGE][0]


def test_siblings_of_protected_paths_and_the_rest_stay_writable(guarded):
    for cmd in (
        "echo more >> /usr/local/share/doc.txt && rm /usr/local/share/doc.txt",
        "mkdir -p /usr/local/lib/py/site && touch /usr/local/lib/py/site/x",
        "echo 42 > /workspace/src/solution.sh && cat /workspace/src/solution.sh",
        "echo more >> /workspace/README",  # a file directly in a hidden path's parent
        "echo x > /var/log/other.log",
        # renames and hard links across directories (Landlock's REFER) where both are writable
        "mkdir -p /tmp/a/b && mv /tmp/a /root/a && echo y > /root/a/b/f && ln /root/a/b/f /tmp/l",
        "mv /tmp/l /var/tmp/l && rm /var/tmp/l && rm -r /root/a",
        "echo cfg > /etc/some.conf",
    ):
        assert ok(guarded, cmd), cmd


def test_hidden_paths_refuse_everything(guarded):
    for cmd in (
        f"cat {ANSWER}",
        "ls /workspace/answers",
        "cat /workspace/answers/cases/1.out",
        f"cat {HARNESS_LOG}",
        "grep -r 42 /var/log/harness",
        f"echo x > {ANSWER}",
        "touch /workspace/answers/new",
        f"rm {ANSWER}",
    ):
        assert refused(guarded, cmd), cmd
    # ancestors of a read-only path can be listed; of a hidden one, not even that
    assert ok(guarded, "ls /usr/local /usr")
    assert refused(guarded, "ls /workspace") and refused(guarded, "ls /var/log")


def test_what_the_construction_cannot_express(guarded, dsec_sandboxes, task):
    # nothing can be created in, removed from or renamed within an ancestor of a protected
    # path (its own rights are what every protected path beneath it allows), / included
    for cmd in (
        "touch /workspace/new",
        "mkdir /usr/local/newdir",
        "rm /workspace/README",
        "mv /usr/local/share /usr/local/share2",
        "mkdir /newtop",
    ):
        assert refused(guarded, cmd), cmd
    # a protected path missing at start is protected through its nearest existing ancestor,
    # which keeps the protected path's rights for everything made there later
    sb = dsec_sandboxes.create(layers=task, policies={"landlock": {"read_only": ["/opt/tools"]}})
    sb.write_file("/opt/tools/run", b"#!/bin/sh\necho run\n", mode=0o755)
    sb.write_file("/opt/other", b"later")
    assert sb.exec("/opt/tools/run").stdout == b"run\n"
    assert refused(sb, "echo x > /opt/tools/run") and refused(sb, "echo x > /opt/other")
    # metadata is not a file access Landlock mediates: names beneath a hidden path can be
    # tested, modes beneath a read-only one changed (tests/adversarial/test_landlock.py)
    assert ok(guarded, f"stat {ANSWER} >/dev/null")


def test_the_nodes_file_operations_are_not_under_the_policy(guarded):
    # a trainer reads answers and logs the commands cannot, and installs a harness into a
    # read-only path, which commands can then run but not change
    assert guarded.read_file(ANSWER) == TASK_FILES[ANSWER][0]
    assert guarded.read_file(HARNESS_LOG) == TASK_FILES[HARNESS_LOG][0]
    assert {e.name for e in guarded.list_dir("/workspace/answers")} == {"answer.txt", "cases"}
    guarded.write_file("/usr/local/bin/harness", b"#!/bin/sh\necho harness ran\n", mode=0o755)
    assert guarded.exec("/usr/local/bin/harness").stdout == b"harness ran\n"
    assert refused(guarded, "echo evil > /usr/local/bin/harness")
    guarded.write_file(ANSWER, b"replaced by the trainer\n")
    assert refused(guarded, f"cat {ANSWER}")
    guarded.remove("/usr/local/bin/harness")
    assert not any(e.name == "harness" for e in guarded.list_dir("/usr/local/bin"))


def test_sessions_and_exclusive_execs_are_under_it_too(guarded):
    with guarded.session() as sh:
        assert sh.exec(f"cat {ANSWER}").exit_code != 0
        assert sh.exec(f"echo evil > {JUDGE}").exit_code != 0
        assert sh.exec("cd /workspace/src && echo 1 > out && cat out").stdout == b"1\n"
    r = guarded.exec(f"cat {ANSWER}", exclusive=True)
    assert r.exit_code != 0 and b"ermission denied" in r.stderr


def test_every_command_and_session_shares_one_domain(guarded):
    """Signals and abstract sockets are scoped to the sandbox's domain, not to each call: a
    later exec stops what an earlier one left in the background, and what a session started."""
    guarded.exec("sleep 1000 & echo $! > /tmp/bg", background=True).check()
    r = guarded.exec("kill $(cat /tmp/bg) && echo stopped")
    assert r.stdout == b"stopped\n", r
    with guarded.session() as sh:
        sh.exec("sleep 1000 & echo $! > /tmp/job").check()
        assert guarded.exec("kill -TERM $(cat /tmp/job) && echo stopped").stdout == b"stopped\n"
    # but not the agent, which is outside it
    r = guarded.exec("kill -TERM 1")
    assert r.exit_code != 0 and b"ermitted" in r.stderr, r


def test_scope_alone_needs_no_file_rules(dsec_sandboxes, task):
    sb = dsec_sandboxes.create(layers=task, policies={"landlock": {"scope": ["signal"]}})
    assert ok(sb, f"cat {ANSWER} && echo x > {JUDGE}")  # no file rules
    r = sb.exec("kill -TERM 1")
    assert r.exit_code != 0 and b"ermitted" in r.stderr, r


def test_a_policy_the_agent_cannot_enforce_fails_the_create(
    dsec_sandboxes, dsec_client, dsec_node, task
):
    """/workspace/loop is a symlink to itself: no kernel resolves a path through it, so the
    agent refuses the rules, the create fails with its reason and nothing is left."""
    # holds the task's layer mounts, which would otherwise linger and go on their own timer
    dsec_sandboxes.create(layers=task)
    before = {s.id for s in dsec_client.list()}
    left_before = leftovers(dsec_node.home)
    daemon_fds = Path(f"/proc/{daemon_pid(dsec_node.config)}/fd")
    fds_before = len(_daemon_fds(daemon_fds))
    for _ in range(3):
        with pytest.raises(PolicyUnavailable) as e:
            dsec_sandboxes.create(
                layers=task, policies={"landlock": {"hidden": ["/workspace/loop/x"]}}
            )
        assert "landlock" in str(e.value) and "symbolic links" in str(e.value), e.value
    assert {s.id for s in dsec_client.list()} == before
    assert leftovers(dsec_node.home) == left_before  # mounts, cgroups, dirs, loops, disks
    # the memfd and the answer pipe are closed too (three refusals leaking them would be six;
    # a client connection more or less is not a leak)
    assert len(_daemon_fds(daemon_fds)) <= fds_before + 2


def _daemon_fds(fd_dir: Path) -> list[str]:
    """The daemon's open descriptors but the user namespaces its uid pool keeps, one per uid
    range it has used (``UidPool``: each refused create took a new range)."""
    out = []
    for fd in os.listdir(fd_dir):
        try:
            if os.readlink(fd_dir / fd).startswith("user:"):
                continue
        except FileNotFoundError:  # closed meanwhile
            continue
        out.append(fd)
    return out


def test_the_policy_holds_and_is_reported_after_a_daemon_restart(dsec_sandboxes, dsec_node, task):
    sb = dsec_sandboxes.create(layers=task, policies={"landlock": TASK_POLICY})
    try:
        dsec_node.restart()
    finally:
        dsec_node.ensure_running()
    with dsec_node.client() as c:
        (state,) = [p for p in c.policies(sb.id) if p.name == "landlock"]
        assert state.state == "enforced" and state.stats["read_only"] == TASK_POLICY["read_only"]
        again = c.get(sb.id)
        assert refused(again, f"cat {ANSWER}")
        again.kill()
