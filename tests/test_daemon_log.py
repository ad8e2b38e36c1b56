"""The node daemon's log rotates: a long-lived daemon never fills its disk with its own log."""

from __future__ import annotations

import os

import pytest

from dsec_core.testing import running_kit_node

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root")


def test_the_daemon_log_rotates_and_keeps_three_old_files(monkeypatch):
    monkeypatch.setenv("DSEC_LOG_MAX", "1K")
    monkeypatch.setenv("DSEC_LOG_LEVEL", "DEBUG")  # a few lines per create
    with running_kit_node("dsec-log-") as node:
        with node.client() as client:
            for _ in range(30):
                client.create(layers=(node.layer.ref,), memory="64M", ttl=60).kill()
        logs = {p.name: p.stat().st_size for p in node.home.glob("dsecd.log*")}
        assert set(logs) == {"dsecd.log", "dsecd.log.1", "dsecd.log.2", "dsecd.log.3"}, logs
        assert max(logs.values()) <= 1024
        # the last kill's lines (its own, the teardown's, the access line: a JSON object
        # each, a few hundred bytes) may straddle the last rotation
        newest = "".join((node.home / n).read_text() for n in ("dsecd.log.1", "dsecd.log"))
        assert "killing sandbox" in newest
        # uvicorn's records went to the same rotated log, nothing piles up beside it
        assert node.config.stderr_path.stat().st_size < 1024
