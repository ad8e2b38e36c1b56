"""Judge mode: compile a submission once in a warm FnCall member, then run it on each test case
with the case's own time and memory limits, and give each case a verdict (``VERDICTS``).

One submission holds one checked-out member of its project's pool (``Pools.checkout``:
``spec.project`` and ``spec.start`` as for an FnCall) from its first file to its last case;
many submissions are judged at once, one member each, as far as the pool's max allows (the rest
wait for a member as FnCalls do). The member is reset after the submission, whatever it did.

In order, inside the member's working directory:

1. ``cases_dir`` (if the cases are not sent with the request) is read: ``NAME.in`` and
   ``NAME.out`` pairs, in natural order. The directory is then removed from the member, so the
   submission cannot read the expected outputs (the reset brings it back for the next one); it
   must lie inside the working directory, which in a member is a fresh tmpfs work area.
2. ``files`` (the submission) are written; ``compile`` runs once with ``compile_timeout``. A
   non-zero exit or a timeout is a compile error (CE), and no case runs.
3. Each case runs ``run`` with the case's input on stdin, alone in the sandbox (``exclusive``:
   whatever the compile or the case before left is killed first):

   - memory: where the backend has ``Feature.MEMORY_WINDOW`` (the container and fncall
     backends), the sandbox's memory cgroup is lowered for the case to what the sandbox uses
     plus ``memory_limit``; the OOM killer taking a process of the case is MLE. Elsewhere
     only the peak resident set the agent reports (``max_rss``) decides, after the fact.
   - time: ``time_limit`` is CPU seconds (user + system, from the agent's ``wait4``); the wall
     clock kills the case at ``max(2 * time_limit, time_limit + 1)`` s, so a program that
     sleeps or blocks is TLE too.
   - then, in this order: MLE, TLE, RE (a non-zero exit or a signal), WA (output differs, by
     ``compare``: see ``COMPARE_MODES``; output past twice the expected size plus 64 KiB is
     cut and counts as WA), else AC.

A case that kills what runs it (``kill -9 -1`` takes the agent's handler of the exec) is RE,
and the next case runs as usual; a member that dies under a case gives that case and every one
after it RE, and the pool replaces the member.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import time
from collections.abc import AsyncIterator, Sequence

from ..backend import Feature, MemoryWindowUse
from ..errors import DsecError, InvalidSpec, SandboxError
from ..records import (
    CaseResult,
    ExecResult,
    JudgeCase,
    JudgeResult,
    JudgeSpec,
)
from .host import CommandHost
from .pools import Checkout, Pools

__all__ = ["KEEP_OUTPUT", "judge", "memory_window", "outputs_match", "verdict_of"]

#: How much of a case's stdout and stderr its result keeps.
KEEP_OUTPUT = 4096
#: The agent keeps at most this much of each output stream.
MAX_CASE_OUTPUT = 16 << 20


# --- pure logic ---------------------------------------------------------------------------
def outputs_match(got: bytes, expected: bytes, compare: str = "lines") -> bool:
    """Whether a case's output is right (see ``COMPARE_MODES``)."""
    if compare == "exact":
        return got == expected
    if compare == "tokens":
        return got.split() == expected.split()
    if compare == "lines":
        return _lines(got) == _lines(expected)
    raise InvalidSpec(f"unknown compare mode {compare!r}", field="compare")


def _lines(data: bytes) -> list[bytes]:
    lines = [line.rstrip() for line in data.splitlines()]
    while lines and not lines[-1]:
        lines.pop()
    return lines


def verdict_of(
    r: ExecResult,
    use: MemoryWindowUse | None,
    expected: bytes,
    *,
    time_limit: float,
    memory_limit: int,
    compare: str = "lines",
) -> tuple[str, str]:
    """(verdict, why) of one case run ``r`` (``use``: its memory window, None without one)."""
    if (use is not None and use.oom_kills) or (
        use is None and r.max_rss is not None and r.max_rss > memory_limit
    ):
        return "MLE", f"over {memory_limit >> 20} MiB" + (
            f" (peak {r.max_rss >> 20} MiB)" if r.max_rss else ""
        )
    if r.timed_out:
        return "TLE", f"killed after {r.duration:.2f} s of wall time"
    if r.cpu_time is not None and r.cpu_time > time_limit:
        return "TLE", f"{r.cpu_time:.2f} s of CPU, limit {time_limit:g} s"
    if r.exit_code != 0:
        return "RE", _exit_text(r.exit_code)
    if r.truncated:
        return "WA", "output far longer than expected"
    if not outputs_match(r.stdout, expected, compare):
        return "WA", "output differs"
    return "AC", ""


def _exit_text(code: int) -> str:
    if code > 128:
        with contextlib.suppress(ValueError):
            return f"killed by {signal.Signals(code - 128).name}"
    return f"exit {code}"


def _natural(name: str) -> list[int | str]:
    return [int(p) if p.isdigit() else p for p in re.split(r"(\d+)", name)]


