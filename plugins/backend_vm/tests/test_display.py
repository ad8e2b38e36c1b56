"""A VM's display and input end to end: a q35 guest (Debian's generic kernel, virtio-gpu, a
virtio tablet) runs clickpad, a button on its framebuffer; screenshots over QMP show it red,
a click through ``input-send-event`` turns it green and nothing else, a click beside it does
not count and a key press arrives. Also, without a VM: PPM to PNG, input parsing and its
errors, pointer scaling and the guest program's cached build."""

from __future__ import annotations

import asyncio
import os
import queue
import shutil
import socket
import struct
import subprocess
import tempfile
import threading
import time
import zlib
from collections.abc import Iterator
from pathlib import Path

import pytest
from dsec_backend_vm.display import DISPLAY_KERNEL_PACKAGE, DISPLAY_MODULES, display_qemu_args
from dsec_backend_vm.guest import ensure_guest_program
from dsec_backend_vm.screen import (
    ABS_MAX,
    Click,
    Key,
    Move,
    event_batches,
    parse_input,
    parse_inputs,
    png_size,
    ppm_to_png,
    screendump_png,
    send_input,
)
from qemu.qmp import ExecuteError, QMPClient
from qemu.qmp.message import Message
from qemu.qmp.models import ErrorResponse

from dsec_core.errors import GuestImageError, InvalidSpec
from dsec_core.vm.guest import build_initramfs, ensure_kernel
from dsec_core.vm.vmlinux import ensure_vmlinux, vmlinux_from_bzimage

#: Shared by test runs on this machine (as in tests/test_vm_guest.py), so the kernel package
#: is downloaded once.
KERNEL_CACHE = Path(os.environ.get("DSEC_TEST_KERNELS", "/var/cache/dsec-test-kernels"))
VMLINUX_CACHE = KERNEL_CACHE.with_name(KERNEL_CACHE.name + "-vmlinux")

# clickpad.c's button, half-open, and its colours
BUTTON = (100, 100, 300, 180)  # x0, y0, x1, y1
BACKGROUND, RED, GREEN = (0x20, 0x30, 0x40), (0xFF, 0, 0), (0, 0xFF, 0)


# ---- a PNG reader for the checks (zlib only) ---------------------------------------------------


def _paeth(a: int, b: int, c: int) -> int:
    p = a + b - c
    pa, pb, pc = abs(p - a), abs(p - b), abs(p - c)
    return a if pa <= pb and pa <= pc else b if pb <= pc else c


def decode_png(png: bytes) -> tuple[int, int, list[bytes]]:
    """``(width, height, rows)`` of an 8-bit RGB or RGBA PNG, each row as RGB bytes."""
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    pos, idat, header = 8, b"", None
    while pos < len(png):
        (length,) = struct.unpack(">I", png[pos : pos + 4])
        kind, body = png[pos + 4 : pos + 8], png[pos + 8 : pos + 8 + length]
        (crc,) = struct.unpack(">I", png[pos + 8 + length : pos + 12 + length])
        assert zlib.crc32(kind + body) & 0xFFFFFFFF == crc, kind
        if kind == b"IHDR":
            header = struct.unpack(">IIBBBBB", body)
        elif kind == b"IDAT":
            idat += body
        elif kind == b"IEND":
            break
        pos += 12 + length
    assert header is not None
    width, height, depth, colour, _, _, interlace = header
    assert depth == 8 and colour in (2, 6) and interlace == 0, header
    bpp = 3 if colour == 2 else 4
    raw, stride = zlib.decompress(idat), width * bpp
    rows, prev = [], bytearray(stride)
    for y in range(height):
        kind, row = (
            raw[y * (stride + 1)],
            bytearray(raw[y * (stride + 1) + 1 : (y + 1) * (stride + 1)]),
        )
        if kind == 1:
            for i in range(bpp, stride):
                row[i] = (row[i] + row[i - bpp]) & 0xFF
        elif kind == 2:
            row = bytearray((a + b) & 0xFF for a, b in zip(row, prev, strict=True))
        elif kind == 3:
            for i in range(stride):
                left = row[i - bpp] if i >= bpp else 0
                row[i] = (row[i] + ((left + prev[i]) >> 1)) & 0xFF
        elif kind == 4:
            for i in range(stride):
                left = row[i - bpp] if i >= bpp else 0
                up_left = prev[i - bpp] if i >= bpp else 0
                row[i] = (row[i] + _paeth(left, prev[i], up_left)) & 0xFF
        else:
            assert kind == 0, kind
        prev = row
        rows.append(bytes(row) if bpp == 3 else bytes(b for i, b in enumerate(row) if i % 4 != 3))
    return width, height, rows


