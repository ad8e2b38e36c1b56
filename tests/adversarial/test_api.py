"""Attacks on the node API itself (issue 8, failures 7 and 8): requests meant to inflate the
daemon or to break it with a 500. Each asserts a typed 4xx (never a 5xx), that the daemon's
resident memory stayed within a small bound the whole time (sampled while the attack runs, not
only after), and, through the witness, that the bystander sandbox, the layer file and the
daemon are unaffected.

A sandbox's own root makes the huge file; the requests come from a client, as a trainer whose
model wrote the file (or whose code builds the requests) would send them."""

from __future__ import annotations

import contextlib
import json
import os
import threading
import time
from collections.abc import Iterator

import pytest

import dsec
from dsec_core.agent.rpc import MAX_OUTPUT
from dsec_core.api.messages import MAX_READ
from dsec_core.api.routes import ROUTES
from dsec_core.api.transport import HTTPTransport, Response
from dsec_core.localnode import daemon_pid, ensure_daemon, stop_daemon
from dsec_core.testing import KitNode, running_kit_node

#: How far the daemon's resident memory may rise above where it was while an attack runs.
#: Before the fixes one batch create of 100000 took it up by 350 MiB, and one read of a large
#: file by twice the file.
GROWTH = 32 << 20


@contextlib.contextmanager
def memory_watched(node: KitNode, peak: int = GROWTH) -> Iterator[list[int]]:
    """Sample the daemon's RSS every 20 ms while the block runs; fail if it rose by ``peak``
    or more at any moment, or by ``GROWTH`` or more once the block is over. Yields the samples
    (the first is the baseline)."""
    samples = [node.daemon_rss()]
    done = threading.Event()

    def watch() -> None:
        while not done.wait(0.02):
            samples.append(node.daemon_rss())

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        yield samples
    finally:
        done.set()
        watcher.join()
        samples.append(node.daemon_rss())
    rise = max(samples) - samples[0]
    print(
        f"daemon RSS {samples[0] >> 20} MiB before, peak +{rise >> 20} MiB, "
        f"{samples[-1] >> 20} MiB after ({len(samples)} samples)"
    )
    assert rise < peak, f"the daemon grew by {rise >> 20} MiB while under attack"
    assert samples[-1] - samples[0] < GROWTH, "the daemon kept what the attack made it take"


@pytest.fixture
def api(dsec_node) -> Iterator[HTTPTransport]:
    """Raw HTTP to the daemon's socket, to see status codes the SDK turns into exceptions."""
    t = HTTPTransport(os.fspath(dsec_node.config.socket_path))
    yield t
    t.close()


def _call(api: HTTPTransport, method: str, target: str, body: object = None) -> Response:
    data = body if body is None or isinstance(body, bytes) else json.dumps(body).encode()
    return api.request(method, target, body=data, content_type="application/json", timeout=120)


def _typed_4xx(r: Response, kind: str, field: str | None = None) -> dict:
    assert 400 <= r.status_code < 500, (r.status_code, r.text[:500])
    error = r.json()["error"]
    assert error["type"] == kind, error
    if field is not None:
        assert field in error["context"].get("field", ""), error
    return error


@pytest.mark.attack("a batch create of a million sandboxes")
def test_huge_batch_create(dsec_node, dsec_client, api, witness):
    layer = dsec_node.layer.ref
    before = {i.id for i in dsec_client.list()}
    with memory_watched(dsec_node):
        for count in (10**6, (1 << 63) - 1, dsec_node.config.max_batch + 1):
            r = _call(api, "POST", "/v1/sandboxes", {"spec": {"layers": [layer]}, "count": count})
            error = _typed_4xx(r, "InvalidSpec", "count")
            assert error["context"]["limit"] == dsec_node.config.max_batch
        with pytest.raises(dsec.InvalidSpec, match="DSEC_MAX_BATCH"):
            dsec_client.create_many(layers=(layer,), n=10**6)
        for count in (0, -1, "9" * 30, 1.5, True):
            r = _call(api, "POST", "/v1/sandboxes", {"spec": {"layers": [layer]}, "count": count})
            _typed_4xx(r, "InvalidSpec", "count")
        # A batch the node allows, of sandboxes each too large for it: every slot is refused by
        # admission, cheaply, and the client is told so.
        with pytest.raises(dsec.AdmissionRejected):
            dsec_client.create_many(layers=(layer,), n=dsec_node.config.max_batch, memory=1 << 50)
    assert {i.id for i in dsec_client.list()} == before


