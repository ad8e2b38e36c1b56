"""The benches' ledger and comparison (bench/ledger.py, bench/compare.py): what a run leaves in
the ledger, which way each figure is better, the noise a comparison allows, what gets flagged,
and the README's figures, which must be the ledger's. Pure logic on small ledgers in a temporary
directory (and a bench that is a three-line script), no node."""

from __future__ import annotations

import dataclasses
import json
import math
import re
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
# appended, not put first: bench/queue.py would otherwise stand in for the standard library's
sys.path.append(str(REPO / "bench"))

import compare  # noqa: E402
import ledger  # noqa: E402
from ledger import Entry, Machine  # noqa: E402

MACHINE = Machine(cores=2, memory_mib=24151, kernel="6.1.0", cpu="Xeon")
OTHER = dataclasses.replace(MACHINE, cores=64)


def entry(bench: str = "create", quick: bool = True, commit: str = "a" * 40, **kw) -> Entry:
    base = dict(
        bench=bench,
        status="ok",
        figures={},
        commit=commit,
        dirty=False,
        time="2026-12-02T05:00:00Z",
        quick=quick,
        args=("--quick",) if quick else (),
        machine=MACHINE,
    )
    return Entry(**(base | kw))


def script(tmp_path: Path, body: str) -> Path:
    p = tmp_path / "fake.py"
    p.write_text(body)
    return p


# --- the ledger ---------------------------------------------------------------------------


def test_an_entry_survives_the_ledger(tmp_path):
    path = tmp_path / "results" / "ledger.jsonl"
    e = entry(figures={"dsec_p50_ms": 24.5, "nested": {"a": 1}}, load=(1.5, 2.0), dirty=True)
    ledger.append(e, path)
    ledger.append(dataclasses.replace(e, bench="fncall"), path)
    lines = path.read_text().splitlines()
    assert len(lines) == 2
    raw = json.loads(lines[0])
    assert raw["schema"] == ledger.SCHEMA and raw["machine"]["fingerprint"]
    assert ledger.read(path) == [e, dataclasses.replace(e, bench="fncall")]


def test_a_line_that_does_not_parse_is_skipped_not_fatal(tmp_path, capsys):
    path = tmp_path / "ledger.jsonl"
    ledger.append(entry(), path)
    with open(path, "a") as f:
        f.write("<<<<<<< HEAD\n")
        f.write(json.dumps({"schema": ledger.SCHEMA + 1, "bench": "x"}) + "\n")
    ledger.append(entry(bench="judge"), path)
    assert [e.bench for e in ledger.read(path)] == ["create", "judge"]
    assert "ledger.jsonl:2 skipped" in capsys.readouterr().err


def test_a_merged_ledger_reads_in_order_of_time(tmp_path):
    path = tmp_path / "ledger.jsonl"
    ledger.append(entry(bench="b", time="2026-12-02T06:00:00Z"), path)
    ledger.append(entry(bench="a", time="2026-12-01T06:00:00Z"), path)
    ledger.append(entry(bench="c", time="2026-12-02T06:00:00Z"), path)
    assert [e.bench for e in ledger.read(path)] == ["a", "b", "c"]
    attributes = (REPO / ".gitattributes").read_text()
    assert "bench/results/ledger.jsonl merge=union" in attributes


def test_machines_differ_by_fingerprint():
    assert MACHINE.fingerprint == dataclasses.replace(MACHINE).fingerprint
    assert MACHINE.fingerprint != OTHER.fingerprint
    here = Machine.this()
    assert here.cores >= 1 and here.memory_mib > 0 and here.kernel


def test_the_figures_are_the_last_line_when_it_is_one_json_object():
    assert ledger.final_json('table\n{"a": 1}\n\n') == {"a": 1}
    assert ledger.final_json('{"a": 1}\nmore text') is None
    assert ledger.final_json("[1, 2]") is None
    assert ledger.final_json("") is None


def test_a_run_is_recorded_with_its_figures_commit_and_mode(tmp_path, capsys):
    bench = script(tmp_path, 'import json, sys\nprint("a table")\nprint(json.dumps({"x_ms": 3}))')
    e = ledger.run_bench(bench, ["--quick"])
    assert e.ok and e.figures == {"x_ms": 3} and e.quick and e.bench == "fake"
    assert re.fullmatch(r"[0-9a-f]{40}|unknown", e.commit)
    assert e.time.endswith("Z") and e.exit_code == 0 and e.error is None
    assert "a table" in capsys.readouterr().out  # shown as it ran