def pixel(rows: list[bytes], x: int, y: int) -> tuple[int, int, int]:
    r, g, b = rows[y][3 * x : 3 * x + 3]
    return r, g, b


# ---- without a VM ------------------------------------------------------------------------------


def test_ppm_to_png_keeps_every_pixel():
    width, height = 5, 3
    pixels = b"".join(bytes((x * 40, y * 100, x + y)) for y in range(height) for x in range(width))
    ppm = b"P6\n# made by a test\n5 3\n255\n" + pixels
    png = ppm_to_png(ppm)
    assert png_size(png) == (5, 3)
    w, h, rows = decode_png(png)
    assert (w, h) == (5, 3)
    assert b"".join(rows) == pixels
    assert pixel(rows, 4, 2) == (160, 200, 6)


@pytest.mark.parametrize(
    "ppm",
    [
        b"P5\n5 3\n255\n" + b"\0" * 15,  # greyscale
        b"P6\n5 3\n65535\n" + b"\0" * 90,  # 16-bit samples
        b"P6\n5 3\n255\n" + b"\0" * 44,  # one byte short
        b"P6\n5 x\n255\n",
        b"P6\n5",
    ],
)
def test_ppm_to_png_refuses_what_it_cannot_read(ppm):
    with pytest.raises(InvalidSpec):
        ppm_to_png(ppm)


def test_png_size_refuses_other_data():
    with pytest.raises(InvalidSpec):
        png_size(b"GIF89a" + b"\0" * 30)


def test_parse_inputs():
    assert parse_inputs(
        [
            {"type": "key", "key": "a"},
            {"type": "move", "x": 3, "y": 4},
            {"type": "click", "x": 5, "y": 6},
            {"type": "click", "x": 5, "y": 6, "button": "right"},
        ]
    ) == [Key("a"), Move(3, 4), Click(5, 6, "left"), Click(5, 6, "right")]


@pytest.mark.parametrize(
    ("spec", "field"),
    [
        ({"type": "scroll"}, "type"),
        ({"key": "a"}, "type"),
        ({"type": "key"}, "key"),
        ({"type": "key", "key": "A b"}, "key"),
        ({"type": "key", "key": 30}, "key"),
        ({"type": "move", "x": 1}, "y"),
        ({"type": "move", "x": -1, "y": 0}, "x"),
        ({"type": "move", "x": 1.5, "y": 0}, "x"),
        ({"type": "move", "x": True, "y": 0}, "x"),
        ({"type": "move", "x": 1, "y": 2, "button": "left"}, "button"),
        ({"type": "click", "x": 1, "y": 2, "button": "thumb"}, "button"),
        ({"type": "click", "x": 1, "y": "2"}, "y"),
    ],
)
def test_parse_input_errors_name_the_field(spec, field):
    with pytest.raises(InvalidSpec) as e:
        parse_input(spec)
    assert e.value.field == field


def test_parse_inputs_errors_say_which_event():
    with pytest.raises(InvalidSpec) as e:
        parse_inputs([{"type": "key", "key": "a"}, {"type": "move"}])
    assert e.value.index == 1 and "input event 1" in str(e.value)
    with pytest.raises(InvalidSpec):
        parse_inputs({"type": "key", "key": "a"})  # type: ignore[arg-type]
    with pytest.raises(InvalidSpec):
        parse_inputs(["key"])  # type: ignore[list-item]


