"""A throwaway etcd on loopback for tests and benchmarks: Debian's ``etcd-server`` on free
ports, its data in a temporary directory, stopped by its pid and removed on the way out.

    with etcd_server() as etcd:
        iam = Iam.open(etcd.url("dsec/iam"))
"""

from __future__ import annotations

import json
import shutil
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from .procs import free_port, stop_process

__all__ = ["EtcdServer", "etcd_server"]


@dataclass(frozen=True)
class EtcdServer:
    """A running etcd: its client ``endpoint`` (``http://127.0.0.1:port``), pid and data dir."""

    endpoint: str
    pid: int
    data_dir: Path

    def url(self, prefix: str = "dsec/iam") -> str:
        """An ``Iam.open`` URL for this etcd with keys under ``prefix``."""
        return f"etcd://{self.endpoint.removeprefix('http://')}/{prefix}"


def _healthy(endpoint: str) -> bool:
    try:
        with urllib.request.urlopen(f"{endpoint}/health", timeout=1.0) as answer:
            return bool(json.loads(answer.read()).get("health") == "true")
    except (OSError, ValueError):
        return False


@contextmanager
def etcd_server(binary: str = "etcd", *, start_timeout: float = 20.0) -> Iterator[EtcdServer]:
    """Start etcd on 127.0.0.1 (client and peer ports free a moment before, retried if another
    process takes one first), wait until ``/health`` says so, and stop it on exit. Skips
    nothing: without the ``etcd`` binary it raises ``FileNotFoundError``."""
    path = shutil.which(binary)
    if path is None:
        raise FileNotFoundError(f"{binary} not found: apt-get install etcd-server")
    data_dir = Path(tempfile.mkdtemp(prefix="dsec-etcd-"))
    proc: subprocess.Popen[bytes] | None = None
    try:
        for _attempt in range(3):
            client, peer = f"http://127.0.0.1:{free_port()}", f"http://127.0.0.1:{free_port()}"
            log = open(data_dir / "etcd.log", "ab")  # closed once etcd has it
            with log:
                proc = subprocess.Popen(
                    [
                        path,
                        "--name=dsec-test",
                        f"--data-dir={data_dir / 'data'}",
                        f"--listen-client-urls={client}",
                        f"--advertise-client-urls={client}",
                        f"--listen-peer-urls={peer}",
                        f"--initial-advertise-peer-urls={peer}",
                        f"--initial-cluster=dsec-test={peer}",
                        "--initial-cluster-state=new",
                        "--logger=zap",
                    ],
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=log,
                )
            deadline = time.monotonic() + start_timeout
            while proc.poll() is None and time.monotonic() < deadline:
                if _healthy(client):
                    break
                time.sleep(0.05)
            if proc.poll() is None and _healthy(client):
                break
            stop_process(proc)  # exited (a port was taken meanwhile) or never got healthy
            proc = None
            shutil.rmtree(data_dir / "data", ignore_errors=True)
        if proc is None:
            tail = (data_dir / "etcd.log").read_text(errors="replace")[-2000:]
            raise RuntimeError(f"etcd did not start on loopback:\n{tail}")
        yield EtcdServer(client, proc.pid, data_dir)
    finally:
        if proc is not None:
            stop_process(proc)
        shutil.rmtree(data_dir, ignore_errors=True)
