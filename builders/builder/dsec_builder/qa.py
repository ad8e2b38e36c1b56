"""QA of a staged environment: every check in a fresh sandbox from the packed layers.

Each sandbox runs under the runtime client (not the builder's), with no network, no build
labels and the published environment's own env and working directory (none of the session's
mirror settings). The checks: the declared checks exit 0; for a task, the reference solution
earns full reward and the unmodified workspace does not (fail-to-pass), scored with the task's
own reward function (``dsec_core.catalog.rewards``); two runs of the reference give the same
reward; the packed layer stays within a size budget.
"""

from __future__ import annotations

import posixpath
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from dsec_core.catalog.model import Task
from dsec_core.catalog.rewards import compute_reward
from dsec_core.errors import DsecError, InvalidSpec
from dsec_core.records import ExecResult, LayerInfo, SandboxSpec, parse_size
from dsec_core.sdk import Client

__all__ = ["DEFAULT_MAX_BYTES", "Check", "QAReport", "TaskSpec", "run_qa", "run_task"]

#: The packed diff's size budget unless the build says otherwise.
DEFAULT_MAX_BYTES = 512 << 20
#: What a QA sandbox may use, and how long a check may run unless it says.
QA_SANDBOX = {"cpu": 1.0, "memory": "1G", "pids": 512, "ttl": 900.0}
CHECK_TIMEOUT = 300.0
OUTPUT_TAIL = 2000  # characters of a failed check's output kept in the report

_TASK_FIELDS = ("name", "command", "reward", "timeout", "report", "description")


@dataclass(frozen=True)
class Check:
    """A declared check: ``command`` must exit 0 (within ``timeout`` seconds)."""

    name: str
    command: str
    timeout: float = CHECK_TIMEOUT

    @classmethod
    def from_dict(cls, doc: Any, where: str = "checks") -> Check:
        if not isinstance(doc, Mapping) or not isinstance(doc.get("command"), str):
            raise InvalidSpec(f"{where}: a check is {{name, command[, timeout]}}", field=where)
        unknown = sorted(set(doc) - {"name", "command", "timeout"})
        if unknown:
            raise InvalidSpec(f"{where}: unknown field(s) {unknown}", field=where)
        timeout = doc.get("timeout", CHECK_TIMEOUT)
        if not isinstance(timeout, (int, float)) or isinstance(timeout, bool) or timeout <= 0:
            raise InvalidSpec(f"{where}: timeout must be positive seconds", field=where)
        return cls(str(doc.get("name") or doc["command"]), doc["command"], float(timeout))


