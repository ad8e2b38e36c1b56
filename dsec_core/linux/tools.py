"""External programs: the one table of every program dsec, its plugins, benches and tests run
(``programs.txt``: program -> Debian package, which run.sh installs), running one with typed
failures (``run_tool``), and compiling a static C helper (``compile_static``) through the
machine's build cache (``cached_build``), so a new node home copies what another already built
rather than compiling it again."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from functools import cache
from pathlib import Path

from ..errors import DiskFull, DsecError, ToolError

__all__ = [
    "PROGRAMS_FILE",
    "Program",
    "build_cache_dir",
    "build_key",
    "cached_build",
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


#: What programs print for ENOSPC (strerror's text).
NO_SPACE = "No space left on device"


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
    missing program one that says which package has it; ``DiskFull`` if it failed for want of
    room on a disk (it said so)."""
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
        if NO_SPACE in proc.stderr or NO_SPACE in proc.stdout:
            # the disk it wrote to is full: the node's condition, not the tool's failure
            raise DiskFull(
                f"{what} failed: no room left on the disk it wrote to",
                command=argv,
                exit_code=proc.returncode,
                stderr=proc.stderr[-2000:],
            )
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
    flags = list(flags)

    def build(out: Path) -> None:
        run_tool([compiler, "-static", *flags, "-o", out, *sources], f"building {what}")
        os.chmod(out, 0o755)

    key = build_key(["gcc -static", *flags], map(Path, sources), programs=[Path(compiler)])
    return cached_build(Path(target), key, build)


def build_cache_dir() -> Path | None:
    """``DSEC_BUILD_CACHE``: the machine's cache of what dsec compiles (the sandbox agent, guest
    programs, BPF objects), shared by every node home; ``off`` for none. Default
    ``/var/cache/dsec/builds`` for root, ``$XDG_CACHE_HOME/dsec/builds`` otherwise."""
    value = os.environ.get("DSEC_BUILD_CACHE", "")
    if value == "off":
        return None
    if value:
        return Path(value)
    if os.geteuid() == 0:
        return Path("/var/cache/dsec/builds")
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "dsec" / "builds"


def build_key(words: Iterable[str], files: Iterable[Path], *, programs: Iterable[Path] = ()) -> str:
    """A build's ``cached_build`` key: a digest over ``words`` (the command's fixed parts), each
    input file's name, size and bytes, and each program (the compiler) by its resolved path,
    size and mtime, which an upgrade changes."""
    h = hashlib.sha256()
    for word in words:
        h.update(b"w" + len(word).to_bytes(8, "little") + word.encode())
    for program in programs:
        real = os.path.realpath(program)
        st = os.stat(real)
        h.update(f"p{real}:{st.st_size}:{st.st_mtime_ns}".encode())
    for path in files:
        data = path.read_bytes()
        h.update(b"f" + path.name.encode() + b"\0" + len(data).to_bytes(8, "little") + data)
    return h.hexdigest()[:24]


def _place(source: Path, target: Path, tmp: Path) -> None:
    """``source``'s bytes at ``target``, through ``tmp`` and a rename (a hard link where both are
    on one filesystem, else a copy), so a reader never sees half a file."""
    try:
        os.link(source, tmp)
    except OSError:
        shutil.copy2(source, tmp)
    os.rename(tmp, target)


def cached_build(target: Path, key: str, build: Callable[[Path], None]) -> Path:
    """``target``, made by ``build(path)`` (which writes its output at ``path``) unless the
    build cache holds the output of the same ``key`` (a digest of everything the output depends
    on), which is then linked or copied into place. Both go through temporary names renamed
    into place, so concurrent callers never see half a file. Without a usable cache, ``build``
    writes beside ``target``."""
    target = Path(target)
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.{os.getpid()}.{os.urandom(4).hex()}.tmp")
    cache = build_cache_dir()
    cached = cache / f"{key}-{target.name}" if cache is not None else None
    try:
        if cached is not None and not cached.exists():
            try:
                cached.parent.mkdir(mode=0o755, parents=True, exist_ok=True)
            except OSError:
                cached = None
            if cached is not None and not os.access(cached.parent, os.W_OK):
                cached = None
        if cached is not None and not cached.exists():
            fresh = cached.with_name(f".{cached.name}.{os.getpid()}.{os.urandom(4).hex()}.tmp")
            try:
                build(fresh)
                os.rename(fresh, cached)
            finally:
                fresh.unlink(missing_ok=True)
        if cached is not None:
            _place(cached, target, tmp)
        else:
            build(tmp)
            os.rename(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)
    return target
