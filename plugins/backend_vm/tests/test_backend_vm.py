"""The full-VM backend (``vm``) end to end through a node daemon: a sandbox from the kit's
busybox base plus a layer holding clickpad (a static program that draws a button on the
framebuffer and reports clicks and keys) boots, starts clickpad with ``exec``, and is seen and
driven through the node's screen API: a screenshot shows the button red, a click turns it
green and clickpad logs it, a key reaches it. Bad input is a typed 400 over the API, a
container sandbox has no screen, VNC answers on loopback, and the conformance kit runs as for
every backend. Nothing is left behind: the kit's leftover checks, and no QEMU process."""

from __future__ import annotations

import base64
import json
import os
import shutil
import socket
import struct
import subprocess
import sys
import tempfile
import time
import zlib
from collections.abc import Iterator
from pathlib import Path

import pytest
from dsec_backend_vm.guest import ensure_guest_program

from dsec_core.api.messages import InputRequest
from dsec_core.api.transport import HTTPTransport
from dsec_core.errors import BackendUnavailable, FeatureUnavailable, InvalidSpec, SandboxError
from dsec_core.layers.build import build_layer
from dsec_core.layers.store import LayerStore
from dsec_core.screen_input import MAX_EVENTS, Click, Key, Move, input_dicts, parse_inputs
from dsec_core.testing import BackendConformance
from dsec_core.testing.fixtures import KitNode, running_kit_node
from dsec_core.vm.qmp import QMP_SOCKET, Qmp, qmp_execute

pytestmark = pytest.mark.skipif(
    shutil.which("qemu-system-x86_64") is None, reason="QEMU is not installed"
)