def test_event_batches_scale_to_pixel_centres():
    width, height = 1280, 800
    for x, y in [(0, 0), (200, 140), (1279, 799), (639, 400)]:
        [[ex, ey]] = event_batches(Move(x, y), width, height)
        vx, vy = ex["data"]["value"], ey["data"]["value"]
        assert 0 <= vx <= ABS_MAX and 0 <= vy <= ABS_MAX
        # how the guest (clickpad, and Linux's evdev users) scales the value back
        assert (vx * width // (ABS_MAX + 1), vy * height // (ABS_MAX + 1)) == (x, y)
    press, release = event_batches(Click(1, 2, "right"), width, height)
    assert press[-1] == {"type": "btn", "data": {"down": True, "button": "right"}}
    assert release == [{"type": "btn", "data": {"down": False, "button": "right"}}]
    down, up = event_batches(Key("ret"), width, height)
    assert down[0]["data"] == {"down": True, "key": {"type": "qcode", "data": "ret"}}
    assert up[0]["data"]["down"] is False
    with pytest.raises(InvalidSpec):
        event_batches(Click(1280, 0), width, height)


class FakeQMP:
    """Answers screendump as a QEMU without PNG support does: PPM only."""

    def __init__(self) -> None:
        self.calls: list[dict] = []

    async def execute(self, command: str, args: dict) -> dict:
        self.calls.append(args)
        if "format" in args:
            error = {"error": {"class": "GenericError", "desc": "Parameter 'format' is unexpected"}}
            raise ExecuteError(ErrorResponse(error), Message({"execute": command}), Message(error))
        Path(args["filename"]).write_bytes(b"P6 2 1 255\n" + bytes([1, 2, 3, 4, 5, 6]))
        return {}


async def test_screendump_falls_back_to_ppm():
    qmp = FakeQMP()
    png = await screendump_png(qmp)  # type: ignore[arg-type]
    _, _, rows = decode_png(png)
    assert rows == [bytes([1, 2, 3, 4, 5, 6])]
    assert [c.get("format") for c in qmp.calls] == ["png", None]
    assert not Path(qmp.calls[0]["filename"]).parent.exists()  # its temporary directory is gone


def test_guest_program_is_built_once(tmp_path):
    first = ensure_guest_program("clickpad", tmp_path)
    assert ensure_guest_program("clickpad", tmp_path) == first
    assert os.access(first, os.X_OK) and first.name.startswith("clickpad-")
    assert [p.name for p in tmp_path.iterdir()] == [first.name]
    with pytest.raises(InvalidSpec):
        ensure_guest_program("../clickpad", tmp_path)
    with pytest.raises(InvalidSpec):
        ensure_guest_program("nosuch", tmp_path)


def test_vmlinux_from_bzimage_refuses_other_files():
    with pytest.raises(GuestImageError, match="not a bzImage"):
        vmlinux_from_bzimage(b"\x7fELF" + b"\0" * 1000)
    fake = bytearray(0x1000)
    fake[0x1F1] = 1
    fake[0x202:0x206] = b"HdrS"
    fake[0x206:0x208] = (0x20F).to_bytes(2, "little")
    fake[0x248:0x250] = (0).to_bytes(4, "little") + (16).to_bytes(4, "little")
    fake[0x400:0x410] = b"BZh9 not xz nor gz"[:16]
    with pytest.raises(GuestImageError, match="not handled"):
        vmlinux_from_bzimage(bytes(fake))
    fake[0x400:0x410] = b"\xfd7zXZ\x00" + b"\0" * 10
    with pytest.raises(GuestImageError, match="does not decompress"):
        vmlinux_from_bzimage(bytes(fake))


# ---- a VM --------------------------------------------------------------------------------------

CLICKPAD_INIT = b"""#!/bin/sh
/bin/busybox mount -t devtmpfs dev /dev
/bin/busybox mount -t proc proc /proc
/bin/busybox mount -t sysfs sys /sys
for m in $(/bin/busybox cat /lib/modules/order); do
  /bin/busybox insmod /lib/modules/$m.ko || echo "insmod $m failed"
done
n=0
while [ ! -e /dev/fb0 ] && [ $n -lt 100 ]; do /bin/busybox sleep 0.1; n=$((n+1)); done
exec /bin/clickpad
"""


def _free_vnc_display() -> int:
    for n in range(60, 100):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", 5900 + n))
            except OSError:
                continue
            return n
    pytest.skip("no free VNC port in 5960..5999 on loopback")


def _processes_mentioning(text: str) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        if text.encode() in cmdline:
            found.append(int(entry.name))
    return found


class ClickpadVM:
    """A running guest: its QMP socket, VNC display and serial console lines."""

    def __init__(self, proc: subprocess.Popen[bytes], qmp_path: Path, vnc: int) -> None:
        self.proc, self.qmp_path, self.vnc = proc, qmp_path, vnc
        self.console: list[str] = []
        self.ready = ""  # clickpad's "ready WxH" line
        self._lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for raw in self.proc.stdout:
            self._lines.put(raw.decode(errors="replace").rstrip("\r\n"))
        self._lines.put(None)

    def expect(self, prefix: str, timeout: float = 30) -> str:
        """The next console line that starts with ``prefix``; others are kept in ``console``."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                line = self._lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise AssertionError(
                    f"no {prefix!r} in {timeout}s; console:\n" + "\n".join(self.console)
                ) from None
            if line is None:
                raise AssertionError(
                    f"QEMU ended before {prefix!r}; console:\n" + "\n".join(self.console)
                )
            self.console.append(line)
            if line.startswith(prefix):
                return line

    async def qmp(self) -> QMPClient:
        client = QMPClient("dsec-test")
        await client.connect(str(self.qmp_path))
        return client


@pytest.fixture(scope="module")
def vm() -> Iterator[ClickpadVM]:
    if not shutil.which("qemu-system-x86_64"):
        pytest.skip("qemu-system-x86_64 is not installed (apt-get install qemu-system-x86)")
    if not shutil.which("apt-get") or not shutil.which("dpkg-deb"):
        pytest.skip("fetching the guest kernel needs apt-get and dpkg-deb")
    kernel = ensure_kernel(KERNEL_CACHE, package=DISPLAY_KERNEL_PACKAGE)
    vmlinux = ensure_vmlinux(kernel.vmlinuz, VMLINUX_CACHE)  # boots 3 s sooner than vmlinuz
    workdir = Path(tempfile.mkdtemp(prefix="dsec-vm-display-"))
    proc = None
    try:
        clickpad = ensure_guest_program("clickpad", workdir)
        initrd = build_initramfs(
            workdir, kernel, DISPLAY_MODULES, {"/init": CLICKPAD_INIT, "/bin/clickpad": clickpad}
        )
        qmp_path, vnc = workdir / "qmp.sock", _free_vnc_display()
        argv = [
            "qemu-system-x86_64", "-M", "q35", "-accel", "tcg", "-m", "512M", "-smp", "1",
            "-nodefaults", "-no-user-config", "-no-reboot", "-serial", "stdio",
            "-qmp", f"unix:{qmp_path},server=on,wait=off",
            "-kernel", str(vmlinux), "-initrd", str(initrd),
            "-append", "console=ttyS0 quiet panic=-1",
            *display_qemu_args(vnc_display=vnc),
        ]  # fmt: skip
        started = time.monotonic()
        proc = subprocess.Popen(
            argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
        )
        machine = ClickpadVM(proc, qmp_path, vnc)
        machine.ready = machine.expect("ready ", timeout=90)
        print(f"boot to ready: {time.monotonic() - started:.1f}s")
        yield machine
    finally:
        if proc is not None:
            proc.kill()
            proc.wait(timeout=30)
        shutil.rmtree(workdir, ignore_errors=True)
        assert not _processes_mentioning(str(workdir)), "a QEMU of this test survived"
        assert not workdir.exists()


async def _screen_until(
    client: QMPClient, colour: tuple[int, int, int]
) -> tuple[bytes, list[bytes]]:
    """A screenshot once the button's corners and centre show ``colour`` (the guest's
    framebuffer reaches the card a little after it is written, and on a loaded host a
    screenshot can catch the button half drawn)."""
    x0, y0, x1, y1 = BUTTON
    points = [(x0, y0), (x1 - 1, y1 - 1), ((x0 + x1) // 2, (y0 + y1) // 2)]
    deadline = time.monotonic() + 20
    while True:
        png = await screendump_png(client)
        _, _, rows = decode_png(png)
        if all(pixel(rows, x, y) == colour for x, y in points) or time.monotonic() > deadline:
            return png, rows
        await asyncio.sleep(0.2)


@pytest.mark.slow
async def test_click_on_the_button_turns_it_green(vm):
    width, height = (int(n) for n in vm.ready.split()[1].split("x"))
    client = await vm.qmp()
    try:
        before, rows = await _screen_until(client, RED)
        assert png_size(before) == (width, height)
        x0, y0, x1, y1 = BUTTON
        for x, y in [(x0, y0), (x1 - 1, y1 - 1), ((x0 + x1) // 2, (y0 + y1) // 2)]:
            assert pixel(rows, x, y) == RED, (x, y)
        for x, y in [(x0 - 1, y0), (x1, y1 - 1), (x0, y1), (10, 10), (width - 1, height - 1)]:
            assert pixel(rows, x, y) == BACKGROUND, (x, y)

        # a click beside the button is a miss and does not count
        await send_input(client, parse_input({"type": "click", "x": x1, "y": y0}), (width, height))
        assert vm.expect("miss ", timeout=20) == f"miss {x1} {y0}"

        await send_input(
            client, parse_input({"type": "click", "x": 200, "y": 140}), (width, height)
        )
        vm.expect("clicked 1", timeout=20)
        _, after = await _screen_until(client, GREEN)
        for y in range(height):
            if y0 <= y < y1:
                assert after[y][: 3 * x0] == rows[y][: 3 * x0], y
                assert after[y][3 * x1 :] == rows[y][3 * x1 :], y
                assert after[y][3 * x0 : 3 * x1] == bytes(GREEN) * (x1 - x0), y
            else:
                assert after[y] == rows[y], y

        await send_input(client, Key("a"), (width, height))
        assert vm.expect("key ", timeout=20) == "key 30"  # KEY_A
        with pytest.raises(InvalidSpec):
            await send_input(client, Key("nosuchkey"), (width, height))
    finally:
        await client.disconnect()
    assert not [line for line in vm.console if "insmod" in line], vm.console


@pytest.mark.slow
def test_vnc_listens_on_loopback(vm):
    with socket.create_connection(("127.0.0.1", 5900 + vm.vnc), timeout=10) as s:
        assert s.recv(12).startswith(b"RFB ")
