"""The ``vm`` backend through a node daemon: create to first exec, and the latency of the
screen API (``screenshot``, ``input`` of one click) as a client sees it: the numbers in
dsec's docs, docs/trainers/vms.md.

A kit node (``dsec_core.testing``: a private ``DSEC_HOME``, the busybox base layer) gets a layer
holding clickpad; each run creates a ``vm`` sandbox from both, times ``create`` plus the first
``exec``, starts clickpad, then times ``--shots`` screenshots and clicks. Prints median and
range; everything is removed at the end.

    python plugins/backend_vm/bench/screen_api.py [--runs N] [--shots N]
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
from pathlib import Path

from dsec_backend_vm.guest import ensure_guest_program

from dsec_core.layers.build import build_layer
from dsec_core.layers.store import LayerStore
from dsec_core.testing.fixtures import running_kit_node


def _summary(name: str, values: list[float], unit: str, scale: float) -> str:
    shown = [v * scale for v in values]
    return (
        f"{name}: median {statistics.median(shown):.1f} {unit} "
        f"(min {min(shown):.1f}, max {max(shown):.1f}, n={len(shown)})"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--shots", type=int, default=10)
    args = parser.parse_args()
    boots: list[float] = []
    shots: list[float] = []
    clicks: list[float] = []
    with running_kit_node("dsec-bench-vm-") as node, tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp) / "root"
        (root / "usr/local/bin").mkdir(parents=True)
        shutil.copy2(ensure_guest_program("clickpad", Path(tmp)), root / "usr/local/bin/clickpad")
        layer = build_layer(
            root,
            name="clickpad",
            version="1",
            kind="toolkit",
            store=LayerStore(node.config.layer_dir),
        )
        with node.client() as client:
            for _ in range(args.runs):
                t0 = time.monotonic()
                sb = client.create(
                    backend="vm", layers=[layer.ref, node.layer.ref], memory="512M", ttl=600
                )
                try:
                    sb.exec("true").check()
                    boots.append(time.monotonic() - t0)
                    sb.exec("clickpad > /tmp/clickpad.log 2>&1 &", background=True).check()
                    while b"ready" not in sb.exec("cat /tmp/clickpad.log").stdout:
                        time.sleep(0.1)
                    for _ in range(args.shots):
                        t0 = time.monotonic()
                        sb.screenshot()
                        shots.append(time.monotonic() - t0)
                        t0 = time.monotonic()
                        sb.input([{"type": "click", "x": 20, "y": 20}])
                        clicks.append(time.monotonic() - t0)
                finally:
                    sb.kill()
    print(_summary("create to first exec", boots, "s", 1))
    print(_summary("screenshot", shots, "ms", 1e3))
    print(_summary("input (one click)", clicks, "ms", 1e3))


if __name__ == "__main__":
    main()
