"""The benches' figures: a bench run with ``--plot`` draws what it measured with matplotlib (Agg,
no display) into ``docs/img/bench/<bench>.png``, where the docs' Benchmarks page shows it.

    from figures import add_plot_flag, figure
    ap = argparse.ArgumentParser(); add_plot_flag(ap); args = ap.parse_args()
    if args.plot:
        with figure("create", "Create -> exec -> kill", args.quick, ncols=2) as (fig, axes):
            axes[0].ecdf(latencies_ms, label="dsec")

matplotlib comes with the ``bench`` extra (``pip install -e '.[bench]'``; ``run.sh setup``
installs it) and is imported only when a figure is drawn, so a bench without ``--plot`` runs
without it.
"""

from __future__ import annotations

import argparse
import contextlib
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

#: Where the figures go: the docs site's images, committed with the page that shows them.
IMAGES = Path(__file__).resolve().parent.parent / "docs" / "img" / "bench"

#: dsec and what it is compared with, the same colour on every figure.
COLOURS = {"dsec": "#3f51b5", "baseline": "#9e9e9e", "other": "#ff9800", "more": "#4caf50"}


def add_plot_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--plot",
        action="store_true",
        help=f"also draw the figures into {IMAGES.relative_to(IMAGES.parents[2])}/ (matplotlib)",
    )


@contextlib.contextmanager
def figure(
    bench: str, title: str, quick: bool, *, ncols: int = 1, width: float = 5.0
) -> Iterator[tuple[Any, Sequence[Any]]]:
    """A figure of ``ncols`` panels side by side, saved as ``<IMAGES>/<bench>.png`` when the
    block ends (and said so on stderr); ``quick`` runs say so in the title."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, ncols, figsize=(width * ncols, 3.6), squeeze=False)
    try:
        yield fig, list(axes[0])
        fig.suptitle(f"{title}{'  (--quick run)' if quick else ''}", fontsize=11)
        fig.tight_layout()
        IMAGES.mkdir(parents=True, exist_ok=True)
        out = IMAGES / f"{bench}.png"
        fig.savefig(out, dpi=110, metadata={"Software": None})
        print(f"figure: {out}", flush=True)
    finally:
        plt.close(fig)


def bars(ax: Any, labels: Sequence[str], values: Sequence[float], *, unit: str, log: bool = False,
         colours: Sequence[str] | None = None) -> None:  # fmt: skip
    """Horizontal bars with their values written at their ends."""
    colours = colours or [COLOURS["dsec"] if "dsec" in lb else COLOURS["baseline"] for lb in labels]
    ys = range(len(labels))
    ax.barh(list(ys), list(values), color=list(colours))
    ax.set_yticks(list(ys), list(labels))
    ax.invert_yaxis()
    if log:
        log_scale(ax, "x")
    ax.set_xlabel(unit)
    for y, v in zip(ys, values, strict=True):
        label = f" {v:,.0f}" if v >= 100 else f" {v:.3g}"
        ax.annotate(label, (v, y), va="center", fontsize=8, annotation_clip=False)
    ax.grid(axis="x", alpha=0.3)


def log_scale(ax: Any, axis: str = "y") -> None:
    """A log axis labelled 2, 5, 10, 20 rather than 2x10^0."""
    from matplotlib.ticker import LogLocator, ScalarFormatter

    getattr(ax, f"set_{axis}scale")("log")
    scale = getattr(ax, f"{axis}axis")
    scale.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
    scale.set_major_formatter(ScalarFormatter())
    scale.set_minor_formatter("")
