"""Running one ``CodeRun`` (SandboxFusion's ``/run_code``, ``dsec_core.fusion``) in a warm FnCall
member, as judge mode runs one case: a member of the environment's pool for the project is
checked out, the files are written, the compile command runs once (a non-zero exit or its
timeout ends the run: ``run`` stays None), then the program with its stdin, alone in the
member (``exclusive``), killed with its process tree at its wall-clock timeout, and, where the
backend has ``Feature.MEMORY_WINDOW``, in a memory window of ``memory_limit`` bytes that the
kernel enforces (judge mode's). The fetched files are read before the member is given back and
reset.
"""

from __future__ import annotations

import os

from ..errors import DsecError, SandboxError
from ..fusion import KEEP_OUTPUT, CodeRun, CodeRunResult, StageResult
from ..records import ExecResult
from .host import CommandHost
from .judge import memory_window
from .pools import Checkout, Pools

__all__ = ["run_code"]


async def run_code(host: CommandHost, pools: Pools, spec: CodeRun) -> CodeRunResult:
    """Run ``spec`` in a checked-out member of its environment's pool (commands and files
    through ``host``)."""
    async with pools.checkout(
        spec.environment,
        "fncall",
        spec.cpu,
        spec.memory,
        project=spec.project,
        start=spec.start,
    ) as m:
        await pools.write_files(m.sid, m.workdir, spec.files)
        compiled = None
        if spec.compile:
            compiled = await _stage(host, m, spec.compile, spec.compile_timeout, b"", None)
            if not compiled.ok:
                return CodeRunResult(compiled, None, await _fetch(host, m, spec), m.sid)
        ran = await _stage(host, m, spec.run, spec.run_timeout, spec.stdin, spec.memory_limit)
        return CodeRunResult(compiled, ran, await _fetch(host, m, spec), m.sid)


async def _stage(
    host: CommandHost,
    m: Checkout,
    cmd: str,
    timeout: float,
    stdin: bytes,
    memory_limit: int | None,
) -> StageResult:
    argv = ["/bin/sh", "-c", cmd]
    oom = False
    try:
        if memory_limit is None:
            r = await _exec(host, m, argv, timeout, stdin)
        else:
            async with memory_window(host, m.sid, memory_limit) as use:
                r = await _exec(host, m, argv, timeout, stdin)
            oom = bool(use and use.oom_kills)
    except SandboxError as e:
        # the program killed what ran it (``kill -9 -1``), or the member died under it
        alive = await m.check()
        why = "the program killed what ran it" if alive else "the member died under it"
        return StageResult("Error", 0.0, None, b"", f"{why}: {e}\n".encode())
    if r.timed_out:
        return StageResult("TimeLimitExceeded", r.duration, None, r.stdout, r.stderr, r.cpu_time)
    stderr = r.stderr
    if oom:  # SandboxFusion has no status of its own for it: the exit says killed, this why
        stderr += f"\nkilled: over the memory limit of {memory_limit} bytes\n".encode()
    return StageResult("Finished", r.duration, r.exit_code, r.stdout, stderr, r.cpu_time)


async def _exec(
    host: CommandHost, m: Checkout, argv: list[str], timeout: float, stdin: bytes
) -> ExecResult:
    return await host.exec(
        m.sid, argv, timeout=timeout, stdin=stdin, max_output=KEEP_OUTPUT, exclusive=True
    )


async def _fetch(host: CommandHost, m: Checkout, spec: CodeRun) -> dict[str, bytes]:
    """The fetched files that exist (SandboxFusion leaves a missing one out)."""
    found = {}
    for path in spec.fetch_files:
        try:
            found[path] = await host.read_file(m.sid, os.path.join(m.workdir, path))
        except DsecError:
            continue
    return found
