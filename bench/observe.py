#!/usr/bin/env python3
"""What observability costs a request: ``ObservedRequests`` (request id, access log line,
request counter) and the exec metrics, on the hot path of an exec round trip (~1-2 ms).

Two figures:
- in process, the middleware around a trivial ASGI app against the bare app, with the access
  log going to a JSON file handler as in the daemon (precise: no network, no sandbox);
- on a private kit node, sequential ``exec("true")`` round trips over the unix socket: the
  figure to compare with the same script run against a tree without the middleware
  (``PYTHONPATH=<that tree> python bench/observe.py``; ``node`` only then).

    python bench/observe.py [--execs N] [--requests N]

The last line printed is one JSON object of the figures (microseconds and milliseconds).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from dsec_core.testing import running_kit_node


async def _bare(scope: Any, receive: Any, send: Any) -> None:
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": b"{}"})


def middleware_us(requests: int) -> dict[str, float] | None:
    """Microseconds per request of the bare app and of the app behind ``ObservedRequests``,
    with its access line going to a JSON file handler (``observed_us``) and without one
    (``DSEC_ACCESS_LOG=off``: ``observed_quiet_us``); None on a tree without
    dsec_core.observe."""
    try:
        from dsec_core.observe import (
            JsonLogFormatter,
            NodeMetrics,
            ObservedRequests,
            RequestIdFilter,
        )
    except ImportError:
        return None

    class Routed:
        """The bare app as Starlette's router leaves the scope: with its route."""

        path = "/v1/sandboxes/{sid}/exec"

    async def app(scope: Any, receive: Any, send: Any) -> None:
        scope["route"] = Routed
        scope["path_params"] = {"sid": "abc"}
        await _bare(scope, receive, send)

    with tempfile.TemporaryDirectory() as tmp:
        handler = logging.FileHandler(Path(tmp) / "access.log")
        handler.addFilter(RequestIdFilter())
        handler.setFormatter(JsonLogFormatter())
        log = logging.getLogger("dsec.bench-access")
        log.addHandler(handler)
        log.setLevel(logging.INFO)
        log.propagate = False
        observed = ObservedRequests(app, logger=log, metrics=NodeMetrics())
        try:
            bare = asyncio.run(_time(app, requests))
            full = asyncio.run(_time(observed, requests))
            log.setLevel(logging.WARNING)
            quiet = asyncio.run(_time(observed, requests))
        finally:
            log.removeHandler(handler)
            handler.close()
    return {
        "bare_us": bare,
        "observed_us": full,
        "observed_quiet_us": quiet,
        "overhead_us": round(full - bare, 2),
    }


async def _time(app: Any, n: int) -> float:
    """Microseconds per call of ``app`` over ``n`` calls in 20 batches: the fastest batch's,
    which other processes on the machine disturbed least."""

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: Any) -> None:
        pass

    headers = [(b"x-request-id", b"bench-1"), (b"content-type", b"application/json")]
    batch = max(1, n // 20)
    per_call = []
    for _ in range(20):
        t0 = time.perf_counter()
        for _ in range(batch):
            scope = {
                "type": "http",
                "method": "POST",
                "path": "/v1/sandboxes/abc/exec",
                "headers": headers,
            }
            await app(scope, receive, send)
        per_call.append((time.perf_counter() - t0) / batch * 1e6)
    return round(min(per_call), 2)


def exec_ms(execs: int) -> dict[str, float]:
    """p50 and mean milliseconds of ``exec("true")`` on a private kit node."""
    with running_kit_node("dsec-bench-observe-") as node, node.client() as client:
        sb = client.create(layers=(node.layer.ref,), memory="64M", ttl=600)
        try:
            for _ in range(50):  # warm: connection, agent, page cache
                sb.exec("true")
            times = []
            for _ in range(execs):
                t0 = time.perf_counter()
                sb.exec("true")
                times.append((time.perf_counter() - t0) * 1e3)
        finally:
            sb.kill()
    return {
        "exec_p50_ms": round(statistics.median(times), 3),
        "exec_mean_ms": round(statistics.fmean(times), 3),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--execs", type=int, default=2000)
    parser.add_argument("--requests", type=int, default=20000)
    args = parser.parse_args()
    figures: dict[str, Any] = {}
    mw = middleware_us(args.requests)
    if mw is not None:
        figures.update(mw)
        print(
            f"middleware: bare {mw['bare_us']} us, observed {mw['observed_us']} us, without "
            f"the access line {mw['observed_quiet_us']} us per request"
        )
    figures.update(exec_ms(args.execs))
    print(f"exec(true): p50 {figures['exec_p50_ms']} ms, mean {figures['exec_mean_ms']} ms")
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
