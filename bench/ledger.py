"""The benches' ledger: every bench run leaves one JSON object a line in
``bench/results/ledger.jsonl`` (committed), with its figures, the commit, and the machine it ran
on, so that ``bench/compare.py`` can set each figure against the run before it.

    python bench/ledger.py run bench/create.py --quick     # run one bench, record it
    python bench/ledger.py show [BENCH]                    # the entries, newest last

``run.sh bench`` records every bench it runs this way. A bench that exits non-zero, or whose last
line is not one JSON object, is recorded as failed (with the tail of its stderr), never skipped.
Calibrations (``bench/compare.py --calibrate``) are entries too: several runs at one commit and
the spread of each figure over them, the noise a later comparison allows for.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import hashlib
import json
import os
import platform
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

BENCH_DIR = Path(__file__).resolve().parent
REPO = BENCH_DIR.parent
#: The ledger itself: one JSON object a line, appended to, committed with the code it measured.
LEDGER = BENCH_DIR / "results" / "ledger.jsonl"
#: Bumped when an entry's fields change meaning; readers skip entries of a newer schema.
SCHEMA = 1
#: How much of a failed bench's stderr its entry keeps.
ERROR_TAIL = 2000


@dataclass(frozen=True)
class Machine:
    """What a figure depends on that is not the code: figures of two machines are not compared
    as if they were one (``fingerprint`` tells them apart)."""

    cores: int
    memory_mib: int
    kernel: str
    cpu: str

    @property
    def fingerprint(self) -> str:
        blob = json.dumps(dataclasses.asdict(self), sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:12]

    @classmethod
    def this(cls) -> Machine:
        cpu = ""
        try:
            for line in Path("/proc/cpuinfo").read_text().splitlines():
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
        except OSError:
            pass
        memory = 0
        try:
            for line in Path("/proc/meminfo").read_text().splitlines():
                if line.startswith("MemTotal:"):
                    memory = int(line.split()[1]) // 1024
                    break
        except OSError:
            pass
        return cls(
            cores=os.cpu_count() or 0,
            memory_mib=memory,
            kernel=platform.release(),
            cpu=cpu or platform.machine(),
        )


@dataclass(frozen=True)
class Entry:
    """One line of the ledger: a bench run (``kind="run"``) or a calibration (``"calibration"``:
    ``figures`` the median of ``runs`` runs at one commit, ``noise`` each figure's spread)."""

    bench: str
    status: str  # "ok" or "failed"
    figures: dict[str, Any]
    commit: str
    dirty: bool
    time: str  # UTC, ISO 8601 to the second
    quick: bool
    args: tuple[str, ...]
    machine: Machine
    seconds: float = 0.0
    exit_code: int = 0
    error: str | None = None
    #: the 1-minute load average when the run began and ended: how busy the machine was
    load: tuple[float, float] = (0.0, 0.0)
    kind: str = "run"
    #: a calibration's relative spread per figure, (max - min) / |median| over its runs
    noise: dict[str, float] = field(default_factory=dict)
    runs: int = 1
    #: the calibration a run belongs to (its entries and the calibration's share it)
    calibration: str | None = None

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    @property
    def mode(self) -> str:
        return "quick" if self.quick else "full"

    def to_json(self) -> str:
        d = dataclasses.asdict(self)
        d["machine"]["fingerprint"] = self.machine.fingerprint
        return json.dumps({"schema": SCHEMA, **d}, sort_keys=False, separators=(",", ":"))

    @classmethod
    def from_json(cls, line: str) -> Entry:
        d = json.loads(line)
        d.pop("schema", None)
        m = d.pop("machine")
        m.pop("fingerprint", None)
        known = {f.name for f in dataclasses.fields(cls)}
        d = {k: v for k, v in d.items() if k in known}
        d["args"] = tuple(d.get("args", ()))
        d["load"] = tuple(d.get("load", (0.0, 0.0)))
        return cls(machine=Machine(**m), **d)


def bench_name(script: str | os.PathLike[str]) -> str:
    """``bench/create.py``, ``create.py`` and ``create`` all name the bench ``create``."""
    return Path(script).name.removesuffix(".py")


def bench_script(name: str) -> Path:
    """The script of a bench named as a path (``bench/create.py``) or by name (``create``)."""
    if name.endswith(".py") and Path(name).is_file():
        return Path(name).resolve()
    path = BENCH_DIR / f"{bench_name(name)}.py"
    if not path.is_file():
        raise SystemExit(f"no bench {name!r}: {path} does not exist")
    return path


def utc_now() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def load_1m() -> float:
    try:
        return os.getloadavg()[0]
    except OSError:
        return 0.0


def git_state(repo: Path = REPO) -> tuple[str, bool]:
    """The commit checked out and whether the tracked files differ from it (the ledger's own
    directory aside: ``run.sh bench`` appends to it between benches)."""

    def git(*args: str) -> str:
        out = subprocess.run(["git", *args], cwd=repo, capture_output=True, text=True)
        if out.returncode != 0:
            raise OSError(out.stderr.strip())
        return out.stdout.strip()

    try:
        commit = git("rev-parse", "HEAD")
        changed = git("status", "--porcelain", "--untracked-files=no", "--", ".",
                      ":(exclude)bench/results")  # fmt: skip
    except OSError:
        return "unknown", False
    return commit, bool(changed)


def final_json(stdout: str) -> dict[str, Any] | None:
    """The bench's figures: its last non-blank line, if that is one JSON object."""
    lines = [ln for ln in stdout.splitlines() if ln.strip()]
    if not lines:
        return None
    try:
        value = json.loads(lines[-1])
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


def append(entry: Entry, ledger: Path = LEDGER) -> None:
    ledger.parent.mkdir(parents=True, exist_ok=True)
    # one write of one line: concurrent appenders (O_APPEND) never interleave within it
    with open(ledger, "a") as f:
        f.write(entry.to_json() + "\n")


def read(ledger: Path = LEDGER) -> list[Entry]:
    """Every entry, oldest first by its time (a merge of two branches' ledgers, which git
    does by keeping both sides' lines, need not be in order; entries of one time keep their
    order in the file). A line of a newer schema is skipped; one that does not parse (a merge
    gone wrong) is skipped with a word on stderr rather than hiding the rest."""
    if not ledger.exists():
        return []
    out = []
    for n, line in enumerate(ledger.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            if json.loads(line).get("schema", 1) > SCHEMA:
                continue
            out.append(Entry.from_json(line))
        except (ValueError, TypeError, KeyError) as e:
            print(f"ledger: {ledger}:{n} skipped ({type(e).__name__}: {e})", file=sys.stderr)
    return sorted(out, key=lambda e: e.time)


def _tee(src: IO[str], sinks: Sequence[IO[str]], keep: list[str]) -> None:
    for line in src:
        keep.append(line)
        for s in sinks:
            s.write(line)
            s.flush()


def run_bench(script: Path, args: Sequence[str], *, echo: bool = True) -> Entry:
    """Run one bench (this Python, the repository as working directory), its output shown as it
    comes, and return its entry (not yet appended)."""
    commit, dirty = git_state()
    started, load0 = time.monotonic(), load_1m()
    when = utc_now()
    proc = subprocess.Popen(
        [sys.executable, os.fspath(script), *args],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        bufsize=1,
    )
    assert proc.stdout is not None and proc.stderr is not None
    out: list[str] = []
    err: list[str] = []
    threads = [
        threading.Thread(target=_tee, args=(proc.stdout, [sys.stdout] if echo else [], out)),
        threading.Thread(target=_tee, args=(proc.stderr, [sys.stderr] if echo else [], err)),
    ]
    for t in threads:
        t.start()
    try:
        code = proc.wait()
    except KeyboardInterrupt:
        proc.wait()
        raise
    for t in threads:
        t.join()
    figures = final_json("".join(out))
    error = None
    if code != 0:
        error = f"exit code {code}: " + "".join(err)[-ERROR_TAIL:].strip()
    elif figures is None:
        error = "its last line is not one JSON object: " + "".join(out)[-ERROR_TAIL:].strip()
    return Entry(
        bench=bench_name(script),
        status="ok" if error is None else "failed",
        figures=figures or {},
        commit=commit,
        dirty=dirty,
        time=when,
        quick="--quick" in args,
        args=tuple(args),
        machine=Machine.this(),
        seconds=round(time.monotonic() - started, 1),
        exit_code=code,
        error=error,
        load=(round(load0, 2), round(load_1m(), 2)),
    )


def leaves(figures: dict[str, Any], prefix: str = "") -> Iterator[tuple[str, float]]:
    """Every number of a bench's figures, nested ones as ``outer.inner`` (booleans, strings and
    nulls are not figures)."""
    for k, v in figures.items():
        name = f"{prefix}{k}"
        if isinstance(v, dict):
            yield from leaves(v, f"{name}.")
        elif isinstance(v, (int, float)) and not isinstance(v, bool):
            yield name, float(v)


def spread(values: Sequence[float]) -> float:
    """The relative spread of one figure over repeated runs, ``(max - min) / |median|``: with the
    three or so runs a calibration can afford, the range is the estimate that hides nothing (a
    median absolute deviation of three values is the smaller of two gaps). 0 when every run
    agrees; ``inf`` for a figure whose median is 0 but whose runs differ."""
    lo, hi, mid = min(values), max(values), statistics.median(values)
    if hi == lo:
        return 0.0
    return (hi - lo) / abs(mid) if mid else float("inf")


def calibration(runs: Sequence[Entry], cal_id: str) -> Entry:
    """The calibration entry of ``runs`` (ok runs of one bench, one commit, one mode): each
    figure's median as its figures, each figure's spread as its noise."""
    assert runs and all(r.ok for r in runs)
    per: dict[str, list[float]] = {}
    for r in runs:
        for name, value in leaves(r.figures):
            per.setdefault(name, []).append(value)
    both = [(n, v) for n, v in per.items() if len(v) == len(runs)]
    first = runs[0]
    return dataclasses.replace(
        first,
        kind="calibration",
        figures={n: statistics.median(v) for n, v in both},
        noise={n: round(spread(v), 4) for n, v in both},
        runs=len(runs),
        calibration=cal_id,
        time=runs[-1].time,
        seconds=round(sum(r.seconds for r in runs), 1),
        load=(first.load[0], runs[-1].load[1]),
        dirty=any(r.dirty for r in runs),
    )


def calibrate(
    script: Path, args: Sequence[str], runs: int, ledger: Path = LEDGER
) -> tuple[Entry, list[Entry]]:
    """Run a bench ``runs`` times in a row, record each run and then the calibration. A failed
    run is recorded and ends the calibration (noise from fewer runs would claim too much)."""
    cal_id = f"{bench_name(script)}-{utc_now()}"
    done: list[Entry] = []
    for i in range(runs):
        print(f"\n== calibration of {bench_name(script)}: run {i + 1} of {runs}\n", flush=True)
        e = dataclasses.replace(run_bench(script, args), calibration=cal_id)
        append(e, ledger)
        done.append(e)
        if not e.ok:
            raise SystemExit(f"calibration stopped: run {i + 1} failed: {e.error}")
    cal = calibration(done, cal_id)
    append(cal, ledger)
    return cal, done


def select(
    entries: Iterable[Entry],
    bench: str | None = None,
    *,
    kind: str | None = "run",
    quick: bool | None = None,
    fingerprint: str | None = None,
) -> list[Entry]:
    return [
        e
        for e in entries
        if (bench is None or e.bench == bench)
        and (kind is None or e.kind == kind)
        and (quick is None or e.quick == quick)
        and (fingerprint is None or e.machine.fingerprint == fingerprint)
    ]


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ledger", type=Path, default=LEDGER, help="default: %(default)s")
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="run one bench and record it; exits as the bench did")
    r.add_argument("bench", help="bench/create.py, create.py or create")
    r.add_argument("args", nargs=argparse.REMAINDER, help="the bench's own arguments")
    s = sub.add_parser("show", help="the entries, newest last, one line each")
    s.add_argument("bench", nargs="?")
    a = ap.parse_args(argv)
    if a.cmd == "run":
        entry = run_bench(bench_script(a.bench), a.args)
        append(entry, a.ledger)
        where = a.ledger.relative_to(REPO) if a.ledger.is_relative_to(REPO) else a.ledger
        if entry.ok:
            print(f"ledger: {entry.bench} recorded in {where}", file=sys.stderr)
            return 0
        print(f"ledger: {entry.bench} FAILED, recorded in {where}: {entry.error}", file=sys.stderr)
        return entry.exit_code or 1
    for e in read(a.ledger):
        if a.bench and e.bench != bench_name(a.bench):
            continue
        dirty = "+dirty" if e.dirty else ""
        extra = f" x{e.runs}" if e.kind == "calibration" else ""
        print(
            f"{e.time} {e.bench:10} {e.kind}{extra} {e.mode:5} {e.status:6} "
            f"{e.commit[:10]}{dirty} machine {e.machine.fingerprint} load {e.load[0]}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
