"""Running external programs (mkfs.erofs, debootstrap, umount, ...) with typed failures."""

from __future__ import annotations

import subprocess
from collections.abc import Sequence

from ..errors import ToolError

__all__ = ["run_tool"]


def run_tool(
    command: Sequence[object],
    what: str,
    *,
    env: dict[str, str] | None = None,
    timeout: float | None = None,
    input: str | None = None,
) -> subprocess.CompletedProcess[str]:
    """Run an external program (``input`` on its stdin, else nothing); a non-zero exit raises
    ``ToolError`` with its output."""
    argv = [str(c) for c in command]
    try:
        proc = subprocess.run(
            argv,
            capture_output=True,
            text=True,
            errors="replace",
            env=env,
            timeout=timeout,
            **({"input": input} if input is not None else {"stdin": subprocess.DEVNULL}),
        )
    except FileNotFoundError as e:
        raise ToolError(f"{what}: {argv[0]} is not installed", command=argv) from e
    except subprocess.TimeoutExpired as e:
        raise ToolError(
            f"{what}: timed out after {timeout}s", command=argv, stderr=str(e.stderr or "")
        ) from e
    if proc.returncode != 0:
        raise ToolError(
            f"{what} failed",
            command=argv,
            exit_code=proc.returncode,
            stdout=proc.stdout,
            stderr=proc.stderr,
        )
    return proc