@pytest.mark.parametrize(
    ("body", "why"),
    [
        ('import sys\nprint("{}")\nsys.stderr.write("boom\\n")\nsys.exit(3)', "exit code 3: boom"),
        ('print("no figures")', "not one JSON object"),
    ],
)
def test_a_failing_bench_is_recorded_as_failed(tmp_path, body, why):
    e = ledger.run_bench(script(tmp_path, body), [], echo=False)
    assert e.status == "failed" and why in (e.error or "")
    path = tmp_path / "ledger.jsonl"
    assert ledger.main(["--ledger", str(path), "run", str(tmp_path / "fake.py")]) != 0
    (recorded,) = ledger.read(path)
    assert recorded.status == "failed"


def test_run_sh_bench_records_every_bench_and_each_has_directions():
    """Each bench run.sh bench runs goes through the ledger, and compare.py knows which way
    its figures go."""
    text = (REPO / "run.sh").read_text()
    block = text[text.index("    bench)") : text.index(";;", text.index("    bench)"))]
    benches = re.findall(r"^\s*record bench/(\w+)\.py --quick", block, re.M)
    assert len(benches) >= 10 and benches[0] == "create"
    assert "python bench/" not in block.replace("bench/compare.py", "")
    assert set(benches) <= set(compare.DIRECTIONS)
    # and every bench in bench/ (figures.py, ledger.py and compare.py are not benches)
    scripts = {p.stem for p in (REPO / "bench").glob("*.py")}
    assert scripts - {"figures", "ledger", "compare", "fair_queue"} <= set(compare.DIRECTIONS)


# --- noise --------------------------------------------------------------------------------


def test_spread_is_the_range_over_the_median():
    assert ledger.spread([10.0, 11.0, 12.0]) == pytest.approx(2 / 11)
    assert ledger.spread([5.0, 5.0, 5.0]) == 0.0
    assert ledger.spread([-1.0, 0.0, 1.0]) == math.inf


def test_a_calibration_holds_medians_and_spreads():
    runs = [
        entry(figures={"p50_ms": v, "n": {"x": 1}, "quick": True, "image": "b"})
        for v in (10.0, 12.0, 11.0)
    ]
    cal = ledger.calibration(runs, "create-1")
    assert cal.kind == "calibration" and cal.runs == 3 and cal.calibration == "create-1"
    assert cal.figures == {"p50_ms": 11.0, "n.x": 1.0}
    assert cal.noise == {"p50_ms": pytest.approx(2 / 11, abs=1e-4), "n.x": 0.0}


def test_calibrate_records_each_run_then_the_noise(tmp_path):
    counter = tmp_path / "n"
    counter.write_text("0")
    bench = script(
        tmp_path,
        "import json, pathlib\n"
        f"p = pathlib.Path({str(counter)!r}); n = int(p.read_text()) + 1; p.write_text(str(n))\n"
        'print(json.dumps({"x_ms": 10 + n}))\n',
    )
    path = tmp_path / "ledger.jsonl"
    cal, runs = ledger.calibrate(bench, ["--quick"], 3, path)
    kinds = [e.kind for e in ledger.read(path)]
    assert kinds == ["run", "run", "run", "calibration"]
    assert {r.calibration for r in runs} == {cal.calibration}
    assert cal.figures == {"x_ms": 12.0} and cal.noise["x_ms"] == pytest.approx(2 / 12, 1e-3)


# --- directions and verdicts ----------------------------------------------------------------


def test_directions_are_declared_not_guessed():
    assert compare.direction("create", "dsec_p50_ms") == "lower"
    assert compare.direction("create", "dsec_per_s_c8") == "higher"
    assert compare.direction("create", "docker_p50_ms") == "baseline"
    assert compare.direction("create", "rounds") == "info"
    assert compare.direction("create", "something_new_ms") is None
    assert compare.direction("nobench", "p50_ms") is None
    # families by pattern, nested figures by their dotted name
    assert compare.direction("disk", "own-fs_set-up_p50_ms") == "lower"
    assert compare.direction("density", "create_p50_ms.300") == "lower"
    # a bench's own declaration wins
    own = {"directions": {"something_new_ms": "lower", "dsec_p50_ms": "higher"}}
    assert compare.direction("create", "something_new_ms", own) == "lower"
    assert compare.direction("create", "dsec_p50_ms", own) == "higher"


def test_every_declared_direction_is_a_known_one():
    for bench, table in compare.DIRECTIONS.items():
        for pattern, way in table:
            assert way in compare.DIRECTION_NAMES, (bench, pattern)


