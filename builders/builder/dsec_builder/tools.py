"""The build session's tools, one interface for every driver: the MCP server, the scripted
plan driver and the CLI all call ``BuildTools.call(name, args)``.

Each tool takes and returns JSON values. An unknown tool or a bad argument is a
``BuildToolError`` raised before anything runs, so the session is as it was; a command that
fails inside the sandbox is not an error of the tool (its exit code is in the result). Every
call, failed or not, goes to the build's log.
"""

from __future__ import annotations

import base64
import builtins
import inspect
import types
import typing
from collections.abc import Callable, Mapping
from typing import Any

from dsec_core.errors import DsecError

from .errors import BuildToolError
from .qa import DEFAULT_MAX_BYTES, Check
from .session import BuildSession

__all__ = ["TOOL_NAMES", "BuildTools"]

#: The tools a build session offers, in the order they are listed.
TOOL_NAMES = ("exec", "session_exec", "read", "write", "list", "finish")


def _result(r: Any) -> dict[str, Any]:
    return {
        "exit_code": r.exit_code,
        "stdout": r.stdout.decode("utf-8", "replace"),
        "stderr": r.stderr.decode("utf-8", "replace"),
        "timed_out": r.timed_out,
        "truncated": r.truncated,
    }


class BuildTools:
    """The tools of one build session (``TOOL_NAMES``); call them with ``call``."""

    def __init__(self, session: BuildSession) -> None:
        self.session = session

    # --- the tools (docstrings are what an MCP client shows) ------------------------------
    def exec(self, command: str, timeout: float = 300.0, cwd: str | None = None) -> dict[str, Any]:
        """Run a shell command in the build sandbox (a fresh shell each call); returns
        exit_code, stdout, stderr, timed_out."""
        return _result(self.session.exec(command, timeout=timeout, cwd=cwd))

    def session_exec(
        self, command: str, session: str | None = None, timeout: float = 300.0
    ) -> dict[str, Any]:
        """Run a command in a persistent shell session (cwd and variables carry over between
        calls); without ``session``, the build's own. Returns the session id with the result."""
        sid, r = self.session.session_exec(command, session=session, timeout=timeout)
        return {"session": sid, **_result(r)}

    def read(self, path: str) -> dict[str, Any]:
        """Read a file of the build sandbox: UTF-8 text as ``content``, other bytes as base64
        (``encoding`` says which)."""
        data = self.session.read(path)
        try:
            return {"path": path, "content": data.decode("utf-8"), "encoding": "utf-8"}
        except UnicodeDecodeError:
            text = base64.b64encode(data).decode()
            return {"path": path, "content": text, "encoding": "base64"}

    def write(
        self, path: str, content: str, encoding: str = "utf-8", mode: str = "0644"
    ) -> dict[str, Any]:
        """Write a file in the build sandbox (parents must exist): ``content`` as UTF-8 text,
        or base64 with ``encoding`` "base64"; ``mode`` in octal. Notes meant for the builder
        only belong under /.dsec-build, which is scrubbed before packing."""
        if encoding not in ("utf-8", "base64"):
            raise BuildToolError(
                f"write: encoding must be utf-8 or base64, got {encoding!r}", tool="write"
            )
        try:
            mode_bits = int(mode, 8)
        except ValueError:
            raise BuildToolError(f"write: mode {mode!r} is not octal", tool="write") from None
        try:
            data = base64.b64decode(content, validate=True) if encoding == "base64" else content
        except ValueError as e:
            raise BuildToolError(f"write: content is not base64: {e}", tool="write") from None
        self.session.write(path, data, mode=mode_bits)
        size = len(data.encode() if isinstance(data, str) else data)
        return {"path": path, "bytes": size}

    def list(self, path: str = "/") -> dict[str, Any]:
        """List a directory of the build sandbox: name, type, size and mode of each entry."""
        entries = self.session.list(path)
        return {
            "path": path,
            "entries": [
                {"name": e.name, "type": e.type, "size": e.size, "mode": oct(e.mode)}
                for e in entries
            ],
        }

    def finish(
        self,
        checks: builtins.list[dict[str, Any]] | None = None,
        task: dict[str, Any] | None = None,
        max_bytes: int | str = DEFAULT_MAX_BYTES,
        publish: str | None = None,
    ) -> dict[str, Any]:
        """Scrub, pack (staged, leak-scanned), QA and publish the build. ``checks``:
        [{name, command}] that must exit 0 in a fresh sandbox; ``task``: {name, command,
        reward, report, tests: {path: text}, reference: {path: text}, secrets: [text]} whose
        reference must pass and unmodified workspace fail; ``max_bytes``: size budget;
        ``publish``: a layer source URL to publish to as well."""
        parsed = [Check.from_dict(c, f"checks[{i}]") for i, c in enumerate(checks or [])]
        done = self.session.finish(checks=parsed, task=task, max_bytes=max_bytes, publish=publish)
        return done.to_dict()

    # --- dispatch -------------------------------------------------------------------------
    def method(self, name: str) -> Callable[..., Any]:
        """The tool ``name``; ``BuildToolError`` naming the known ones if there is none."""
        if name not in TOOL_NAMES:
            raise BuildToolError(
                f"unknown tool {name!r}; known: {', '.join(TOOL_NAMES)}",
                tool=name,
                known=list(TOOL_NAMES),
            )
        return typing.cast(Callable[..., Any], getattr(self, name))

    def call(self, name: str, args: Mapping[str, Any] | None = None) -> Any:
        """Run tool ``name`` with ``args``, checked against its signature first; logged."""
        args = dict(args or {})
        try:
            fn = self.method(name)
            check_args(name, fn, args)
            result = fn(**args)
        except DsecError as e:
            self.session.log(name, args, error=f"{type(e).__name__}: {e}")
            raise
        if name != "finish":  # finish logs its own outcome
            self.session.log(name, args, result)
        return result


def check_args(tool: str, fn: Callable[..., Any], args: Mapping[str, Any]) -> None:
    """``BuildToolError`` unless ``args`` fit ``fn``'s parameters: none unknown or missing,
    each of its annotated JSON type."""
    params = inspect.signature(fn).parameters
    hints = typing.get_type_hints(fn)
    unknown = sorted(set(args) - set(params))
    if unknown:
        raise BuildToolError(
            f"{tool}: unknown argument(s) {unknown}; it takes {', '.join(params)}",
            tool=tool,
            arguments=unknown,
        )
    missing = [
        p for p, v in params.items() if v.default is inspect.Parameter.empty and p not in args
    ]
    if missing:
        raise BuildToolError(f"{tool}: missing argument(s) {missing}", tool=tool, arguments=missing)
    for key, value in args.items():
        if not _fits(value, hints.get(key, Any)):
            raise BuildToolError(
                f"{tool}: argument {key!r} must be {_shown(hints[key])}, got "
                f"{type(value).__name__}",
                tool=tool,
                arguments=[key],
            )


def _fits(value: Any, hint: Any) -> bool:
    origin = typing.get_origin(hint)
    if hint is Any:
        return True
    if origin in (typing.Union, types.UnionType):
        return any(_fits(value, h) for h in typing.get_args(hint))
    if hint is type(None):
        return value is None
    if origin is not None:
        hint = origin
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, hint)


def _shown(hint: Any) -> str:
    return str(hint).replace("typing.", "")
