"""The scripted driver: a build plan is a YAML list of tool calls, replayed through the same
``BuildTools`` an MCP client drives. Tests and offline builds use it.

A step is ``{tool: NAME, args: {...}}``; an ``exec`` or ``session_exec`` step may add
``expect_exit: N`` to stop the plan when the command exits otherwise. A step with an unknown
tool or a bad argument raises ``BuildToolError`` naming the step; the session survives, and
the steps before it stay done.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml

from dsec_core.errors import CommandFailed, InvalidSpec

from .errors import BuildToolError
from .tools import BuildTools

__all__ = ["load_plan", "run_plan"]

_STEP_KEYS = {"tool", "args", "expect_exit"}


def load_plan(plan: str | Path | Sequence[Any]) -> list[dict[str, Any]]:
    """The steps of ``plan``: YAML text, a path to a YAML file, or the list itself."""
    if isinstance(plan, Path):
        try:
            plan = plan.read_text()
        except OSError as e:
            raise InvalidSpec(f"build plan {plan}: {e}", path=str(plan)) from e
    if isinstance(plan, str):
        try:
            plan = yaml.safe_load(plan)
        except yaml.YAMLError as e:
            raise InvalidSpec(f"build plan: not valid YAML: {e}") from e
    if not isinstance(plan, list):
        raise InvalidSpec("a build plan is a YAML list of {tool, args} steps")
    steps = []
    for i, step in enumerate(plan):
        if not isinstance(step, Mapping) or not isinstance(step.get("tool"), str):
            raise BuildToolError(f"step {i}: expected {{tool: NAME, args: {{...}}}}", step=i)
        unknown = sorted(set(step) - _STEP_KEYS)
        if unknown:
            raise BuildToolError(f"step {i}: unknown key(s) {unknown}", step=i)
        if not isinstance(step.get("args") or {}, Mapping):
            raise BuildToolError(f"step {i}: args must be a mapping", step=i, tool=step["tool"])
        steps.append(dict(step))
    return steps


def run_plan(plan: str | Path | Sequence[Any], tools: BuildTools) -> list[Any]:
    """Replay ``plan`` through ``tools``; the result of each step, in order."""
    results = []
    for i, step in enumerate(load_plan(plan)):
        tool, args = step["tool"], dict(step.get("args") or {})
        try:
            result = tools.call(tool, args)
        except BuildToolError as e:
            raise BuildToolError(f"step {i} ({tool}): {e}", step=i, tool=tool) from e
        want = step.get("expect_exit")
        if want is not None and isinstance(result, Mapping) and result.get("exit_code") != want:
            raise CommandFailed(
                f"step {i} ({tool}): exit code {result.get('exit_code')}, expected {want}: "
                f"{str(result.get('stderr', ''))[-500:]}",
                step=i,
                tool=tool,
                exit_code=result.get("exit_code"),
            )
        results.append(result)
    return results
