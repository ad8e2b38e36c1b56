"""A control plane for tests and benchmarks: named node daemons listening on loopback TCP, and
``dsec apiserver`` processes over them, each stopped by its pid.

    with named_nodes({"n1": {}, "n2": {}, "n3": {"dsec.pool": "overflow"}}) as nodes:
        with running_apiserver(nodes, iam_url) as api:
            dsec.Client(api.url, api_key=key)
"""

from __future__ import annotations

import contextlib
import os
import secrets
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import pytest

from ..api.transport import HTTPTransport, TransportError
from ..errors import NodeUnavailable
from .fixtures import KitNode, running_kit_node
from .procs import free_port, stop_process

__all__ = ["ApiserverProcess", "NamedNode", "NodeArgument", "named_nodes", "running_apiserver"]


class NodeArgument(Protocol):
    """A node an apiserver is started over: ``arg()`` is its ``--node NAME=URL``, ``token``
    its bearer token (a ``NamedNode``, or a simulated node's address:
    ``dsec_core.testing.fleet``)."""

    @property
    def token(self) -> str: ...

    def arg(self) -> str: ...


@dataclass
class NamedNode:
    """A kit node daemon with a cluster name, listening on ``url`` behind ``token``."""

    name: str
    url: str
    token: str
    node: KitNode
    labels: dict[str, str] = field(default_factory=dict)

    def arg(self) -> str:
        return f"{self.name}={self.url}"


@contextlib.contextmanager
def named_nodes(
    spec: Mapping[str, Mapping[str, str]], env: Mapping[str, str] | None = None
) -> Iterator[list[NamedNode]]:
    """Node daemons named as ``spec``'s keys with its values as labels, all behind one token,
    each on a free loopback port; ``env`` is more of their environment. Everything is stopped
    and checked for leftovers on exit (``running_kit_node``)."""
    token = secrets.token_urlsafe(16)
    with contextlib.ExitStack() as stack:
        out = []
        for name, labels in spec.items():
            url = f"http://127.0.0.1:{free_port()}"
            settings = {
                "DSEC_NODE_NAME": name,
                "DSEC_LISTEN": url,
                "DSEC_API_TOKEN": token,
                **dict(env or {}),
            }
            if labels:
                settings["DSEC_NODE_LABELS"] = ",".join(f"{k}={v}" for k, v in labels.items())
            with pytest.MonkeyPatch.context() as mp:
                for key, value in settings.items():
                    mp.setenv(key, value)
                node = stack.enter_context(running_kit_node(f"dsec-{name}-"))
            node.env.update(settings)  # a restart keeps its name, listener and labels
            out.append(NamedNode(name, url, token, node, dict(labels)))
        yield out


@dataclass
class ApiserverProcess:
    url: str
    proc: subprocess.Popen[bytes]
    log: Path

    def stop(self, sig: int = signal.SIGTERM) -> None:
        stop_process(self.proc, 10, sig=sig)

    def output(self) -> str:
        return self.log.read_text(errors="replace")


def start_apiserver(
    nodes: Sequence[NodeArgument],
    iam: str,
    *,
    port: int | None = None,
    args: Sequence[str] = (),
    ray: str | None = None,
    scheme: str = "http",
    token_env: bool = True,
) -> ApiserverProcess:
    """A ``dsec apiserver`` process over ``nodes`` (or Ray's), once it answers. The nodes'
    token goes in its environment (``DSEC_NODE_TOKEN``) unless ``token_env`` is false (the
    caller passes ``--node-token-file`` in ``args``)."""
    url = f"{scheme}://127.0.0.1:{port or free_port()}"
    argv = [sys.executable, "-m", "dsec_core.cli", "apiserver", "--listen", url, "--iam", iam]
    argv += ["--probe-interval", "0.5", "--probe-timeout", "0.5"]
    for n in nodes:
        argv += ["--node", n.arg()]
    env = {k: v for k, v in os.environ.items() if k not in ("DSEC_NODE_TOKEN", "DSEC_TOKEN")}
    if nodes and token_env:  # from the environment: never on a command line (/proc/PID/cmdline)
        env["DSEC_NODE_TOKEN"] = nodes[0].token
    if ray:
        argv += ["--ray", ray]
    argv += list(args)
    fd, log = tempfile.mkstemp(prefix="dsec-apiserver-", suffix=".log")
    try:
        proc = subprocess.Popen(
            argv, stdout=fd, stderr=subprocess.STDOUT, start_new_session=True, env=env
        )
    finally:
        os.close(fd)
    api = ApiserverProcess(url, proc, Path(log))
    transport = HTTPTransport(url, verify=False)
    deadline = time.monotonic() + 60
    try:
        while True:
            if proc.poll() is not None:
                raise NodeUnavailable(f"the apiserver exited: {api.output()[-2000:]}")
            try:
                transport.request("GET", "/v1/node", timeout=2)
                break
            except TransportError:
                if time.monotonic() > deadline:
                    raise NodeUnavailable(
                        f"the apiserver did not answer in 60 s: {api.output()[-2000:]}"
                    ) from None
                time.sleep(0.1)
    except BaseException:
        api.stop(signal.SIGKILL)
        Path(log).unlink(missing_ok=True)
        raise
    finally:
        transport.close()
    return api


@contextlib.contextmanager
def running_apiserver(
    nodes: Sequence[NodeArgument], iam: str, **kw: object
) -> Iterator[ApiserverProcess]:
    api = start_apiserver(nodes, iam, **kw)  # type: ignore[arg-type]
    try:
        yield api
    finally:
        api.stop()
        api.log.unlink(missing_ok=True)