# --- judging ------------------------------------------------------------------------------
async def judge(host: CommandHost, pools: Pools, spec: JudgeSpec) -> JudgeResult:
    """Judge one submission in a checked-out member of the environment's pool (commands and
    files go through ``host``)."""
    t0 = time.monotonic()
    async with pools.checkout(
        spec.environment,
        spec.backend,
        spec.cpu,
        spec.memory,
        spec.devices,
        project=spec.project,
        start=spec.start,
    ) as m:
        cases = list(spec.cases) or await _take_cases(host, m, spec.cases_dir or "")
        cases = [c if c.name else _named(c, i) for i, c in enumerate(cases, 1)]
        if spec.files:
            await pools.write_files(m.sid, m.workdir, spec.files)
        where = {"member": m.sid, "pool": m.pool.name, "wait": m.wait}
        compile_output, compile_time = b"", 0.0
        if spec.compile:
            try:
                c = await host.exec(
                    m.sid,
                    _argv(spec.compile),
                    timeout=spec.compile_timeout,
                    env=dict(spec.env) or None,
                    max_output=1 << 20,
                    exclusive=True,
                )
            except SandboxError as e:
                await m.check()
                c = ExecResult(exit_code=-1, stdout=b"", stderr=str(e).encode(), duration=0.0)
            compile_output, compile_time = (c.stdout + c.stderr)[-65536:], c.duration
            if not c.ok:
                why = f"timed out after {c.duration:.1f} s\n".encode() if c.timed_out else b""
                return JudgeResult(
                    verdict="CE",
                    total=len(cases),
                    compile_output=why + compile_output,
                    compile_time=compile_time,
                    duration=time.monotonic() - t0,
                    **where,  # type: ignore[arg-type]
                )
        results = await _run_cases(host, m, spec, cases)
    first_bad = next((r.verdict for r in results if r.verdict != "AC"), None)
    return JudgeResult(
        verdict=first_bad or "AC",
        cases=tuple(results),
        passed=sum(r.verdict == "AC" for r in results),
        total=len(cases),
        compile_output=compile_output,
        compile_time=compile_time,
        duration=time.monotonic() - t0,
        **where,  # type: ignore[arg-type]
    )


def _named(case: JudgeCase, i: int) -> JudgeCase:
    return JudgeCase(input=case.input, output=case.output, name=str(i))


def _argv(cmd: str | Sequence[str]) -> list[str]:
    return ["/bin/sh", "-c", cmd] if isinstance(cmd, str) else list(cmd)


async def _take_cases(host: CommandHost, m: Checkout, cases_dir: str) -> list[JudgeCase]:
    """Read the cases from the member, then remove them from it (see the module docstring)."""
    path = os.path.join(m.workdir, os.path.normpath(cases_dir))
    try:
        entries = await host.list_dir(m.sid, path)
    except DsecError as e:
        raise InvalidSpec(f"judge: cannot list cases_dir {path}: {e}", field="cases_dir") from e
    names = {e.name for e in entries if e.type == "file"}
    stems = sorted((n[:-3] for n in names if n.endswith(".in")), key=_natural)
    if not stems:
        raise InvalidSpec(f"judge: no NAME.in files in {path}", field="cases_dir")
    missing = [s for s in stems if f"{s}.out" not in names]
    if missing:
        raise InvalidSpec(
            f"judge: cases without an expected output ({path}/NAME.out): {missing[:10]}",
            field="cases_dir",
        )
    cases = [
        JudgeCase(
            input=await host.read_file(m.sid, f"{path}/{s}.in"),
            output=await host.read_file(m.sid, f"{path}/{s}.out"),
            name=s,
        )
        for s in stems
    ]
    await host.remove(m.sid, path, recursive=True)
    return cases


async def _run_cases(
    host: CommandHost, m: Checkout, spec: JudgeSpec, cases: list[JudgeCase]
) -> list[CaseResult]:
    results: list[CaseResult] = []
    limit = spec.memory_bytes
    argv = _argv(spec.run)
    dead = ""
    for case in cases:
        if dead or (spec.stop_on_failure and results and results[-1].verdict != "AC"):
            results.append(
                CaseResult(case.name, "RE" if dead else "SKIPPED", -1, 0.0, 0.0, detail=dead)
            )
            continue
        cap = min(MAX_CASE_OUTPUT, 2 * len(case.output) + (64 << 10))
        try:
            async with memory_window(host, m.sid, limit) as use:
                r = await host.exec(
                    m.sid,
                    argv,
                    timeout=spec.wall_limit,
                    env=dict(spec.env) or None,
                    stdin=case.input,
                    max_output=cap,
                    exclusive=True,
                )
        except SandboxError as e:
            # the case killed the agent's handler of it (``kill -9 -1``), or the member itself
            # died: a runtime error either way, and for every case after it in the second
            if await m.check():
                why = f"the case killed what ran it: {e}"
            else:
                why = dead = f"the member died under the case: {e}"
            results.append(CaseResult(case.name, "RE", -1, 0.0, 0.0, detail=why))
            continue
        verdict, why = verdict_of(
            r,
            use,
            case.output,
            time_limit=spec.time_limit,
            memory_limit=limit,
            compare=spec.compare,
        )
        results.append(
            CaseResult(
                name=case.name,
                verdict=verdict,
                exit_code=r.exit_code,
                time=r.cpu_time if r.cpu_time is not None else r.duration,
                wall=r.duration,
                memory=r.max_rss,
                stdout=r.stdout[:KEEP_OUTPUT],
                stderr=r.stderr[:KEEP_OUTPUT],
                detail=why,
            )
        )
    return results


@contextlib.asynccontextmanager
async def memory_window(
    host: CommandHost, sid: str, extra: int
) -> AsyncIterator[MemoryWindowUse | None]:
    """Sandbox ``sid``'s memory held, for the body, to what it uses plus ``extra`` bytes
    (where its backend has ``Feature.MEMORY_WINDOW``; None is yielded elsewhere)."""
    sb = host.sandbox(sid)
    if Feature.MEMORY_WINDOW not in sb.backend.features:
        yield None
        return
    async with sb.backend.memory_window(sb.rt, sb.backend_state, extra) as use:
        yield use
