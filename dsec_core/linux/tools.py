"""External programs: the one table of every program dsec, its plugins, benches and tests run
(``programs.txt``: program -> Debian package, which run.sh installs), running one with typed
failures (``run_tool``), and compiling a static C helper (``compile_static``)."""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import cache
from pathlib import Path

from ..errors import DsecError, ToolError

__all__ = [
    "PROGRAMS_FILE",
    "Program",
    "compile_static",
    "debian_package",
    "install_hint",
    "programs",
    "read_programs",
    "run_tool",
]

#: The table: one row a program (``program package purpose``), ``#`` comments. A package of
#: ``-`` is not from Debian (the purpose says where it comes from); a program of ``-`` is a
#: package some program needs besides itself (static glibc for ``gcc -static``, say). run.sh
#: reads the same file with awk, before any Python environment exists.
PROGRAMS_FILE = Path(__file__).with_name("programs.txt")


@dataclass(frozen=True)
class Program:
    """One row of the table: ``name`` None for a package needed by another program, ``package``
    None for a program that is not a Debian package's."""

    name: str | None
    package: str | None
    purpose: str


def read_programs(path: Path = PROGRAMS_FILE) -> tuple[Program, ...]:
    """Every row of the table at ``path``, in order."""
    rows = []
    for line in Path(path).read_text().splitlines():
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        name, package, *purpose = line.split(maxsplit=2)
        rows.append(
            Program(
                name=None if name == "-" else name,
                package=None if package == "-" else package,
                purpose=purpose[0].strip() if purpose else "",
            )
        )
    return tuple(rows)


@cache
def programs() -> Mapping[str, Program]:
    """The table's programs by name."""
    return {row.name: row for row in read_programs() if row.name is not None}


def debian_package(program: str) -> str | None:
    """The Debian package that has ``program`` (a name or a path), None if the table has no
    package for it."""
    row = programs().get(os.path.basename(program))
    return row.package if row is not None else None


def install_hint(program: str) -> str:
    """How to get ``program``: ``apt-get install <package>``, or what the table says."""
    row = programs().get(os.path.basename(program))
    if row is None:
        return f"{program} is not in dsec's table of programs"
    return f"apt-get install {row.package}" if row.package else row.purpose


def run_tool(
    command: Sequence[object],
    what: str,
    *,
    env: dict[str, str] | None = None,
    timeout: float | None = None,
    input: str | None = None,
    cwd: Path | None = None,
    error: type[ToolError] = ToolError,
) -> subprocess.CompletedProcess[str]:
    """Run an external program (``input`` on its stdin, else nothing); a non-zero exit raises
    ``error`` (a ``ToolError``, or a subclass the caller's domain names) with its output, a
    missing program one that says which package has it."""
    argv = [str(c) for c in command]
    try:
        proc = subprocess.run(
            argv,
            capture_output=True,
            text=True,
            errors="replace",
            env=env,
            cwd=cwd,
            timeout=timeout,
            **({"input": input} if input is not None else {"stdin": subprocess.DEVNULL}),
        )
    except FileNotFoundError as e:
        raise error(
            f"{what}: {argv[0]} is not installed ({install_hint(argv[0])})", command=argv
        ) from e
    except subprocess.TimeoutExpired as e:
        raise error(
            f"{what}: timed out after {timeout}s", command=argv, stderr=str(e.stderr or "")
        ) from e
    if proc.returncode != 0:
        raise error(
            f"{what} failed",
            command=argv,
            exit_code=proc.returncode,
            stdout=proc.stdout,
            stderr=proc.stderr,
        )
    return proc


def compile_static(
    sources: Sequence[Path],
    target: Path,
    what: str,
    *,
    flags: Sequence[str] = ("-O2", "-Wall", "-Werror"),
    missing: type[DsecError] = ToolError,
) -> Path:
    """Compile C ``sources`` into the static executable ``target`` with gcc (or cc) and return
    it. The build goes to a temporary name beside ``target`` that is renamed into place, so
    concurrent callers never see a half-written binary. ``flags`` come before the output and
    sources (``-I DIR``, ``-no-pie``, ...). No compiler raises ``missing`` (a ``ToolError``
    unless the caller says, a backend ``BackendUnavailable``) saying what to install; a failed
    build is a ``ToolError`` with gcc's output. ``what`` names the program in both."""
    compiler = shutil.which("gcc") or shutil.which("cc")
    if compiler is None:
        raise missing(
            f"building {what} needs gcc and static glibc (apt-get install gcc libc6-dev)",
            tool="gcc",
        )
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.{os.getpid()}.{os.urandom(4).hex()}.tmp")
    command = [compiler, "-static", *flags, "-o", os.fspath(tmp), *map(os.fspath, sources)]
    try:
        run_tool(command, f"building {what}")
        os.chmod(tmp, 0o755)
        os.rename(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)
    return target