# clickpad.c's button (half-open) and colours
BUTTON = (100, 100, 300, 180)
RED, GREEN = (0xFF, 0, 0), (0, 0xFF, 0)
CENTRE = ((BUTTON[0] + BUTTON[2]) // 2, (BUTTON[1] + BUTTON[3]) // 2)
CLICKPAD = "/usr/local/bin/clickpad"
LOG = "/tmp/clickpad.log"


def _qemu_pids(text: str) -> list[int]:
    """QEMU processes whose command line mentions ``text``."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                cmd = (entry / "cmdline").read_bytes()
            except OSError:
                continue
            if cmd.startswith(b"qemu-system") or b"/qemu-system" in cmd.split(b"\0")[0]:
                if text.encode() in cmd:
                    found.append(int(entry.name))
    return found


@pytest.fixture(scope="module")
def dsec_node() -> Iterator[KitNode]:
    """This module's node: VNC on (``DSEC_VM_VNC=1``), the clickpad layer in its store."""
    if os.geteuid() != 0:
        pytest.skip("a dsec node needs root")
    saved = os.environ.get("DSEC_VM_VNC")
    os.environ["DSEC_VM_VNC"] = "1"  # the daemon inherits it (restarts too)
    try:
        with running_kit_node("dsec-kit-vm-") as node:
            yield node
            home = os.fspath(node.home)
        assert not _qemu_pids(home), "a QEMU of this node survived"
    finally:
        if saved is None:
            os.environ.pop("DSEC_VM_VNC", None)
        else:
            os.environ["DSEC_VM_VNC"] = saved


@pytest.fixture(scope="module")
def clickpad_layer(dsec_node: KitNode) -> str:
    """A layer over the kit's base holding the static clickpad at ``CLICKPAD``."""
    with tempfile.TemporaryDirectory(prefix="dsec-clickpad-") as tmp:
        binary = ensure_guest_program("clickpad", Path(tmp) / "bin")
        root = Path(tmp) / "root"
        (root / "usr/local/bin").mkdir(parents=True)
        shutil.copy2(binary, root / CLICKPAD.lstrip("/"))
        info = build_layer(
            root,
            name="clickpad",
            version="1",
            kind="toolkit",
            store=LayerStore(dsec_node.config.layer_dir),
        )
    return info.ref


# ---- a PNG reader (zlib only) ------------------------------------------------------------------


def decode_png(png: bytes, upto: int = BUTTON[3] + 1) -> tuple[int, int, list[bytes]]:
    """``(width, height, rows)`` of an 8-bit RGB or RGBA PNG, each row as RGB bytes; only the
    first ``upto`` rows are decoded (all the checks look at; pure Python is slow)."""
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    pos, idat, header = 8, b"", None
    while pos < len(png):
        (length,) = struct.unpack(">I", png[pos : pos + 4])
        kind, body = png[pos + 4 : pos + 8], png[pos + 8 : pos + 8 + length]
        if kind == b"IHDR":
            header = struct.unpack(">IIBBBBB", body)
        elif kind == b"IDAT":
            idat += body
        pos += 12 + length
    assert header is not None
    width, height, depth, colour = header[:4]
    assert depth == 8 and colour in (2, 6), header
    bpp = 3 if colour == 2 else 4
    raw, stride = zlib.decompress(idat), width * bpp
    rows, prev = [], bytearray(stride)
    for y in range(min(height, upto)):
        start = y * (stride + 1)
        kind, line = raw[start], bytearray(raw[start + 1 : start + 1 + stride])
        for i in range(stride):
            a = line[i - bpp] if i >= bpp else 0
            b, c = prev[i], prev[i - bpp] if i >= bpp else 0
            if kind == 1:
                line[i] = (line[i] + a) & 0xFF
            elif kind == 2:
                line[i] = (line[i] + b) & 0xFF
            elif kind == 3:
                line[i] = (line[i] + (a + b) // 2) & 0xFF
            elif kind == 4:
                p = a + b - c
                pa, pb, pc = abs(p - a), abs(p - b), abs(p - c)
                line[i] = (line[i] + (a if pa <= pb and pa <= pc else b if pb <= pc else c)) & 0xFF
        prev = line
        rows.append(bytes(line) if bpp == 3 else bytes(v for j, v in enumerate(line) if j % 4 != 3))
    return width, height, rows


def pixel(rows: list[bytes], x: int, y: int) -> tuple[int, int, int]:
    r, g, b = rows[y][3 * x : 3 * x + 3]
    return r, g, b


def _screen_until(sb, colour: tuple[int, int, int], timeout: float = 20) -> list[bytes]:
    """Screenshots until the button's centre shows ``colour`` (the framebuffer reaches the
    card a little after the guest writes it)."""
    deadline = time.monotonic() + timeout
    while True:
        _, _, rows = decode_png(sb.screenshot())
        if pixel(rows, *CENTRE) == colour:
            return rows
        assert time.monotonic() < deadline, f"the button never showed {colour}"
        time.sleep(0.2)


def _log_until(sb, text: str, timeout: float = 30) -> str:
    deadline = time.monotonic() + timeout
    while True:
        log = sb.exec(f"cat {LOG} 2>/dev/null; true").stdout.decode()
        if text in log:
            return log
        assert time.monotonic() < deadline, f"no {text!r} in clickpad's log: {log!r}"
        time.sleep(0.2)


# ---- the screen end to end ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def dsec_backend_name() -> str:
    return "vm"


@pytest.mark.slow
def test_a_click_turns_the_button_green_and_a_key_arrives(
    dsec_sandboxes, clickpad_layer, dsec_node
):
    started = time.monotonic()
    sb = dsec_sandboxes.create(layers=(clickpad_layer, dsec_node.layer.ref), memory="512M")
    sb.exec("true").check()
    first_exec = time.monotonic() - started
    sb.exec(f"{CLICKPAD} > {LOG} 2>&1 &", background=True).check()
    ready = _log_until(sb, "ready ")
    width, height = (int(n) for n in ready.split("ready ")[1].split()[0].split("x"))

    t0 = time.monotonic()
    png = sb.screenshot()
    took = time.monotonic() - t0
    print(f"create to first exec {first_exec:.1f}s; screenshot {1e3 * took:.0f} ms")
    assert decode_png(png)[:2] == (width, height)
    rows = _screen_until(sb, RED)
    x0, y0, x1, y1 = BUTTON
    assert pixel(rows, x0, y0) == RED and pixel(rows, x1 - 1, y1 - 1) == RED
    assert pixel(rows, x1, y1 - 1) != RED and pixel(rows, 10, 10) != RED

    assert sb.input([{"type": "click", "x": 200, "y": 140}]) == 1
    after = _screen_until(sb, GREEN)
    assert pixel(after, x0, y0) == GREEN and pixel(after, x1, y1 - 1) == pixel(rows, x1, y1 - 1)
    assert "clicked 1" in _log_until(sb, "clicked 1")

    # a click beside the button is a miss; records work as dicts do
    sb.input([Click(x1, y0)])
    _log_until(sb, f"miss {x1} {y0}")
    sb.input([Key("a")])
    _log_until(sb, "key 30")  # KEY_A
    assert "clicked 2" not in _log_until(sb, "key 30")
    with pytest.raises(InvalidSpec):
        sb.input([{"type": "key", "key": "nosuchkey"}])  # QEMU refuses it: a typed error
    with pytest.raises(InvalidSpec):
        sb.input([{"type": "click", "x": width, "y": 0}])  # off the screen


@pytest.mark.slow
def test_bad_input_is_a_typed_400_over_the_api(dsec_sandboxes, dsec_node):
    sb = dsec_sandboxes.create()
    t = HTTPTransport(os.fspath(dsec_node.config.socket_path))
    try:
        for body in (
            {"events": [{"type": "click", "x": -1, "y": 0}]},
            {"events": [{"type": "scroll"}]},
            {"events": []},
            {"events": "click"},
            {},
        ):
            r = t.request(
                "POST",
                f"/v1/sandboxes/{sb.id}/input",
                body=json.dumps(body).encode(),
                content_type="application/json",
                timeout=30,
            )
            assert r.status_code == 422, (body, r.status_code, r.content)
            assert r.json()["error"]["type"] == "InvalidSpec", body
        r = t.request("GET", f"/v1/sandboxes/{sb.id}/screenshot", timeout=60)
        assert r.status_code == 200 and r.headers["content-type"] == "image/png"
        assert r.content.startswith(b"\x89PNG")
    finally:
        t.close()


@pytest.mark.slow
def test_vnc_answers_on_loopback(dsec_sandboxes):
    sb = dsec_sandboxes.create()
    assert sb.info.vnc is not None and sb.info.vnc.startswith("127.0.0.1:"), sb.info
    host, port = sb.info.vnc.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=10) as s:
        assert s.recv(12).startswith(b"RFB ")
    sb.kill()
    with pytest.raises(OSError), socket.create_connection((host, int(port)), timeout=2):
        pass


def test_input_records_and_their_wire_form():
    events = [Key("a"), Move(1, 2), Click(3, 4, "right"), {"type": "click", "x": 5, "y": 6}]
    assert input_dicts(events) == [
        {"type": "key", "key": "a"},
        {"type": "move", "x": 1, "y": 2},
        {"type": "click", "x": 3, "y": 4, "button": "right"},
        {"type": "click", "x": 5, "y": 6, "button": "left"},
    ]
    assert parse_inputs(input_dicts(events))[:3] == events[:3]
    assert InputRequest(tuple(input_dicts(events))).to_dict()["events"][0] == {
        "type": "key",
        "key": "a",
    }
    for bad in ([], [{"type": "key", "key": "a"}] * (MAX_EVENTS + 1), [{"type": "move"}]):
        with pytest.raises(InvalidSpec):
            InputRequest(tuple(bad))


def _dsec(node: KitNode, *args: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, DSEC_HOME=os.fspath(node.home))
    return subprocess.run(
        [sys.executable, "-m", "dsec_core.cli", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


async def _mcp_screen_tools(node: KitNode, sid: str) -> None:
    """``dsec mcp``'s screenshot (an MCP image) and input tools on a VM, through the official
    ``mcp`` client (tests/test_mcp.py has the rest of the server; a VM of its own would double
    that module's time)."""
    from mcp.client.session import ClientSession
    from mcp.client.stdio import StdioServerParameters, stdio_client

    params = StdioServerParameters(
        command=sys.executable,
        args=["-m", "dsec_core.cli", "mcp"],
        env={"DSEC_ADDRESS": f"unix://{node.config.socket_path}"},
    )
    async with stdio_client(params) as (read, write), ClientSession(read, write) as mcp:
        await mcp.initialize()
        shot = await mcp.call_tool("screenshot", {"sandbox_id": sid})
        assert not shot.is_error, shot
        (image,) = shot.content
        assert image.type == "image" and image.mime_type == "image/png"
        assert base64.b64decode(image.data).startswith(b"\x89PNG")
        events = [{"type": "move", "x": 10, "y": 10}, {"type": "key", "key": "a"}]
        sent = await mcp.call_tool("input", {"sandbox_id": sid, "events": events})
        assert sent.structured_content == {"sent": 2}
        bad = await mcp.call_tool(
            "input", {"sandbox_id": sid, "events": [{"type": "key", "key": "no such key"}]}
        )
        assert bad.is_error and bad.structured_content["type"] == "InvalidSpec"


@pytest.mark.slow
async def test_cli_and_qmp_helper(dsec_sandboxes, dsec_node, tmp_path):
    sb = dsec_sandboxes.create()
    out = tmp_path / "screen.png"
    done = _dsec(dsec_node, "sandbox", "screenshot", sb.id, "-o", os.fspath(out))
    assert done.returncode == 0, done.stderr
    assert out.read_bytes().startswith(b"\x89PNG")
    done = _dsec(dsec_node, "sandbox", "input", sb.id, "--click", "5,5", "--key", "a")
    assert done.returncode == 0 and "sent 2 event(s)" in done.stdout, done.stderr
    done = _dsec(dsec_node, "sandbox", "input", sb.id, "--click", "5")
    assert done.returncode != 0 and "X,Y" in done.stderr and "Traceback" not in done.stderr
    done = _dsec(dsec_node, "sandbox", "input", sb.id, "--key", "no such key")
    assert done.returncode == 1 and "Error: " in done.stderr and "Traceback" not in done.stderr
    await _mcp_screen_tools(dsec_node, sb.id)

    # the QMP helper the backend uses: answers, QEMU's refusals and a missing QEMU are typed
    sock = dsec_node.config.run_dir / "sandboxes" / sb.id / QMP_SOCKET
    assert (await qmp_execute(sock, "query-status", sandbox_id=sb.id))["status"] == "running"
    async with Qmp(sock, sb.id) as qmp:
        with pytest.raises(SandboxError) as e:
            await qmp.execute("no-such-command")
        assert e.value.qmp_class == "CommandNotFound" and e.value.command == "no-such-command"
        assert e.value.sandbox_id == sb.id
    with pytest.raises(SandboxError) as e:
        await qmp_execute(tmp_path / "nothing.sock", "query-status")
    assert "qmp_class" not in e.value.context


def test_a_container_sandbox_has_no_screen(dsec_sandboxes):
    dsec_sandboxes.default_spec["backend"] = "container"
    sb = dsec_sandboxes.create()
    with pytest.raises(FeatureUnavailable) as e:  # a BackendUnavailable, but the client's error
        sb.screenshot()
    assert e.value.feature == "screen" and e.value.http_status == 409
    assert isinstance(e.value, BackendUnavailable)
    with pytest.raises(FeatureUnavailable):
        sb.input([{"type": "key", "key": "a"}])


# ---- the conformance kit ------------------------------------------------------------------------


class TestFullVmBackend(BackendConformance):
    backend_name = "vm"
