"""Trajectory logs: every command a rollout loop ran, and its result, append-only on disk.

A loop names its trajectory and numbers its commands (``step`` 0, 1, ...). The node runs a step
it has not logged and appends it; a step it has logged is answered from the log (``replayed``),
without running anything, provided it is the same command (else ``TrajectoryDiverged``). So a
loop that restarts from its beginning, after a preemption killed it or in a new process,
fast-forwards through what it already did and goes on from there.

One file per trajectory, ``<dir>/<name>.jsonl``: a JSON object per line (the entry, with the
result's bytes in base64), each written with one ``write`` and ``fdatasync``-ed before the
caller sees the result, so what a loop saw is in the log even if the node dies next. A line cut
short by a crash is not an entry.

A step is marked before its command starts (``<name>.running``, beside the log) and the mark
goes once its result is logged. A mark a daemon left (it died while the step ran, or the
sandbox's agent stopped answering) means the command may have run, wholly or in part: that
step is ``StepInterrupted`` from then on, never run a second time.
"""

from __future__ import annotations

import asyncio
import collections
import json
import os
import time
from collections.abc import Awaitable, Callable
from dataclasses import replace
from pathlib import Path

from ..api.routes import dump_json
from ..api.shapes import decoder, encoder
from ..errors import (
    InvalidSpec,
    SandboxNotRunning,
    SandboxPaused,
    StepInterrupted,
    TrajectoryDiverged,
    UnknownSandbox,
)
from ..records import ExecResult, TrajectoryEntry, check_trajectory_name

__all__ = ["CACHED", "TrajectoryLogs"]

#: How many trajectories' steps the node keeps in memory (the least recently used are read
#: from their files again when next needed).
CACHED = 256

#: Errors of ``execute`` that say the command never started: the step's mark goes with them.
NOT_STARTED = (InvalidSpec, SandboxNotRunning, SandboxPaused, UnknownSandbox, TrajectoryDiverged)

_encode = encoder(TrajectoryEntry)
_decode = decoder(TrajectoryEntry, strict=False)


class TrajectoryLogs:
    """The node's trajectory logs, under ``directory``."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self._entries: collections.OrderedDict[str, list[TrajectoryEntry]] = (
            collections.OrderedDict()
        )
        self._locks: dict[str, asyncio.Lock] = {}

    def path(self, name: str) -> Path:
        return self.directory / f"{check_trajectory_name(name)}.jsonl"

    def entries(self, name: str) -> list[TrajectoryEntry]:
        """The steps logged for ``name``, in order (none if it has no log)."""
        if name in self._entries:
            self._entries.move_to_end(name)
        else:
            self._entries[name] = self._read(self.path(name))
            while len(self._entries) > CACHED:
                old, _ = self._entries.popitem(last=False)
                lock = self._locks.get(old)
                if lock is not None and not lock.locked():
                    del self._locks[old]
        return self._entries[name]

    @staticmethod
    def _read(path: Path) -> list[TrajectoryEntry]:
        out: list[TrajectoryEntry] = []
        try:
            lines = path.read_bytes().split(b"\n")
        except FileNotFoundError:
            return out
        for line in lines:
            if not line.strip():
                continue
            try:
                entry = _decode(json.loads(line), "entry")
            except (ValueError, InvalidSpec):
                break  # cut short by a crash: nothing after it was acknowledged
            if entry.step != len(out):
                break
            out.append(entry)
        return out

    async def run(
        self,
        name: str,
        step: int | None,
        sandbox_id: str,
        command: str,
        execute: Callable[[], Awaitable[ExecResult]],
    ) -> ExecResult:
        """The result of ``command`` at ``step`` of trajectory ``name``: from the log if that
        step is logged (``replayed``), else ``execute()``'s, appended first. ``step`` None:
        the next one. Steps of one trajectory run one at a time."""
        lock = self._locks.setdefault(name, asyncio.Lock())
        async with lock:
            logged = self.entries(name)
            if step is None:
                step = len(logged)
            if not isinstance(step, int) or isinstance(step, bool) or step < 0:
                raise InvalidSpec(
                    f"step must be a non-negative integer, got {step!r}", field="step"
                )
            if step < len(logged):
                entry = logged[step]
                if entry.command != command:
                    raise TrajectoryDiverged(
                        f"trajectory {name} step {step}: logged {entry.command!r}, now {command!r}",
                        trajectory=name,
                        step=step,
                        logged=entry.command,
                        command=command,
                    )
                return _replayed(entry.result)
            if step > len(logged):
                raise InvalidSpec(
                    f"trajectory {name} has {len(logged)} steps: step {step} would leave a gap",
                    field="step",
                )
            mark = self.path(name).with_suffix(".running")
            left = _read_mark(mark)
            if left is not None and left.get("step") == step:
                raise StepInterrupted(
                    f"trajectory {name} step {step} ({left.get('command', '')!r}) was started "
                    "by a node daemon that stopped, or lost its sandbox, before its result was "
                    "logged: whether it ran is unknown, so it is not run again",
                    trajectory=name,
                    step=step,
                    sandbox_id=left.get("sandbox_id", sandbox_id),
                )
            self._mark(mark, {"step": step, "command": command, "sandbox_id": sandbox_id})
            try:
                result = await execute()
            except NOT_STARTED:
                mark.unlink(missing_ok=True)
                raise
            entry = TrajectoryEntry(step, sandbox_id, command, result, time.time())
            await asyncio.to_thread(self._append, self.path(name), entry)
            logged.append(entry)
            mark.unlink(missing_ok=True)
            return result

    def _mark(self, mark: Path, doc: dict[str, object]) -> None:
        """Mark a step as started: one write, no sync (a daemon killed keeps what it wrote in
        the page cache; a machine that crashes takes its sandboxes with it)."""
        self.directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        fd = os.open(mark, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        try:
            os.write(fd, dump_json(doc))
        finally:
            os.close(fd)

    def _append(self, path: Path, entry: TrajectoryEntry) -> None:
        self.directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        line = dump_json(_encode(entry) if _encode else entry) + b"\n"
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            os.write(fd, line)
            os.fdatasync(fd)
        finally:
            os.close(fd)

    def remove(self, name: str) -> bool:
        """Forget trajectory ``name``; whether it had a log."""
        self._entries.pop(name, None)
        lock = self._locks.get(name)
        if lock is not None and not lock.locked():
            del self._locks[name]
        self.path(name).with_suffix(".running").unlink(missing_ok=True)
        try:
            self.path(name).unlink()
        except FileNotFoundError:
            return False
        return True


def _read_mark(mark: Path) -> dict | None:
    """What a step's mark says, None without one (or one cut short: it never started)."""
    try:
        doc = json.loads(mark.read_bytes())
    except (FileNotFoundError, ValueError):
        return None
    return doc if isinstance(doc, dict) else None


def _replayed(result: ExecResult) -> ExecResult:
    return replace(result, replayed=True)
