"""Build records: what a build is, kept across CLI invocations under ``$DSEC_HOME/builds/<name>/``.

``build.json`` holds the record (sandbox id, the environment it started from, the policy,
version, state); ``log.jsonl`` one line per tool call; ``report.json`` the QA report once
``finish`` ran; ``task.json`` the task it checked, hidden tests included. These are the
builder's own files, on the builder's machine: runtime keys have no route to them (the node's
API serves sandboxes and layers, never this directory).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import time
from collections.abc import Iterator, Mapping
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from dsec_core.errors import InvalidSpec
from dsec_core.linux.files import write_atomic

from .errors import BuildExists, UnknownBuild

__all__ = ["BUILD_STATES", "LIVE_STATES", "BuildRecord", "BuildStore"]

#: ``open``: the session runs; ``staged``: packed, QA under way; ``qa-failed``: staged with a
#: failing report; ``leaked``: the leak scan refused the pack (nothing staged); in both the
#: session still runs, to fix and finish again. ``published``; ``lost``: the session's sandbox
#: was gone.
BUILD_STATES = ("open", "staged", "qa-failed", "leaked", "published", "lost")
#: States whose build still holds a session: a new ``start`` of that name is refused.
LIVE_STATES = ("open", "staged", "qa-failed", "leaked")
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
#: A logged argument or result longer than this is cut (file contents, command output).
LOG_TEXT_MAX = 4096


def check_build_name(name: str) -> str:
    """``name`` if it can name a build (and so a layer and an environment), else InvalidSpec."""
    if not isinstance(name, str) or not _NAME_RE.fullmatch(name) or name.startswith("staged-"):
        raise InvalidSpec(
            f"build name {name!r}: 1-64 of letters, digits, '.', '_', '-', not starting "
            "with 'staged-'",
            field="name",
        )
    return name


@dataclass(frozen=True)
class BuildRecord:
    """One build: its session sandbox and where it stands (``state``, one of BUILD_STATES)."""

    name: str
    version: str
    from_env: str
    sandbox_id: str
    policy: Mapping[str, Any] = field(default_factory=dict)
    state: str = "open"
    created: float = 0.0
    #: The shell session ``session_exec`` uses when the caller names none (opened on first use).
    session: str | None = None
    #: Declared checks, ``[{name, command}]``: each must exit 0 in a fresh sandbox at QA.
    checks: tuple[Mapping[str, str], ...] = ()
    #: What the policy's mirror files replaced in the session (path -> the old text, None
    #: where there was no file): the scrub puts it back before packing.
    restore: Mapping[str, str | None] = field(default_factory=dict)
    staged: str = ""  # the staged layer's ref once packed
    published: str = ""  # the published layer's ref
    error: str = ""  # why it failed (leaked, lost, QA)

    @property
    def ref(self) -> str:
        return f"{self.name}@{self.version}"

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["checks"] = [dict(c) for c in self.checks]
        d["policy"] = dict(self.policy)
        d["restore"] = dict(self.restore)
        return d

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> BuildRecord:
        names = {f.name for f in fields(cls)}
        kw = {k: v for k, v in data.items() if k in names}
        kw["checks"] = tuple(kw.get("checks") or ())
        return cls(**kw)


class BuildStore:
    """The build records under ``home/builds`` (``home``: the builder's ``DSEC_HOME``)."""

    def __init__(self, home: Path | str) -> None:
        self.root = Path(home) / "builds"

    def _dir(self, name: str) -> Path:
        return self.root / check_build_name(name)

    def get(self, name: str) -> BuildRecord:
        path = self._dir(name) / "build.json"
        try:
            return BuildRecord.from_dict(json.loads(path.read_text()))
        except FileNotFoundError:
            raise UnknownBuild(
                f"no build {name!r} (start one with `dsec build start --from ENV --name {name}`)",
                name=name,
                known=[r.name for r in self.list()],
            ) from None

    def list(self) -> list[BuildRecord]:
        out = []
        for path in sorted(self.root.glob("*/build.json")) if self.root.is_dir() else []:
            with contextlib.suppress(FileNotFoundError, json.JSONDecodeError, TypeError):
                out.append(BuildRecord.from_dict(json.loads(path.read_text())))
        return out

    def create(self, record: BuildRecord) -> BuildRecord:
        """Save a new build's record; ``BuildExists`` if one of that name still holds a session
        (an old finished or failed one is replaced, its log and report with it)."""
        d = self._dir(record.name)
        with contextlib.suppress(UnknownBuild):
            old = self.get(record.name)
            if old.state in LIVE_STATES:
                raise BuildExists(
                    f"build {record.name} is {old.state} (sandbox {old.sandbox_id}): finish or "
                    f"remove it first (`dsec build rm {record.name}`)",
                    name=record.name,
                    state=old.state,
                )
            shutil.rmtree(d, ignore_errors=True)
        d.mkdir(mode=0o700, parents=True, exist_ok=True)
        record = replace(record, created=record.created or time.time())
        self.save(record)
        return record

    def save(self, record: BuildRecord) -> None:
        d = self._dir(record.name)
        d.mkdir(mode=0o700, parents=True, exist_ok=True)
        data = json.dumps(record.to_dict(), indent=2).encode() + b"\n"
        write_atomic(d / "build.json", data, mode=0o600)

    def update(self, name: str, **changes: Any) -> BuildRecord:
        record = replace(self.get(name), **changes)
        self.save(record)
        return record

    def remove(self, name: str) -> None:
        shutil.rmtree(self._dir(name), ignore_errors=True)

    def log(self, name: str, entry: Mapping[str, Any]) -> None:
        """Append one tool call to the build's ``log.jsonl`` (long texts cut)."""
        line = json.dumps({"time": time.time(), **_cut(dict(entry))}, default=str)
        path = self._dir(name) / "log.jsonl"
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            os.write(fd, line.encode() + b"\n")
        finally:
            os.close(fd)

    def read_log(self, name: str) -> Iterator[dict[str, Any]]:
        path = self._dir(name) / "log.jsonl"
        if path.exists():
            for line in path.read_text().splitlines():
                yield json.loads(line)

    def report_path(self, name: str) -> Path:
        return self._dir(name) / "report.json"

    def save_report(self, name: str, report: Mapping[str, Any]) -> Path:
        path = self.report_path(name)
        write_atomic(path, json.dumps(report, indent=2).encode() + b"\n", mode=0o600)
        return path

    def save_task(self, name: str, task: Mapping[str, Any]) -> Path:
        """The task ``finish`` checked, hidden tests and reference included (``task.json``):
        what a grader needs, kept where only the builder reads."""
        path = self._dir(name) / "task.json"
        write_atomic(path, json.dumps(task, indent=2).encode() + b"\n", mode=0o600)
        return path

    def task(self, name: str) -> dict[str, Any] | None:
        """The task build ``name``'s finish checked (``task.json``), or None."""
        path = self._dir(name) / "task.json"
        return json.loads(path.read_text()) if path.exists() else None

    def report(self, name: str) -> dict[str, Any] | None:
        path = self.report_path(name)
        return json.loads(path.read_text()) if path.exists() else None


def _cut(value: Any) -> Any:
    if isinstance(value, str) and len(value) > LOG_TEXT_MAX:
        return value[:LOG_TEXT_MAX] + f"... ({len(value)} chars)"
    if isinstance(value, bytes):
        return _cut(value.decode("utf-8", "replace"))
    if isinstance(value, Mapping):
        return {k: _cut(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_cut(v) for v in value]
    return value
