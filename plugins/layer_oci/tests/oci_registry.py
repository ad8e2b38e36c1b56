"""A real OCI registry on 127.0.0.1 for tests: Debian's ``docker-registry`` (CNCF distribution)
run from our own config, with its storage in a temporary directory that goes away at exit.

    with local_registry() as reg:
        open_source(f"oci://{reg.address}/dsec?insecure=1")

The system service is never touched; ``apt-get install docker-registry`` only provides the binary.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from dsec_core.errors import ToolError
from dsec_core.testing import free_port, stop_process

__all__ = ["LocalRegistry", "free_port", "local_registry", "registry_binary"]

DEFAULT_BINARY = "/usr/bin/docker-registry"


def registry_binary() -> str | None:
    """Path of the ``docker-registry`` binary, or None if it is not installed."""
    found = shutil.which("docker-registry")
    if found:
        return found
    return DEFAULT_BINARY if Path(DEFAULT_BINARY).is_file() else None


@dataclass(frozen=True)
class LocalRegistry:
    """A running registry: where it listens, where it keeps its data, and its process."""

    host: str
    port: int
    storage: Path
    process: subprocess.Popen

    @property
    def address(self) -> str:
        """``127.0.0.1:PORT``, as the host part of an ``oci://`` URL."""
        return f"{self.host}:{self.port}"

    @property
    def base_url(self) -> str:
        return f"http://{self.address}"

    def blob_file(self, digest: str) -> Path:
        """The file the registry serves blob ``digest`` from (tests corrupt it on purpose)."""
        hexd = digest.split(":", 1)[-1]
        return (
            self.storage
            / "docker"
            / "registry"
            / "v2"
            / "blobs"
            / "sha256"
            / hexd[:2]
            / hexd
            / "data"
        )


def _bcrypt(password: str) -> str:
    """A bcrypt hash (cheapest cost: a test) for the htpasswd file, without a bcrypt package."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        try:
            import crypt
        except ImportError as e:  # Python 3.13 dropped crypt
            raise ToolError("htpasswd auth for the test registry needs the crypt module") from e
    return crypt.crypt(password, crypt.mksalt(crypt.METHOD_BLOWFISH, rounds=16))


def _config(storage: Path, port: int, auth: str | tuple[str, str] | None, workdir: Path) -> dict:
    config: dict = {
        "version": 0.1,
        "log": {"level": "error", "accesslog": {"disabled": True}},
        "storage": {
            "filesystem": {"rootdirectory": str(storage)},
            "delete": {"enabled": True},
            "maintenance": {"uploadpurging": {"enabled": False}},
        },
        "http": {"addr": f"127.0.0.1:{port}"},
    }
    if auth == "silly":
        # Answers 401 to any request without an Authorization header; enough to see that a
        # client turns "credentials refused" into a clear error.
        config["auth"] = {
            "silly": {"realm": f"http://127.0.0.1:{port}/nowhere", "service": "dsec-test"}
        }
    elif isinstance(auth, tuple):
        user, password = auth
        htpasswd = workdir / "htpasswd"
        htpasswd.write_text(f"{user}:{_bcrypt(password)}\n")
        config["auth"] = {"htpasswd": {"realm": "dsec-test", "path": str(htpasswd)}}
    elif auth is not None:
        raise ValueError(f"unknown registry auth mode {auth!r}")
    return config


def _answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=1):
            return True
    except urllib.error.HTTPError:
        return True  # 401 from an auth-enabled registry still means it is up
    except OSError:
        return False


@contextlib.contextmanager
def local_registry(
    *, auth: str | tuple[str, str] | None = None, startup_timeout: float = 15.0
) -> Iterator[LocalRegistry]:
    """Start ``docker-registry`` on a free 127.0.0.1 port; stop it and delete its data at exit.

    ``auth="silly"`` makes it refuse requests that carry no credentials (HTTP 401);
    ``auth=(user, password)`` makes it demand HTTP basic auth with that one account.
    """
    binary = registry_binary()
    if binary is None:
        raise ToolError(
            "docker-registry is not installed (apt-get install docker-registry)",
            command=["docker-registry"],
        )
    workdir = Path(tempfile.mkdtemp(prefix="dsec-registry-"))
    proc: subprocess.Popen | None = None
    try:
        storage = workdir / "storage"
        storage.mkdir()
        port = free_port()
        # YAML is a superset of JSON, so the config needs no YAML library.
        config_file = workdir / "config.yml"
        config_file.write_text(json.dumps(_config(storage, port, auth, workdir), indent=2))
        log = open(workdir / "registry.log", "wb")
        try:
            command = [binary, "serve", str(config_file)]
            proc = subprocess.Popen(
                command,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        finally:
            log.close()
        reg = LocalRegistry("127.0.0.1", port, storage, proc)
        deadline = time.monotonic() + startup_timeout
        while not _answers(f"{reg.base_url}/v2/"):
            if proc.poll() is not None or time.monotonic() > deadline:
                text = (workdir / "registry.log").read_text(errors="replace")
                raise ToolError(
                    "docker-registry did not come up"
                    + ("" if proc.poll() is None else f" (exit {proc.returncode})"),
                    command=command,
                    exit_code=proc.poll(),
                    stderr=text,
                )
            time.sleep(0.05)
        yield reg
    finally:
        if proc is not None:
            stop_process(proc)
        shutil.rmtree(workdir, ignore_errors=True)
