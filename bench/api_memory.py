#!/usr/bin/env python3
"""The node daemon's resident memory while clients move large files and ask for huge batches:
it must stay flat, whatever the size (issue 8, failure 7).

On a private kit node: a client downloads a 4 GiB sparse file from a sandbox through the SDK,
uploads a 1 GiB sparse file, reads to the end of a 64 GiB sparse file in one request (which stops
at the API's 256 MiB cap), and asks for batches of a million sandboxes and of the node's
DSEC_MAX_BATCH each too large to admit. The daemon's VmRSS is sampled every 20 ms throughout.

    python bench/api_memory.py [--quick]

--quick moves 1 GiB instead of 4. The last line printed is one JSON object of the figures (MiB
and seconds).
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import threading
import time
from collections.abc import Callable
from typing import Any

import dsec
from dsec_core.api.transport import HTTPTransport
from dsec_core.testing import KitNode, running_kit_node


def watched(node: KitNode, work: Callable[[], Any]) -> dict[str, float]:
    """Run ``work`` while sampling the daemon's RSS; its time and RSS before, peak and after."""
    samples = [node.daemon_rss()]
    done = threading.Event()

    def watch() -> None:
        while not done.wait(0.02):
            samples.append(node.daemon_rss())

    watcher = threading.Thread(target=watch)
    watcher.start()
    t0 = time.monotonic()
    try:
        work()
    finally:
        seconds = time.monotonic() - t0
        done.set()
        watcher.join()
    samples.append(node.daemon_rss())
    return {
        "seconds": round(seconds, 2),
        "rss_before_mib": samples[0] >> 20,
        "rss_peak_mib": max(samples) >> 20,
        "rss_after_mib": samples[-1] >> 20,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="1 GiB instead of 4")
    args = parser.parse_args()
    size = (1 if args.quick else 4) << 30
    figures: dict[str, Any] = {"download_bytes": size}
    with running_kit_node("dsec-bench-api-") as node, node.client() as client:
        sb = client.create(layers=(node.layer.ref,), memory="64M")
        sb.exec(f"truncate -s {size} /root/big; truncate -s 64G /root/huge").check()

        figures["download"] = watched(node, lambda: sb.download("/root/big", os.devnull))

        with tempfile.NamedTemporaryFile(dir=node.home) as local:
            local.truncate(1 << 30)
            figures["upload_1g"] = watched(node, lambda: sb.upload(local.name, "/root/up"))
        sb.remove("/root/up")

        http = HTTPTransport(os.fspath(node.config.socket_path))
        read_all = f"/v1/sandboxes/{sb.id}/file?path=/root/huge&length=-1"
        got: list[int] = []
        figures["read_to_end_of_64g"] = watched(
            node, lambda: got.append(len(http.request("GET", read_all, timeout=300).content))
        )
        figures["read_to_end_of_64g"]["bytes"] = got[0]
        http.close()

        def batches() -> None:
            for n, memory in ((10**6, "64M"), (node.config.max_batch, 1 << 50)):
                try:
                    client.create_many(layers=(node.layer.ref,), n=n, memory=memory)
                except dsec.DsecError as e:
                    print(f"n={n}: {type(e).__name__}: {str(e)[:100]}")

        figures["batches"] = watched(node, batches)
        sb.kill()
    for name, row in figures.items():
        if isinstance(row, dict):
            print(f"{name:>20}: {row}")
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