@dataclass(frozen=True)
class TaskSpec:
    """A task to check the environment against: the catalog ``task`` (its command and reward
    function), the hidden ``tests`` and the ``reference`` solution (``{path: text}``, paths
    absolute or relative to the working directory; ``finish`` also takes ``{path: {file:
    PATH}}``, read from the session), and other ``secrets`` (answer files' texts).

    Tests, reference and secrets are secret: the leak scan refuses a packed layer that holds
    any of them, and only QA sandboxes get them."""

    task: Task
    tests: Mapping[str, str] = field(default_factory=dict)
    reference: Mapping[str, str] = field(default_factory=dict)
    secrets: tuple[str, ...] = ()

    @classmethod
    def from_dict(cls, doc: Any, environment: str) -> TaskSpec:
        """Read ``{name, command, reward, timeout, report, tests, reference, secrets}``."""
        if not isinstance(doc, Mapping):
            raise InvalidSpec("task: expected a mapping", field="task")
        unknown = sorted(set(doc) - {*_TASK_FIELDS, "tests", "reference", "secrets", "judge"})
        if unknown:
            raise InvalidSpec(f"task: unknown field(s) {unknown}", field="task")
        if doc.get("judge") is not None:
            raise InvalidSpec(
                "task: judge tasks are not checked by the builder's QA yet; give a command "
                "with an exit_code or pass_rate reward",
                field="task.judge",
            )
        if not isinstance(doc.get("command"), str) or not doc["command"]:
            raise InvalidSpec("task: command is required", field="task.command")
        files = {}
        for key in ("tests", "reference"):
            value = doc.get(key) or {}
            if not isinstance(value, Mapping) or not all(
                isinstance(k, str) and isinstance(v, str) for k, v in value.items()
            ):
                raise InvalidSpec(f"task.{key}: expected {{path: text}}", field=f"task.{key}")
            files[key] = dict(value)
        if not files["reference"]:
            raise InvalidSpec("task: a reference solution is required", field="task.reference")
        secrets = doc.get("secrets") or []
        if not isinstance(secrets, list) or not all(isinstance(s, str) for s in secrets):
            raise InvalidSpec("task.secrets: expected a list of texts", field="task.secrets")
        kw = {k: doc[k] for k in _TASK_FIELDS if k in doc}
        kw.setdefault("name", environment)
        try:
            task = Task(environment=environment, **kw)
        except TypeError as e:
            raise InvalidSpec(f"task: {e}", field="task") from e
        if task.reward not in ("exit_code", "pass_rate"):
            raise InvalidSpec(
                f"task: reward {task.reward!r}: QA scores exit_code or pass_rate tasks",
                field="task.reward",
            )
        return cls(task, files["tests"], files["reference"], tuple(secrets))

    def secret_texts(self) -> dict[str, str]:
        """The texts the leak scan looks for, by label (never shown in an error)."""
        out = {f"hidden-test:{p}": t for p, t in self.tests.items()}
        out.update({f"reference-solution:{p}": t for p, t in self.reference.items()})
        out.update({f"secret-{i + 1}": t for i, t in enumerate(self.secrets)})
        return {label: text for label, text in out.items() if text.strip()}


@dataclass
class QAReport:
    """What QA found; ``passed`` when every check passed. Stored as JSON with the build."""

    layer: str
    digest: str
    size: int
    max_bytes: int
    checks: list[dict[str, Any]] = field(default_factory=list)
    started: float = 0.0
    seconds: float = 0.0

    @property
    def passed(self) -> bool:
        return bool(self.checks) and all(c["passed"] for c in self.checks)

    @property
    def failed(self) -> list[str]:
        return [c["name"] for c in self.checks if not c["passed"]]

    def to_dict(self) -> dict[str, Any]:
        return {
            "layer": self.layer,
            "digest": self.digest,
            "size": self.size,
            "max_bytes": self.max_bytes,
            "passed": self.passed,
            "failed": self.failed,
            "checks": self.checks,
            "started": self.started,
            "seconds": round(self.seconds, 3),
        }


def _tail(data: bytes) -> str:
    text = data.decode("utf-8", "replace")
    return text[-OUTPUT_TAIL:]


class _Fresh:
    """Runs one command in a fresh QA sandbox with ``files`` written first, then kills it."""

    def __init__(self, client: Client, spec: SandboxSpec) -> None:
        self.client, self.spec = client, spec

    def run(
        self, command: str, timeout: float, files: Mapping[str, str], task: Task | None = None
    ) -> tuple[Any, float | None]:
        sb = self.client.create(self.spec)
        try:
            for path, text in files.items():
                target = posixpath.join(self.spec.workdir, path)
                sb.exec(["mkdir", "-p", posixpath.dirname(target)], timeout=30)
                sb.write_file(target, text)
            # as a verifier runs: alone in the sandbox
            result = sb.exec(command, timeout=timeout, exclusive=True)
            reward = None
            if task is not None:
                reward = compute_reward(task, result, lambda p: sb.read_file(p))
            return result, reward
        finally:
            try:
                sb.kill()
            except DsecError:
                pass