@pytest.mark.parametrize(
    ("way", "change", "noise", "expected"),
    [
        ("lower", 0.5, 0.1, "worse"),  # 50% slower, 2 x 10% allowed
        ("lower", 0.15, 0.1, "within noise"),
        ("lower", -0.5, 0.1, "better"),
        ("higher", -0.5, 0.1, "worse"),
        ("higher", 0.5, 0.1, "better"),
        ("lower", 0.015, 0.0, "within noise"),  # the floor: 2 x 1%
        ("lower", 0.03, 0.0, "worse"),
        ("baseline", 5.0, 0.1, "baseline"),
        (None, 5.0, 0.1, "no direction"),
        ("lower", math.inf, 0.1, "worse"),
        # a fall is read as the rise of the inverse: halving is moving 1.0, like doubling
        ("higher", -0.5, 0.6, "within noise"),  # 1.0 <= 2 x 0.6
        ("higher", -0.6, 0.6, "worse"),  # 1.5 > 1.2, though 60% < 120%
        ("lower", -0.6, 0.6, "better"),
        ("higher", -1.0, 5.0, "worse"),  # to zero
    ],
)
def test_verdicts(way, change, noise, expected):
    assert compare.verdict(way, change, noise) == expected


def test_a_move_is_the_same_size_up_or_down():
    assert compare.moved(1.0) == compare.moved(-0.5) == 1.0
    assert compare.moved(0.0) == 0.0 and compare.moved(-1.0) == math.inf


def test_only_a_move_the_wrong_way_beyond_the_noise_is_flagged():
    last = {
        "dsec_p50_ms": 30.0,
        "dsec_per_s_c8": 50.0,
        "docker_p50_ms": 400.0,
        "new_ms": 1.0,
        "rounds": 24,
        "image": "busybox",
    }
    prev = {
        "dsec_p50_ms": 20.0,
        "dsec_per_s_c8": 52.0,
        "docker_p50_ms": 200.0,
        "rounds": 24,
        "gone_ms": 3.0,
    }
    rows = {r.figure: r for r in compare.compare_figures("create", last, prev, lambda f: 0.1)}
    assert rows["dsec_p50_ms"].flagged and rows["dsec_p50_ms"].change == pytest.approx(0.5)
    assert rows["dsec_per_s_c8"].verdict == "within noise"
    assert rows["docker_p50_ms"].verdict == "baseline"
    assert rows["new_ms"].verdict == "new" and rows["new_ms"].direction is None
    assert rows["gone_ms"].verdict == "gone"
    assert "image" not in rows  # a string is not a figure
    assert [r.figure for r in rows.values() if r.flagged] == ["dsec_p50_ms"]


# --- comparing benches in a ledger ----------------------------------------------------------


def _ledger(tmp_path: Path, *entries: Entry) -> Path:
    path = tmp_path / "ledger.jsonl"
    for e in entries:
        ledger.append(e, path)
    return path


def test_the_last_run_is_compared_with_the_one_before_on_this_machine_in_this_mode(tmp_path):
    entries = [
        entry(figures={"dsec_p50_ms": 20.0}, commit="1" * 40),
        entry(figures={"dsec_p50_ms": 5.0}, commit="2" * 40, machine=OTHER),
        entry(figures={"dsec_p50_ms": 6.0}, commit="3" * 40, quick=False),
        entry(status="failed", figures={}, commit="4" * 40, error="boom"),
        entry(figures={"dsec_p50_ms": 21.0}, commit="5" * 40),
    ]
    c = compare.compare_bench(entries, "create")
    assert c is not None and c.previous is not None
    assert c.previous.commit == "1" * 40 and c.others == 2
    assert c.calibration is None and c.rows[0].noise == compare.DEFAULT_NOISE
    assert c.rows[0].verdict == "within noise"
    assert compare.compare_bench(entries, "create", against="2").previous is None
    assert compare.compare_bench(entries, "fncall") is None


def test_a_calibration_of_this_machine_and_mode_sets_the_noise():
    cal = entry(kind="calibration", noise={"dsec_p50_ms": 0.01}, runs=3)
    other = dataclasses.replace(cal, machine=OTHER, noise={"dsec_p50_ms": 0.5})
    entries = [
        cal,
        other,
        entry(figures={"dsec_p50_ms": 20.0}),
        entry(figures={"dsec_p50_ms": 21.0}),
    ]
    (c,) = compare.compare_all(entries)
    assert c.calibration == cal and c.rows[0].noise == 0.01
    assert c.rows[0].flagged  # 5% slower, beyond 2 x 1%


