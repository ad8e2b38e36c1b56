"""The adversarial suite: each test really attempts an attack from inside a sandbox, as root, and
asserts it is contained and that nothing else (other sandboxes, layer files, the node daemon,
the host) is affected. Mark each with ``@pytest.mark.attack("what is attempted")``; the run ends
with a table of attack -> outcome. A test that shows an attack still works, as documented, ends
with ``pytest.xfail(reason)`` and is listed as a known gap.

Network attacks only ever target servers the tests start themselves, on loopback or in network
namespaces the tests create.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from dsec_core.testing import KitNode

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root")

_OUTCOMES: list[tuple[str, str, str]] = []  # (attack, outcome, test id)


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "attack(what): an attack the test attempts from inside")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]):
    outcome = yield
    report = outcome.get_result()
    marker = item.get_closest_marker("attack")
    if marker is None or not marker.args:
        return
    if report.when == "call" or (report.when == "setup" and (report.skipped or report.failed)):
        if hasattr(report, "wasxfail"):  # pytest.xfail(reason): the attack works, as documented
            result = f"NOT CONTAINED, a known gap: {report.wasxfail.removeprefix('reason: ')}"
        elif report.passed:
            result = "contained"
        elif report.skipped:
            reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else "skipped"
            result = f"skipped: {reason}"
        else:
            result = "NOT CONTAINED (or the test broke)"
        _OUTCOMES.append((marker.args[0], result, item.nodeid))


def pytest_terminal_summary(terminalreporter, exitstatus, config) -> None:
    if not _OUTCOMES:
        return
    tr = terminalreporter
    width = max(len(a) for a, _, _ in _OUTCOMES)
    tr.section("adversarial suite: attack -> outcome")
    for attack, result, _ in _OUTCOMES:
        tr.write_line(f"{attack:<{width}}  {result}")
    ran = sum(1 for _, r, _ in _OUTCOMES if not r.startswith("skipped"))
    contained = sum(1 for _, r, _ in _OUTCOMES if r == "contained")
    tr.write_line(f"{len(_OUTCOMES)} attacks, {ran} executed, {contained} contained")


@dataclass
class Witness:
    """What must not change while an attack runs: a bystander sandbox, the layer file and the
    node daemon. ``check()`` asserts they are as they were."""

    node: KitNode
    bystander: object
    layer_digest: str = ""
    daemon_pid: int = 0
    marks: dict[str, str] = field(default_factory=dict)

    def check(self) -> None:
        image = (
            self.node.config.layer_dir
            / "blobs"
            / "sha256"
            / (self.node.layer.digest.split(":", 1)[1] + ".erofs")
        )
        assert "sha256:" + hashlib.sha256(image.read_bytes()).hexdigest() == self.layer_digest
        assert int(self.node.config.pid_file.read_text()) == self.daemon_pid
        assert Path(f"/proc/{self.daemon_pid}").exists(), "the node daemon died"
        r = self.bystander.exec("cat /root/mark; ls /bin/sh")
        assert r.exit_code == 0 and r.stdout.startswith(b"bystander\n"), r


@pytest.fixture
def witness(dsec_node, dsec_sandboxes) -> Witness:
    bystander = dsec_sandboxes.create()
    bystander.exec("echo bystander > /root/mark").check()
    w = Witness(
        node=dsec_node,
        bystander=bystander,
        layer_digest=dsec_node.layer.digest,
        daemon_pid=int(dsec_node.config.pid_file.read_text()),
    )
    yield w
    w.check()