#: (route, path parameters, body) with one thing mistyped each; failure 7's list and more.
MISTYPED = [
    ("create", {}, {"spec": {"layers": ["kit-base@1"], "cpu": "abc"}}, "cpu"),
    ("create", {}, {"spec": {"layers": ["kit-base@1"], "memory": [512]}}, "memory"),
    ("create", {}, {"spec": {"layers": ["kit-base@1"], "ttl": "forever"}}, "ttl"),
    ("create", {}, {"spec": {"layers": ["kit-base@1"], "env": {"A": 1}}}, "env"),
    ("create", {}, {"spec": {"layers": ["kit-base@1"], "workdir": "/a\x00b"}}, "workdir"),
    ("create", {}, {"spec": {"layers": "kit-base@1"}}, "layers"),
    ("exec", {"sid": "SB"}, {"cmd": ["echo", 5]}, "cmd"),
    ("exec", {"sid": "SB"}, {"cmd": "true", "timeout": "soon"}, "timeout"),
    ("exec", {"sid": "SB"}, {"cmd": "true", "timeout": -5}, "timeout"),
    ("exec", {"sid": "SB"}, {"cmd": "true", "stdin": 5}, "stdin"),
    ("exec", {"sid": "SB"}, {"cmd": "true", "stdin": "!!not base64"}, "stdin"),
    ("exec", {"sid": "SB"}, {"cmd": "true", "env": ["A=1"]}, "env"),
    ("exec", {"sid": "SB"}, {"cmd": "true", "env": {"A": None}}, "env"),
    ("exec", {"sid": "SB"}, {"cmd": "true", "cwd": 7}, "cwd"),
    ("session_open", {"sid": "SB"}, {"env": {"A": 1}}, "env"),
    ("set_policy", {"sid": "SB", "policy": "x"}, {"settings": [1]}, "settings"),
    ("prefetch", {}, {"refs": "kit-base@1"}, "refs"),
]


@pytest.mark.attack("mistyped JSON bodies and query strings on the API")
def test_mistyped_requests(dsec_node, dsec_sandboxes, api, witness):
    sb = dsec_sandboxes.create()
    with memory_watched(dsec_node):
        for name, params, body, field in MISTYPED:
            route = ROUTES[name]
            target = route.path.format_map(
                {k: sb.id if v == "SB" else v for k, v in params.items()}
            )
            _typed_4xx(_call(api, route.method, target, body), "InvalidSpec", field)
        base = f"/v1/sandboxes/{sb.id}/file"
        for query, field in [
            ("path=/tmp/x&mode=999", "mode"),  # not octal
            ("path=/tmp/x&mode=1755", "mode"),  # the sticky bit
            ("path=/tmp/x&offset=-1", "offset"),
            ("path=/tmp/x&truncate=perhaps", "truncate"),
            ("path=/tmp/x&offset=99999999999999999999999", "offset"),
        ]:
            _typed_4xx(_call(api, "PUT", f"{base}?{query}", b"x"), "InvalidSpec", field)
        for query, field in [
            ("path=/tmp/x&length=-2", "length"),
            ("path=/tmp/x&length=x", "length"),
        ]:
            _typed_4xx(_call(api, "GET", f"{base}?{query}"), "InvalidSpec", field)
        # the same mistakes through the SDK: InvalidSpec, never ValueError or TypeError
        for bad in (
            lambda: dsec_sandboxes.create(cpu="abc"),
            lambda: sb.exec(["echo", 5]),
            lambda: sb.exec("true", timeout="soon"),
            lambda: sb.exec("true", stdin=5),
            lambda: sb.exec("true", env={"A": 1}),
            lambda: sb.write_file("/tmp/x", b"x", mode=999),
            lambda: dsec_sandboxes.create_many(0),
        ):
            with pytest.raises(dsec.InvalidSpec):
                bad()
    assert sb.exec("ls /tmp").stdout == b""  # nothing half-done reached the sandbox