def test_the_last_line_and_the_exit_code(tmp_path, capsys):
    path = _ledger(
        tmp_path,
        entry(figures={"dsec_p50_ms": 20.0, "mystery": 1.0}),
        entry(figures={"dsec_p50_ms": 40.0, "mystery": 9.0}),
        entry(bench="judge", figures={"judge_p50_ms": 30.0}),
        entry(bench="judge", status="failed", error="exit code 1: boom"),
    )
    assert compare.main(["--ledger", str(path)]) == 0
    out = capsys.readouterr().out
    assert "WORSE beyond noise" in out and "FAILED" in out
    assert "no declared direction" in out and "mystery" in out
    summary = json.loads(out.strip().splitlines()[-1])
    assert [(f["bench"], f["figure"]) for f in summary["flagged"]] == [("create", "dsec_p50_ms")]
    assert summary["failed"] == ["judge"]
    assert summary["without_direction"] == {"create": ["mystery"]}
    assert summary["uncalibrated"] == ["create", "judge"]
    assert compare.main(["--ledger", str(path), "--fail-on-regression"]) == 1
    capsys.readouterr()
    assert compare.main(["--ledger", str(path), "create", "--against", "a"]) == 0


def test_calibrate_through_compare(tmp_path, capsys, monkeypatch):
    bench = script(tmp_path, 'import json\nprint(json.dumps({"dsec_p50_ms": 20}))')
    monkeypatch.setattr(compare, "bench_script", lambda name: bench)
    path = tmp_path / "ledger.jsonl"
    assert compare.main(["--ledger", str(path), "--calibrate", "fake", "--runs", "2"]) == 0
    assert [e.kind for e in ledger.read(path)] == ["run", "run", "calibration"]
    assert ledger.read(path)[0].args == ("--quick",)  # the default mode
    assert "noise from 2 runs" in capsys.readouterr().out


# --- the README -------------------------------------------------------------------------------


def test_the_readme_block_is_made_from_the_ledger():
    entries = [
        entry(
            figures={
                "dsec_p50_ms": 48.5,
                "docker_p50_ms": 233.0,
                "dsec_per_s_c8": 38.6,
                "docker_per_s_c8": 8.0,
            }
        ),
        entry(
            figures={
                "dsec_p50_ms": 24.04,
                "docker_p50_ms": 194.2,
                "dsec_per_s_c8": 70.1,
                "docker_per_s_c8": 8.4,
            },
            quick=False,
            commit="b" * 40,
        ),
        entry(figures={"dsec_p50_ms": 99.0}),  # a newer quick run: the full one is quoted
        entry(bench="fork", figures={"steps": 5, "fork_s": 0.31, "replay_s": 36.6}),
    ]
    block = compare.readme_block(entries)
    cal = ledger.calibration(
        [
            entry(bench="fncall", figures={"fncall_p50_ms": v, "docker_exec_p50_ms": 110.0})
            for v in (3.0, 3.5, 9.0)
        ],
        "fncall-1",
    )
    with_cal = compare.readme_block([*entries, cal])
    assert "| 3.5 ms | `docker exec`: 110 ms |" in with_cal
    assert "`bench/fncall.py --quick` (median of 3 runs)" in with_cal
    assert "| create → first exec → kill, p50 | 24 ms | `docker run`: 194 ms |" in block
    assert "| sandboxes created per second, concurrency 8 | 70.1 /s |" in block
    assert "forking 8 sandboxes at step 5 against replaying 5 steps | 0.31 s | 36.6 s |" in block
    assert "fncall: no run in the ledger yet" in block
    assert "`bench/create.py` at bbbbbbb" in block and "`bench/fork.py --quick`" in block


def test_replacing_the_block_keeps_the_rest_of_the_readme():
    text = f"intro\n{compare.BEGIN}\nold table\n{compare.END}\nafter\n"
    assert (
        compare.replace_block(text, "new") == f"intro\n{compare.BEGIN}\nnew\n{compare.END}\nafter\n"
    )
    with pytest.raises(ValueError):
        compare.replace_block("no markers", "new")


def test_the_readme_quotes_the_ledger():
    """README.md's figures are the committed ledger's: `bench/compare.py --readme` after a bench
    run rewrites them, and they cannot drift apart."""
    text = (REPO / "README.md").read_text()
    assert text.count(compare.BEGIN) == 1 and text.count(compare.END) == 1
    block = compare.readme_block(ledger.read(ledger.LEDGER))
    assert compare.replace_block(text, block) == text, "run bench/compare.py --readme"
