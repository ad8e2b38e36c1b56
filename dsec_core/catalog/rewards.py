"""Rewards from native execution signals: a task's exit code, or the pass rate of its tests.

Whatever goes wrong while reading the signal (no report, broken XML, zero tests) scores 0.0:
a policy must never earn reward by making the judge fail.
"""

from __future__ import annotations

import xml.etree.ElementTree as ET
from collections.abc import Callable

from ..errors import DsecError, InvalidSpec
from ..records import ExecResult, JudgeResult
from .model import Task

__all__ = ["MAX_REPORT_BYTES", "compute_reward", "junit_pass_rate"]

MAX_REPORT_BYTES = 16 << 20  # a report bigger than this is a policy filling the disk, not tests


def junit_pass_rate(data: bytes) -> float:
    """passed / total of the test cases in a JUnit XML document; 0.0 if none or unreadable.

    A case passes when it has no ``failure``, ``error`` or ``skipped`` child. Skipped cases
    count in the total, so skipping a failing test never raises the reward. Cases are counted
    rather than trusting the ``tests=`` attributes.
    """
    if not data or len(data) > MAX_REPORT_BYTES:
        return 0.0
    try:
        root = ET.fromstring(data)
    except (ET.ParseError, ValueError):
        return 0.0
    total = passed = 0
    for case in root.iter("testcase"):
        total += 1
        if not any(child.tag in ("failure", "error", "skipped") for child in case):
            passed += 1
    return passed / total if total else 0.0


def compute_reward(
    task: Task,
    result: ExecResult | JudgeResult,
    read_file: Callable[[str], bytes] | None = None,
) -> float:
    """The reward of one run of ``task``.

    ``exit_code``: 1.0 if the command exited 0 in time, else 0.0. ``pass_rate``: the pass rate
    of the JUnit XML at ``task.report``, read with ``read_file`` (the sandbox's file API);
    0.0 when the command timed out, or the report is missing or unreadable. ``judge``: 1.0 if
    judge mode accepted every case (``JudgeResult.verdict`` AC), else 0.0.
    """
    if task.reward == "judge":
        return 1.0 if isinstance(result, JudgeResult) and result.verdict == "AC" else 0.0
    if isinstance(result, JudgeResult):
        raise InvalidSpec(
            f"task {task.name}: a {task.reward} reward needs a command's result, not a judge's",
            field="reward",
        )
    if task.reward == "exit_code":
        return 1.0 if result.exit_code == 0 and not result.timed_out else 0.0
    if task.reward == "pass_rate":
        if result.timed_out or read_file is None or not task.report:
            return 0.0
        try:
            data = read_file(task.report)
        except (DsecError, OSError):  # missing, a directory, unreadable: scores 0
            return 0.0
        return junit_pass_rate(data)
    raise InvalidSpec(
        f"task {task.name}: unknown reward {task.reward!r}; expected exit_code, pass_rate or judge",
        field="reward",
    )
