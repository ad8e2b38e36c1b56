"""The SDK across a node daemon restart: while the daemon is gone, requests wait for it (for up
to ``retry`` seconds) instead of failing, in both clients; a request the node may have acted on
is never sent twice; and the transport tells the cases apart against a server that breaks its
connections on purpose."""

from __future__ import annotations

import os
import signal
import socket
import threading
import time
from collections.abc import Iterator

import pytest

import dsec
from dsec_core.api.transport import AsyncHTTPTransport, HTTPTransport, TransportError
from dsec_core.localnode import daemon_pid, ensure_daemon, stop_daemon
from dsec_core.testing import KitNode, running_kit_node

GONE = 1.5  # seconds the daemon stays away in each restart


@pytest.fixture(scope="module")
def node() -> Iterator[KitNode]:
    """A node of its own: these tests stop and start its daemon."""
    if os.geteuid() != 0:
        pytest.skip("needs root")
    with running_kit_node("dsec-retry-") as node:
        yield node


def _away(node: KitNode) -> threading.Thread:
    """Stop the daemon now and start it again ``GONE`` seconds later (in a thread)."""
    stop_daemon(node.config)
    assert not node.config.socket_path.exists()
    back = threading.Timer(GONE, ensure_daemon, args=(node.config,))
    back.start()
    return back


def test_requests_wait_out_a_daemon_restart(node):
    with node.client() as client:
        sb = client.create(layers=(node.layer.ref,), memory="64M")
        for call in (
            lambda: client.list(),  # a GET
            lambda: sb.exec("echo back"),  # a POST that never reached the node
            lambda: sb.write_file("/tmp/f", b"after") or "written",  # a PUT, the same
            lambda: sb.read_file("/tmp/f"),
        ):
            back = _away(node)
            t0 = time.monotonic()
            answer = call()
            waited = time.monotonic() - t0
            back.join()
            assert waited > GONE - 0.5, "the daemon was not gone: nothing was retried"
            assert answer is not None
        assert sb.read_file("/tmp/f") == b"after"
        assert sb.exec("echo back").stdout == b"back\n"
        back = _away(node)
        sb.kill()  # a DELETE
        back.join()
        assert sb.id not in {i.id for i in client.list()}


async def test_async_requests_wait_out_a_daemon_restart(node):
    async with dsec.AsyncClient(os.fspath(node.config.socket_path)) as client:
        sb = await client.create(layers=(node.layer.ref,), memory="64M")
        assert (await sb.exec("echo before")).stdout == b"before\n"  # a pooled connection
        back = _away(node)
        t0 = time.monotonic()
        r = await sb.exec("echo after")
        assert time.monotonic() - t0 > GONE - 0.5
        back.join()
        assert r.stdout == b"after\n"
        back = _away(node)
        assert sb.id in {i.id for i in await client.list()}
        back.join()
        await sb.kill()


def test_retrying_gives_up_after_its_window(node):
    stop_daemon(node.config)
    try:
        with dsec.Client(os.fspath(node.config.socket_path), retry=1.0) as client:
            t0 = time.monotonic()
            with pytest.raises(dsec.NodeUnavailable, match="after 1s of retrying"):
                client.list()
            assert 0.9 < time.monotonic() - t0 < 5
        with dsec.Client(os.fspath(node.config.socket_path), retry=0) as client:
            t0 = time.monotonic()
            with pytest.raises(dsec.NodeUnavailable):
                client.list()
            assert time.monotonic() - t0 < 0.5
    finally:
        ensure_daemon(node.config)


def test_a_sent_exec_is_never_sent_again(node):
    """The daemon dies while it runs an exec: the client gets NodeUnavailable at once and does
    not send the exec again to the next daemon (it would run the command twice)."""
    with node.client() as client:
        sb = client.create(layers=(node.layer.ref,), memory="64M")
        outcome: list[object] = []

        def run() -> None:
            try:
                outcome.append(sb.exec("echo ran >> /root/runs; sleep 20", timeout=60))
            except dsec.DsecError as e:
                outcome.append(e)
            outcome.append(time.monotonic())

        worker = threading.Thread(target=run)
        worker.start()
        with node.client() as other:
            deadline = time.monotonic() + 10
            while b"ran" not in other.exec(sb.id, "cat /root/runs 2>/dev/null").stdout:
                assert time.monotonic() < deadline, "the exec never started"
                time.sleep(0.05)
        pid = daemon_pid(node.config)
        assert pid is not None
        os.kill(pid, signal.SIGKILL)
        killed = time.monotonic()
        worker.join(timeout=30)
        assert isinstance(outcome[0], dsec.NodeUnavailable), outcome
        assert outcome[1] - killed < 3  # not retried through a window
        # wait for the dead daemon's pid file lock to go before starting the next one
        deadline = time.monotonic() + 10
        while daemon_pid(node.config) is not None and time.monotonic() < deadline:
            time.sleep(0.05)
        ensure_daemon(node.config)
        again = client.get(sb.id)
        assert again.read_file("/root/runs") == b"ran\n"  # once
        again.kill()


class BreaksFirstConnection:
    """A server on loopback that reads the first request and closes without answering, then
    answers every later one with 200. Counts the requests it read."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.requests = 0
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    @property
    def address(self) -> str:
        return f"http://127.0.0.1:{self.sock.getsockname()[1]}"

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            with conn:
                data = b""
                while b"\r\n\r\n" not in data:
                    chunk = conn.recv(65536)
                    if not chunk:
                        break
                    data += chunk
                self.requests += 1
                if self.requests > 1:
                    conn.sendall(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")

    def close(self) -> None:
        self.sock.close()


@pytest.mark.parametrize("method, idempotent", [("GET", True), ("DELETE", True), ("POST", False)])
def test_only_idempotent_requests_are_sent_again_after_they_were_sent(method, idempotent):
    server = BreaksFirstConnection()
    t = HTTPTransport(server.address, retry=5.0)
    try:
        if idempotent:
            r = t.request(method, "/v1/x", timeout=5, idempotent=True)
            assert (r.status_code, r.content, server.requests) == (200, b"ok", 2)
        else:
            with pytest.raises(TransportError, match="without an answer"):
                t.request(method, "/v1/x", body=b"{}", timeout=5)
            assert server.requests == 1
    finally:
        t.close()
        server.close()


@pytest.mark.parametrize("method, idempotent", [("GET", True), ("POST", False)])
async def test_the_async_transport_tells_them_apart_too(method, idempotent):
    server = BreaksFirstConnection()
    t = AsyncHTTPTransport(server.address, retry=5.0)
    try:
        if idempotent:
            r = await t.request(method, "/v1/x", timeout=5, idempotent=True)
            assert (r.status_code, r.content, server.requests) == (200, b"ok", 2)
        else:
            with pytest.raises(TransportError, match="without an answer"):
                await t.request(method, "/v1/x", body=b"{}", timeout=5)
            assert server.requests == 1
    finally:
        await t.aclose()
        server.close()
