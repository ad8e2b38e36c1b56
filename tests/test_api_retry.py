"""The SDK across a node daemon restart: while the daemon is gone, requests wait for it (for up
to ``retry`` seconds) instead of failing, in both clients; a request the node may have acted on
is never sent twice; and the transport tells the cases apart against a server that breaks its
connections on purpose."""

from __future__ import annotations

import asyncio
import contextlib
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
                _read_message(conn)
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


def _read_message(conn: socket.socket) -> bytes:
    """One HTTP message (a head and its content-length body) read from ``conn``."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = conn.recv(65536)
        if not chunk:
            return data
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    length = 0
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            length = int(value)
    while len(body) < length:
        chunk = conn.recv(65536)
        if not chunk:
            break
        body += chunk
    return head + b"\r\n\r\n" + body


class LosesFirstAnswer:
    """A loopback proxy to a node's unix socket that hands the first request on, reads the
    node's answer and drops the connection without passing it on (the answer lost on the
    way, as when a node or a network breaks just then); later connections go through."""

    def __init__(self, socket_path: os.PathLike[str]) -> None:
        self.upstream = os.fspath(socket_path)
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.lost: list[bytes] = []
        self.sent: list[bytes] = []  # the head lines of the request it lost the answer of
        threading.Thread(target=self._serve, daemon=True).start()

    @property
    def address(self) -> str:
        return f"http://127.0.0.1:{self.sock.getsockname()[1]}"

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            up = socket.socket(socket.AF_UNIX)
            up.connect(self.upstream)
            if not self.lost:
                with conn, up:
                    request = _read_message(conn)
                    self.sent = request.partition(b"\r\n\r\n")[0].split(b"\r\n")
                    up.sendall(request)
                    self.lost.append(_read_message(up))
                continue
            for a, b in ((conn, up), (up, conn)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    @staticmethod
    def _pump(src: socket.socket, dst: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while chunk := src.recv(65536):
                dst.sendall(chunk)
        with contextlib.suppress(OSError):
            dst.shutdown(socket.SHUT_WR)

    def close(self) -> None:
        self.sock.close()


def lost_keys(proxy: LosesFirstAnswer) -> list[str]:
    """The create keys of what the proxy saw sent."""
    return [
        line.split(b":", 1)[1].strip().decode()
        for line in proxy.sent
        if line.lower().startswith(b"idempotency-key:")
    ]


def test_a_create_whose_answer_was_lost_is_sent_again_and_made_once(node):
    """The SDK sends a create again when its answer never came (the node may have made it):
    the create key it carries makes the node answer with the sandbox it made, not a second."""
    proxy = LosesFirstAnswer(node.config.socket_path)
    try:
        with dsec.Client(proxy.address, retry=10.0) as client:
            sb = client.create(layers=(node.layer.ref,), memory="64M", labels={"t": "lost"})
        assert len(proxy.lost) == 1 and b" 201 " in proxy.lost[0].split(b"\r\n")[0]
        assert sb.id.encode() in proxy.lost[0]  # the answer that never came named it
        with node.client() as c:
            made = [i for i in c.list() if i.labels.get("t") == "lost"]
            assert [i.id for i in made] == [sb.id]
            assert dsec.CREATE_KEY_LABEL not in made[0].labels  # the node's, not shown
            (key,) = [k for k in lost_keys(proxy) if k]
            # the same key again, from anywhere: the same sandbox; once it is gone, a new one
            assert c.create(layers=(node.layer.ref,), memory="64M", key=key).id == sb.id
            _away(node).join()  # a restarted daemon knows it from the sandbox's state
            assert c.create(layers=(node.layer.ref,), memory="64M", key=key).id == sb.id
            c.kill(sb.id)
            again = c.create(layers=(node.layer.ref,), memory="64M", key=key)
            assert again.id != sb.id
            again.kill()
    finally:
        proxy.close()


async def test_creates_under_one_key_make_one_sandbox_and_members_one_each(node):
    async with dsec.AsyncClient(os.fspath(node.config.socket_path)) as c:
        spec = dsec.SandboxSpec(layers=(node.layer.ref,), memory="64M")
        racing = await asyncio.gather(*(c.create(spec, key="race-1") for _ in range(4)))
        assert len({sb.id for sb in racing}) == 1
        many = await c.create_many(spec, n=3, key="batch-1")
        assert len({sb.id for sb in many}) == 3
        assert [sb.id for sb in await c.create_many(spec, n=3, key="batch-1")] == [
            sb.id for sb in many
        ]
        with pytest.raises(dsec.InvalidSpec, match="create key"):
            await c.create(spec, key="has a space")
        for sb in (racing[0], *many):
            await sb.kill()
