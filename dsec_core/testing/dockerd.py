"""A private dockerd for tests and benchmarks that compare with Docker or import from it: a
socket, data root and exec root of its own in a fresh directory, no bridge, no iptables rules,
stopped by its pid (SIGTERM, then SIGKILL to its session) and everything it left removed, its
mounts included. The machine's own docker daemon, if any, is never touched. ``dsec_dockerd``
is the fixture of one, for a test module."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from ..errors import DsecError, ToolError
from ..linux.mounts import mounted_under, unmount
from ..linux.processes import stop_process

__all__ = ["PrivateDockerd", "dsec_dockerd", "private_dockerd"]

#: No networking of its own: containers run with ``--network none`` (or ``host`` for a build
#: that needs a server on loopback), and the host's firewall is left alone.
NO_NETWORK = ("--bridge=none", "--iptables=false", "--ip6tables=false", "--ip-masq=false")


#: Where its sockets go: root's tmpfs, short and never on a shared disk.
_SHORT = "/run" if os.path.isdir("/run") else None


@dataclass(frozen=True)
class PrivateDockerd:
    """A running private dockerd: ``host`` its address (``unix://.../docker.sock``), ``cli`` the
    docker command bound to it, ``root`` its directory (``data`` is its data root, and its log
    is there), ``run_dir`` where its sockets are."""

    host: str
    cli: tuple[str, ...]
    root: Path
    run_dir: Path
    pid: int
    version: str

    @property
    def data_root(self) -> Path:
        return self.root / "data"

    @property
    def env(self) -> dict[str, str]:
        """This process's environment with ``DOCKER_HOST`` naming this daemon (for
        python-on-whales and the docker CLI alike)."""
        return {**os.environ, "DOCKER_HOST": self.host}

    def argv(self, *args: str) -> list[str]:
        """``docker -H <this daemon> ARGS``."""
        return [*self.cli, *args]

    def run(self, *args: str, timeout: float = 600, **kw: Any) -> subprocess.CompletedProcess:
        """``docker ARGS`` against this daemon, its output captured as text (``kw`` go to
        ``subprocess.run``); the caller checks the exit code."""
        kw.setdefault("text", True)
        return subprocess.run(self.argv(*args), capture_output=True, timeout=timeout, **kw)


@contextlib.contextmanager
def private_dockerd(
    parent: Path | str | None = None,
    *,
    start_timeout: float = 60.0,
    stop_timeout: float = 60.0,
) -> Iterator[PrivateDockerd]:
    """Start a dockerd in a new directory under ``parent`` (the temporary directory by
    default), wait until it answers, and stop and remove it on exit. ``ToolError`` when docker
    is not installed or the daemon does not start (its log's tail in the error): a test skips
    on it, a benchmark stops."""
    docker, daemon = shutil.which("docker"), shutil.which("dockerd")
    if docker is None or daemon is None:
        raise ToolError("docker.io is not installed (no docker or dockerd)", command=["dockerd"])
    root = Path(tempfile.mkdtemp(prefix="dsec-dockerd-", dir=parent))
    # Its sockets (containerd's are deep in the exec root) need a short path: a unix socket's
    # is at most 107 bytes, and a test's temporary directory can be long.
    run_dir = Path(tempfile.mkdtemp(prefix="dsec-dockerd-", dir=_SHORT))
    host = f"unix://{run_dir / 'docker.sock'}"
    argv = [
        daemon,
        "--host", host,
        *NO_NETWORK,
        "--pidfile", os.fspath(run_dir / "docker.pid"),
        "--data-root", os.fspath(root / "data"),
        "--exec-root", os.fspath(run_dir / "exec"),
    ]  # fmt: skip
    cli = (docker, "-H", host)
    proc: subprocess.Popen[bytes] | None = None
    try:
        with open(root / "dockerd.log", "wb") as log:
            # a session of its own: what it starts (containerd, shims) goes with it
            proc = subprocess.Popen(
                argv, stdout=subprocess.DEVNULL, stderr=log, start_new_session=True
            )
        version = _wait_until_up(proc, argv, cli, root, start_timeout)
        yield PrivateDockerd(
            host=host, cli=cli, root=root, run_dir=run_dir, pid=proc.pid, version=version
        )
    finally:
        if proc is not None:
            stop_process(proc, stop_timeout, group=True)
        # what it mounted there and left (its default netns file, a bind of nsfs; the data
        # root itself is no mount point, so `umount -R root` would miss them)
        for point in [*mounted_under(run_dir), *mounted_under(root)]:
            with contextlib.suppress(DsecError):
                unmount(point)
        shutil.rmtree(run_dir, ignore_errors=True)
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="module")
def dsec_dockerd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PrivateDockerd]:
    """A private dockerd shared by a test module; its tests skip, saying why, where docker is
    not installed or the daemon cannot start."""
    with contextlib.ExitStack() as stack:
        try:
            daemon = stack.enter_context(private_dockerd(tmp_path_factory.mktemp("dockerd")))
        except ToolError as e:
            pytest.skip(str(e))
        yield daemon


def _wait_until_up(
    proc: subprocess.Popen[bytes], argv: list[str], cli: tuple[str, ...], root: Path, timeout: float
) -> str:
    """The daemon's version once it answers; ``ToolError`` with its log if it exits first or
    does not answer within ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        v = subprocess.run(
            [*cli, "version", "--format", "{{.Server.Version}}"], capture_output=True, text=True
        )
        if v.returncode == 0:
            return v.stdout.strip()
        if proc.poll() is not None or time.monotonic() > deadline:
            tail = (root / "dockerd.log").read_text(errors="replace")[-800:]
            raise ToolError(
                "dockerd did not start", command=argv, exit_code=proc.poll(), stderr=tail
            )
        time.sleep(0.2)