def run_qa(
    client: Client,
    staged: LayerInfo,
    *,
    env: Mapping[str, str],
    workdir: str,
    checks: Sequence[Check] = (),
    task: TaskSpec | None = None,
    max_bytes: int | str = DEFAULT_MAX_BYTES,
    backend: str | None = None,
) -> QAReport:
    """Check ``staged`` (a packed layer over its parents) with ``client`` (a runtime identity)
    in fresh sandboxes with no network (on ``backend``, the environment's); the report says
    what passed. Never raises for a failing check: a check that cannot even run (its sandbox
    refused) fails with the reason."""
    budget = parse_size(max_bytes, "max_bytes") or 0
    report = QAReport(staged.ref, staged.digest, staged.size, budget, started=time.time())
    t0 = time.monotonic()
    spec = SandboxSpec(
        layers=(staged.ref, *staged.parents),
        env=dict(env),
        workdir=workdir,
        network="none",
        backend=backend,
        **QA_SANDBOX,  # type: ignore[arg-type]
    )
    fresh = _Fresh(client, spec)
    report.checks.append(
        {
            "name": "size",
            "kind": "size",
            "passed": staged.size <= budget,
            "size": staged.size,
            "max_bytes": budget,
        }
    )
    for check in checks:
        row: dict[str, Any] = {"name": check.name, "kind": "declared", "command": check.command}
        try:
            result, _ = fresh.run(check.command, check.timeout, {})
            row.update(passed=result.ok, exit_code=result.exit_code, timed_out=result.timed_out)
            if not result.ok:
                row.update(stdout=_tail(result.stdout), stderr=_tail(result.stderr))
        except DsecError as e:
            row.update(passed=False, error=f"{type(e).__name__}: {e}")
        report.checks.append(row)
    if task is not None:
        report.checks.extend(_task_checks(fresh, task))
    report.seconds = time.monotonic() - t0
    return report


def _task_checks(fresh: _Fresh, spec: TaskSpec) -> list[dict[str, Any]]:
    """Fail-to-pass and reproducibility of ``spec``: the reference twice, the workspace once."""
    task = spec.task
    rewards: dict[str, float | None] = {}
    errors: dict[str, str] = {}
    runs = {
        "reference": {**spec.tests, **spec.reference},
        "reference-again": {**spec.tests, **spec.reference},
        "unmodified": dict(spec.tests),
    }
    for key, files in runs.items():
        try:
            _, rewards[key] = fresh.run(task.command, task.timeout, files, task)
        except DsecError as e:
            rewards[key], errors[key] = None, f"{type(e).__name__}: {e}"
    ref, again, plain = rewards["reference"], rewards["reference-again"], rewards["unmodified"]
    rows = [
        {
            "name": "reference-passes",
            "kind": "task",
            "passed": ref == 1.0,
            "reward": ref,
        },
        {
            "name": "unmodified-fails",
            "kind": "task",
            "passed": plain is not None and ref is not None and plain < ref,
            "reward": plain,
        },
        {
            "name": "reproducible",
            "kind": "task",
            "passed": ref is not None and ref == again,
            "rewards": [ref, again],
        },
    ]
    for row, key in zip(rows, ("reference", "unmodified", "reference-again"), strict=True):
        if key in errors:
            row["error"] = errors[key]
    return rows


def run_task(
    client: Client,
    environment: str,
    spec: TaskSpec,
    *,
    files: Mapping[str, str] | None = None,
    backend: str | None = None,
) -> tuple[ExecResult, float]:
    """One graded run of ``spec`` in a fresh sandbox of ``environment`` (no network): the
    hidden tests written in, then ``files`` (an agent's answer, or ``spec.reference``), then
    the task's command, scored by its reward function. How a grader runs a published task
    whose tests are hidden (``BuildStore.task`` has them): the environment never holds them."""
    sandbox = SandboxSpec(
        environment=environment,
        network="none",
        backend=backend,
        **QA_SANDBOX,  # type: ignore[arg-type]
    )
    result, reward = _Fresh(client, sandbox).run(
        spec.task.command, spec.task.timeout, {**spec.tests, **(files or {})}, spec.task
    )
    assert reward is not None  # a task was given
    return result, reward