@pytest.mark.attack("read a huge sparse file (and /dev/zero) through the API")
def test_huge_sparse_read(dsec_node, dsec_sandboxes, api, witness):
    sb = dsec_sandboxes.create()
    sb.exec("truncate -s 64G /root/huge").check()  # sparse: no disk, all zeros
    target = f"/v1/sandboxes/{sb.id}/file?path="
    with memory_watched(dsec_node):
        for path in ("/root/huge", "/dev/zero"):
            r = _call(api, "GET", f"{target}{path}&length=-1")
            assert r.status_code == 200 and len(r.content) == MAX_READ  # stops at the cap
            assert not r.content.strip(b"\0")
            del r
        error = _typed_4xx(
            _call(api, "GET", f"{target}/root/huge&length={MAX_READ + 1}"), "InvalidSpec"
        )
        assert error["context"]["field"] == "length"
        # a client reading 1 GiB of it in the SDK's pieces: the daemon holds one piece at a time
        t0 = time.monotonic()
        off = 0
        while off < 1 << 30:
            r = _call(api, "GET", f"{target}/root/huge&offset={off}&length={MAX_READ}")
            assert r.status_code == 200 and len(r.content) == MAX_READ
            off += len(r.content)
            del r
        print(f"read 1 GiB through the API in {time.monotonic() - t0:.1f}s")


@pytest.mark.attack("an exec with an absurd max_output, and a flood at the real cap")
def test_absurd_max_output(dsec_node, dsec_sandboxes, api, witness):
    sb = dsec_sandboxes.create()
    # While the answer is built the daemon holds the output and its base64 and JSON forms: a
    # few times the 16 MiB cap at the peak, whatever the command printed, and nothing after.
    with memory_watched(dsec_node, peak=8 * MAX_OUTPUT):
        for max_output in (1 << 40, (1 << 63) - 1, MAX_OUTPUT + 1, -1):
            body = {"cmd": "touch /root/ran; yes", "timeout": 2, "max_output": max_output}
            r = _call(api, "POST", f"/v1/sandboxes/{sb.id}/exec", body)
            _typed_4xx(r, "InvalidSpec", "max_output")
        assert sb.exec("ls /root").stdout == b""  # refused before anything ran
        with pytest.raises(dsec.InvalidSpec, match="max_output"):
            sb.exec("yes", timeout=2, max_output=1 << 40)
        # At the cap itself the flood is cut at 16 MiB per stream, and what the daemon held
        # for it (the output, then its base64 answer) is bounded by that, not by the flood.
        r = sb.exec("yes", timeout=2, max_output=MAX_OUTPUT)
        assert r.truncated and len(r.stdout) == MAX_OUTPUT
        del r


@pytest.mark.attack("restart the node daemon under a client in use (failure 8)")
def test_a_client_outlives_a_daemon_restart(witness):
    # A private node: restarting the session's shared daemon would fail other tests' calls.
    with running_kit_node("dsec-kit-restart-") as node, node.client() as client:
        sb = client.create(layers=(node.layer.ref,), memory="64M")
        assert sb.exec("echo before").stdout == b"before\n"  # a pooled connection exists now
        old = daemon_pid(node.config)
        stop_daemon(node.config)
        restarter = threading.Timer(1.0, ensure_daemon, args=(node.config,))
        restarter.start()
        try:
            # sent while no daemon answers: the client waits it out instead of failing
            assert [i.id for i in client.list()] == [sb.id]
            assert sb.exec("echo after").stdout == b"after\n"
        finally:
            restarter.join()
        assert daemon_pid(node.config) not in (None, old)
        sb.kill()
