#!/usr/bin/env python3
"""A chaos soak of the whole platform, run as RL load runs: trainers' rollouts through ``dsec
apiserver`` over a 3-node local Ray cluster while a fault injector breaks things on a seeded
schedule, and a ledger that accounts for every request.

1. The platform: a Ray cluster of three nodes on 127.0.0.2-4, ``dsec cluster up`` on it, node
   homes on an ext4 file system of their own (loop-mounted, so filling it fills only it), three
   layer sources every node reads (a shared store with the busybox base, an S3 server and an
   OCI registry on loopback, each holding a data layer with a lazy form), a FnCall/judge
   environment, an IAM store with one project and key, and ``dsec apiserver --ray``.
2. The load: ``--trainers`` processes (``python bench/soak.py --trainer ...``), each running
   ``--rollouts`` rollouts at once, each rollout one of:
   - ``traj``: create (cold, or warm once the warm pool has members), a lease, a marker file
     with the sandbox's id, then steps logged in a trajectory (``exec(..., trajectory=,
     step=)``), each appending its number to a file and printing the marker; sometimes a
     pause and resume, a pack_diff and fork into two that must see the same steps; at the
     end the file must hold each step exactly once, in order;
   - ``files``: write and read back 1 MiB;
   - ``judge``, ``fncall``: calls on the FnCall pool;
   - ``lazy``: a sandbox of the S3 or the OCI data layer (loaded on demand) checks the data's
     digest;
   - ``vm`` (first trainer): a microVM with trajectory steps.
   A step whose answer did not come (the node away, the apiserver gone) is sent again with the
   same step number: the trajectory log answers it if it ran, so nothing runs twice.
3. Faults, one after another on a seeded schedule once a fault-free baseline has run: every
   kind once, then at random (``FAULTS``).
4. The ledger: each trainer appends a line when it sends a request and one when it has its
   answer. At the end, every request must have an answer or a typed error (``lost`` and
   ``untyped`` count the others; a trainer SIGKILLed mid-request is the fault's, counted as
   ``interrupted``), every finished trajectory must hold each step once (``steps_twice``,
   ``steps_lost``), every answer the right sandbox's (``misattributed``), no sandbox may be
   left that no trainer knows of (``orphans``), and nothing may be left on the machine
   (``leaked``: mounts, cgroups, processes, uid ranges, devices, network namespaces, files
   under the node homes beyond the stores). Infrastructure failures (``InfraEvent`` kinds)
   are counted as masked, never scored.

    python bench/soak.py [--quick] [--minutes M] [--seed S]

--quick: 2 minutes of load (the default is 20), the first quarter without faults. The last
line printed is one JSON object; the exit status is 1 if ``lost``, ``untyped``, ``leaked``,
``steps_twice``, ``steps_lost``, ``misattributed`` or ``orphans`` is not 0, if a fault failed
(the platform did not come back from it: ``faults_failed``), or if fewer than 8 kinds of
fault were injected.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import json
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections import Counter
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "plugins" / "layer_s3" / "tests"))
sys.path.insert(0, str(ROOT / "plugins" / "layer_oci" / "tests"))

import dsec  # noqa: E402
from dsec_core.errors import (  # noqa: E402
    AdmissionRejected,
    DsecError,
    LeaseHeld,
    NodeUnavailable,
    SandboxDied,
    SandboxNotRunning,
    SandboxPaused,
    UnknownLease,
    UnknownSandbox,
)
from dsec_core.rl.infra import infra_event  # noqa: E402
from dsec_core.testing.procs import pids_matching  # noqa: E402

#: The kinds of fault the injector knows, in the order of their first round (then shuffled).
FAULTS = (
    "daemon_kill",
    "apiserver_kill",
    "lxcfs_kill",
    "fuse_keeper_kill",
    "qemu_kill",
    "s3_outage",
    "oci_outage",
    "disk_fill",
    "sandbox_oom",
    "trainer_kill",
    "ray_node_lost",
)
#: How long a step keeps being sent again while its node is away (a daemon restarting, a
#: node being brought back) before the rollout is given up as masked.
STEP_RETRY_S = 90.0
ENV = "soak-judge"
DATA_MB = 8
SOLUTION = "{ s += $1 } END { print s }\n"


# --- the ledger -------------------------------------------------------------------------------


class Ledger:
    """One trainer's ledger: a JSON line per event, appended with one ``write`` each (a
    SIGKILL leaves every line before it whole)."""

    def __init__(self, path: Path, trainer: str) -> None:
        self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        self.trainer = trainer
        self.n = 0

    def write(self, **event: Any) -> None:
        event.setdefault("t", time.time())
        os.write(self.fd, (json.dumps(event, separators=(",", ":")) + "\n").encode())

    def begin(self, kind: str, sid: str = "") -> str:
        self.n += 1
        rid = f"{self.trainer}.{os.getpid()}.{self.n}"
        self.write(ev="begin", rid=rid, kind=kind, sid=sid)
        return rid

    def end(self, rid: str, kind: str, t0: float, error: BaseException | None = None, **kw: Any):
        ms = round((time.monotonic() - t0) * 1e3, 2)
        if error is None:
            self.write(ev="end", rid=rid, kind=kind, ok=True, ms=ms, **kw)
            return
        typed = isinstance(error, DsecError) and type(error) is not DsecError
        status = getattr(error, "http_status", 0) if isinstance(error, DsecError) else 0
        infra = infra_event(error)
        self.write(
            ev="end",
            rid=rid,
            kind=kind,
            ok=False,
            ms=ms,
            error=type(error).__name__,
            typed=typed,
            infra=infra.kind if infra else "",
            message=str(error)[:300],
            status=status,
            **kw,
        )


def read_ledger(path: Path) -> list[dict[str, Any]]:
    out = []
    with contextlib.suppress(FileNotFoundError):
        for line in path.read_bytes().split(b"\n"):
            with contextlib.suppress(ValueError):
                if line.strip():
                    out.append(json.loads(line))
    return out


# --- the trainer ------------------------------------------------------------------------------


class GiveUp(Exception):
    """A rollout given up: its infrastructure failed (masked) or its answers were wrong."""

    def __init__(self, why: str, masked: bool = True) -> None:
        super().__init__(why)
        self.why = why
        self.masked = masked


@dataclass
class Rollout:
    name: str
    kind: str
    sid: str = ""
    steps: int = 0  # a trajectory's planned steps
    lease: str = ""


class Trainer:
    """A trainer process's loop: ``rollouts`` rollouts at once until ``until``, each request
    in the ledger."""

    def __init__(self, cfg: dict[str, Any]) -> None:
        self.cfg = cfg
        self.id = cfg["id"]
        self.led = Ledger(Path(cfg["ledger"]), self.id)
        self.rng = random.Random(cfg["seed"])
        self.client = dsec.AsyncClient(cfg["url"], api_key=cfg["key"], retry=30.0)
        self.n = 0
        self.incarnation = cfg["incarnation"]
        self.vm_live = 0

    async def req(self, kind: str, fn: Callable[[], Awaitable[Any]], sid: str = "") -> Any:
        rid = self.led.begin(kind, sid)
        t0 = time.monotonic()
        try:
            out = await fn()
        except BaseException as e:
            if isinstance(e, asyncio.CancelledError):
                self.led.end(rid, kind, t0, error=e, cancelled=True)
                raise
            self.led.end(rid, kind, t0, error=e, sid=sid)
            raise
        self.led.end(rid, kind, t0, sid=sid or _sid_of(out))
        return out

    # --- one rollout of each kind ---------------------------------------------------------
    def spec(self, r: Rollout, **kw: Any) -> dsec.SandboxSpec:
        base = dict(
            layers=(self.cfg["layer"],),
            memory="64M",
            cpu=0.25,
            ttl=900,
            labels={"soak.trainer": self.id, "soak.rollout": r.name},
        )
        base.update(kw)
        return dsec.SandboxSpec(**base)

    async def create(self, r: Rollout, spec: dsec.SandboxSpec) -> str:
        """The rollout's sandbox, under a create key of its own: a create sent again after
        ``NodeUnavailable`` (its node away, the answer lost) makes one sandbox, not two."""
        deadline = time.monotonic() + STEP_RETRY_S
        key = r.name
        while True:
            try:
                sb = await self.req("create", lambda: self.client.create(spec, wait=20.0, key=key))
            except (AdmissionRejected, NodeUnavailable) as e:
                if time.monotonic() > deadline:
                    raise GiveUp(type(e).__name__, masked=isinstance(e, NodeUnavailable)) from e
                await asyncio.sleep(1.0)
                continue
            r.sid = sb.id
            self.led.write(ev="rollout", name=r.name, kind=r.kind, sid=r.sid, state="open")
            return r.sid

    async def call_retrying(self, kind: str, r: Rollout, fn: Callable[[], Awaitable[Any]]):
        """A call about ``r``'s sandbox, sent again while its node is away (for up to
        ``STEP_RETRY_S``) or its lease had lapsed; given up (masked) if the sandbox died."""
        deadline = time.monotonic() + STEP_RETRY_S
        while True:
            try:
                return await self.req(kind, fn, r.sid)
            except SandboxPaused:
                await self.retake(r)
            except (NodeUnavailable, LeaseHeld) as e:
                if time.monotonic() > deadline:
                    raise GiveUp(type(e).__name__) from e
                await asyncio.sleep(0.5)
            except (SandboxDied, UnknownSandbox) as e:
                raise GiveUp(type(e).__name__) from e

    async def retake(self, r: Rollout) -> None:
        """Take (or take over) the rollout's lease, resuming what a lapse paused; a lease of a
        SIGKILLed predecessor is taken over once it lapses."""
        deadline = time.monotonic() + STEP_RETRY_S
        while True:
            try:
                lease = await self.req(
                    "lease",
                    lambda: self.client.lease([r.sid], ttl=8.0, holder=self.id, renew=False),
                    r.sid,
                )
                r.lease = lease.id
                return
            except (NodeUnavailable, LeaseHeld) as e:
                if time.monotonic() > deadline:
                    raise GiveUp(type(e).__name__) from e
                await asyncio.sleep(1.0)
            except (SandboxDied, UnknownSandbox) as e:
                raise GiveUp(type(e).__name__) from e

    async def renew(self, r: Rollout) -> None:
        try:
            await self.req("lease_renew", lambda: self.client.lease_renew(r.lease), r.sid)
        except (UnknownLease, SandboxPaused):
            await self.retake(r)

    async def step(self, r: Rollout, i: int, traj: str) -> None:
        cmd = f"echo {i} >> /soak/steps && cat /soak/id"
        res = await self.call_retrying(
            "exec",
            r,
            lambda: self.client.exec(r.sid, cmd, trajectory=traj, step=i, timeout=60),
        )
        if res.oom_killed or res.exit_code != 0:
            text = (res.stderr or b"").decode(errors="replace")
            masked = res.oom_killed or "No space left" in text or "I/O error" in text
            raise GiveUp(f"step {i} exit {res.exit_code}: {text[:120]}", masked=masked)
        if res.stdout.decode().strip() != r.sid:
            self.led.write(ev="misattributed", sid=r.sid, got=res.stdout.decode()[:80], step=i)
            raise GiveUp("misattributed", masked=False)

    async def traj(self, r: Rollout, resume: bool = False) -> None:
        c = self.client
        traj = r.name
        if not resume:
            await self.create(r, self.spec(r))
            r.steps = self.rng.randint(4, 10)
            self.led.write(ev="plan", name=r.name, sid=r.sid, steps=r.steps)
        await self.retake(r)
        await self.call_retrying(
            "write", r, lambda: c.write_file(r.sid, "/soak/id", r.sid.encode())
        )
        steps = r.steps
        plan = self.rng.random()
        for i in range(steps):  # a resumed trajectory fast-forwards through its log
            await self.step(r, i, traj)
            if i % 3 == 2:
                await self.renew(r)
            if i == 2 and plan < 0.25:
                await self.call_retrying("pause", r, lambda: c.pause(r.sid))
                await self.call_retrying("resume", r, lambda: c.resume(r.sid))
            await asyncio.sleep(self.rng.uniform(0.05, 0.3))  # the policy thinks
        want = "".join(f"{i}\n" for i in range(steps)).encode()
        got = await self.call_retrying("read", r, lambda: c.read_file(r.sid, "/soak/steps"))
        self.check_steps(r, got, want)
        if plan > 0.8:
            await self.fork(r, want)

    def check_steps(self, r: Rollout, got: bytes, want: bytes) -> None:
        if got == want:
            self.led.write(ev="steps_ok", sid=r.sid, name=r.name, steps=want.count(b"\n"))
            return
        lines = got.decode(errors="replace").split()
        counts = Counter(lines)
        twice = sorted(k for k, v in counts.items() if v > 1)
        lost = sorted(k for k in want.decode().split() if k not in counts)
        self.led.write(ev="steps_bad", sid=r.sid, name=r.name, twice=twice, lost=lost, got=lines)
        raise GiveUp("steps", masked=False)

    async def fork(self, r: Rollout, want: bytes) -> None:
        c = self.client
        layer = await self.call_retrying("pack_diff", r, lambda: c.pack_diff(r.sid))
        spec = self.spec(Rollout(f"{r.name}-f", "fork"))
        forks = await self.req("restore", lambda: c.restore(layer, 2, spec))
        for sb in forks:
            self.led.write(ev="rollout", name=r.name + "-f", kind="fork", sid=sb.id, state="open")
        try:
            for sb in forks:
                f = Rollout(r.name + "-f", "fork", sid=sb.id)
                got = await self.call_retrying(
                    "read", f, lambda sid=sb.id: c.read_file(sid, "/soak/steps")
                )
                if got != want:
                    self.led.write(ev="fork_bad", sid=sb.id, parent=r.sid, got=got.decode()[:200])
                    raise GiveUp("fork", masked=False)
        finally:
            for sb in forks:
                await self.kill(Rollout(r.name + "-f", "fork", sid=sb.id))

    async def files(self, r: Rollout) -> None:
        c = self.client
        await self.create(r, self.spec(r))
        data = os.urandom(1 << 20)
        await self.call_retrying("write", r, lambda: c.write_file(r.sid, "/tmp/blob", data))
        got = await self.call_retrying("read", r, lambda: c.read_file(r.sid, "/tmp/blob"))
        if got != data:
            self.led.write(ev="file_bad", sid=r.sid, size=len(got))
            raise GiveUp("file", masked=False)

    async def lazy(self, r: Rollout, which: str) -> None:
        layer, digest = self.cfg["data"][which]
        await self.create(r, self.spec(r, layers=(layer, self.cfg["layer"])))
        res = await self.call_retrying(
            "exec", r, lambda: self.client.exec(r.sid, "sha256sum /data/blob", timeout=60)
        )
        if res.exit_code != 0:
            raise GiveUp(f"lazy read: {res.stderr[:120]!r}")  # EIO from a source away: masked
        if res.stdout.split()[0].decode() != digest:
            self.led.write(ev="data_bad", sid=r.sid, got=res.stdout.decode()[:80])
            raise GiveUp("data", masked=False)

    async def vm(self, r: Rollout) -> None:
        await self.create(r, self.spec(r, backend="microvm", memory="256M", cpu=0.5))
        await self.call_retrying(
            "write", r, lambda: self.client.write_file(r.sid, "/soak/id", r.sid.encode())
        )
        for i in range(4):
            await self.step(r, i, r.name)
        want = b"0\n1\n2\n3\n"
        got = await self.call_retrying(
            "read", r, lambda: self.client.read_file(r.sid, "/soak/steps")
        )
        self.check_steps(r, got, want)

    async def judge(self) -> None:
        cases = [dsec.JudgeCase(f"{a}\n{b}\n", f"{a + b}\n", str(a)) for a, b in ((1, 2), (5, 7))]
        res = await self.req(
            "judge",
            lambda: self.client.judge(
                ENV, "awk -f s.awk", files={"s.awk": SOLUTION}, cases=cases, time_limit=5.0
            ),
        )
        if res.verdict != "AC":
            self.led.write(ev="judge_bad", verdict=res.verdict)

    async def fncall(self) -> None:
        res = await self.req("fncall", lambda: self.client.fncall(ENV, "echo $((6*7))"))
        if res.stdout != b"42\n" and not res.error:
            self.led.write(ev="fncall_bad", stdout=res.stdout.decode()[:80])

    async def kill(self, r: Rollout) -> None:
        deadline = time.monotonic() + STEP_RETRY_S
        while True:
            try:
                await self.req("kill", lambda: self.client.kill(r.sid), r.sid)
                break
            except (SandboxDied, UnknownSandbox):
                break
            except NodeUnavailable:
                if time.monotonic() > deadline:
                    self.led.write(ev="rollout", name=r.name, sid=r.sid, state="unkilled")
                    return
                await asyncio.sleep(1.0)
        self.led.write(ev="rollout", name=r.name, sid=r.sid, state="closed")

    # --- the loop -------------------------------------------------------------------------
    async def one(self, kind: str, resume: Rollout | None = None) -> None:
        if resume is not None:
            r = resume
        else:
            self.n += 1
            r = Rollout(f"{self.id}-{self.incarnation}-{self.n}", kind)
        try:
            if kind == "traj":
                await self.traj(r, resume=resume is not None)
            elif kind == "files":
                await self.files(r)
            elif kind in ("s3", "oci"):
                await self.lazy(r, kind)
            elif kind == "vm":
                await self.vm(r)
            elif kind == "judge":
                await self.judge()
            elif kind == "fncall":
                await self.fncall()
            self.led.write(ev="done", name=r.name, kind=kind)
        except GiveUp as e:
            self.led.write(ev="given_up", name=r.name, kind=kind, why=e.why, masked=e.masked)
            await asyncio.sleep(self.rng.uniform(0.5, 1.5))  # as a trainer backs off
        except DsecError as e:
            infra = infra_event(e)
            self.led.write(
                ev="given_up", name=r.name, kind=kind, why=type(e).__name__, masked=bool(infra)
            )
            await asyncio.sleep(self.rng.uniform(0.5, 1.5))
        except Exception as e:  # a bug of the trainer or the SDK
            self.led.write(
                ev="crash",
                name=r.name,
                kind=kind,
                error=repr(e)[:300],
                tb=traceback.format_exc()[-1500:],
            )
        finally:
            if r.sid:
                await self.kill(r)

    def pick(self) -> str:
        kinds = ["traj"] * 8 + ["files", "judge", "fncall", "s3", "oci"]
        if self.cfg.get("vm") and self.vm_live == 0:
            kinds.append("vm")
        return self.rng.choice(kinds)

    async def worker(self, until: float) -> None:
        while time.time() < until:
            kind = self.pick()
            if kind == "vm":
                self.vm_live += 1
            try:
                await self.one(kind)
            finally:
                if kind == "vm":
                    self.vm_live -= 1

    async def main(self) -> None:
        until = self.cfg["until"]
        async with self.client:
            taken = self.predecessors()
            if self.cfg.get("resume_from"):
                await self.sweep({r.sid for r in taken})
            resumed = [
                self.one("traj", r) if r.kind == "traj" and r.steps else self.kill(r) for r in taken
            ]
            workers = [self.worker(until) for _ in range(self.cfg["rollouts"])]
            await asyncio.gather(*resumed, *workers)
        self.led.write(ev="trainer_done")

    async def sweep(self, known: set[str]) -> None:
        """Kill the sandboxes of this trainer's label that a SIGKILLed predecessor made but
        never heard of (forks whose restore it did not see answered), as a trainer taking
        over does: they are found by label, not by the ledger."""
        deadline = time.monotonic() + STEP_RETRY_S
        while True:
            try:
                listed = await self.req("list", self.client.list)
                break
            except NodeUnavailable:
                if time.monotonic() > deadline:
                    return
                await asyncio.sleep(1.0)
        for info in listed:
            if info.labels.get("soak.trainer") == self.id and info.id not in known:
                r = Rollout(info.labels.get("soak.rollout", "?"), "swept", sid=info.id)
                self.led.write(ev="rollout", name=r.name, kind="swept", sid=r.sid, state="open")
                await self.kill(r)

    def predecessors(self) -> list[Rollout]:
        """The rollouts a SIGKILLed predecessor left open: taken over and gone on with (its
        trajectories fast-forward through the steps it logged)."""
        path = self.cfg.get("resume_from")
        if not path:
            return []
        rollouts: dict[str, Rollout] = {}
        for e in read_ledger(Path(path)):
            if e.get("ev") == "rollout":
                if e["state"] == "open":
                    rollouts[e["sid"]] = Rollout(e["name"], e["kind"], sid=e["sid"])
                else:
                    rollouts.pop(e["sid"], None)
            elif e.get("ev") == "plan" and e["sid"] in rollouts:
                rollouts[e["sid"]].steps = e["steps"]
        for r in rollouts.values():  # now this trainer's: a traj goes on, the rest is killed
            self.led.write(ev="rollout", name=r.name, kind=r.kind, sid=r.sid, state="open")
            if r.kind == "traj" and r.steps:
                self.led.write(ev="plan", name=r.name, sid=r.sid, steps=r.steps, resumed=True)
        return list(rollouts.values())

    def run(self) -> None:
        asyncio.run(self.main())


def _sid_of(out: Any) -> str:
    return getattr(out, "id", "") if not isinstance(out, (list, tuple)) else ""


# --- faults -----------------------------------------------------------------------------------


def _cmdline(pid: int) -> list[str]:
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return []
    return [a.decode(errors="replace") for a in raw.split(b"\0") if a]


def _gone(pid: int, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            return True
        if state == "Z":
            return True
        time.sleep(0.05)
    return False


def _wait_port(port: int, timeout: float = 20.0) -> None:
    import socket

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 0.5):
            return
        time.sleep(0.05)
    raise RuntimeError(f"nothing listens on 127.0.0.1:{port} after {timeout}s")


class Relaunchable:
    """A server process (the S3 server, the registry) that can be killed and started again
    with the same command line, so it comes back at the same address with the same data."""

    def __init__(self, name: str, pid: int, port: int, log: Path) -> None:
        self.name = name
        self.argv = _cmdline(pid)
        self.pid = pid
        self.port = port
        self.log = log
        self.procs: list[subprocess.Popen[bytes]] = []

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, signal.SIGKILL)
        _gone(self.pid)

    def start(self) -> None:
        with open(self.log, "ab") as log:
            proc = subprocess.Popen(
                self.argv,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        self.procs.append(proc)
        self.pid = proc.pid
        _wait_port(self.port)

    def stop(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(10)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()


@dataclass
class Platform:
    """What the soak runs on, and what the injector breaks."""

    ray: Any
    kit: Any
    s3: Relaunchable
    oci: Relaunchable
    homes: Path
    iam_url: str
    key: str
    api: Any
    api_port: int
    workdir: Path
    data: dict[str, tuple[str, str]]
    trainers: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)
    trainer_cfgs: dict[str, dict[str, Any]] = field(default_factory=dict)
    retired_apis: list[Any] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def node_home(self, name: str) -> Path:
        return Path(self.kit.plan.home_root) / name

    def client(self) -> dsec.Client:
        return dsec.Client(self.api.url, api_key=self.key, retry=30.0)

    def start_trainer(self, tid: str, cfg: dict[str, Any]) -> None:
        path = self.workdir / f"{tid}-{cfg['incarnation']}.json"
        path.write_text(json.dumps(cfg))
        log = open(self.workdir / f"{tid}-{cfg['incarnation']}.log", "wb")
        proc = subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), "--trainer", str(path)],
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        log.close()
        with self.lock:
            self.trainers[f"{tid}-{cfg['incarnation']}"] = proc
            self.trainer_cfgs[tid] = cfg

    def start_apiserver(self) -> None:
        from dsec_core.testing.apiserver import start_apiserver

        self.api = start_apiserver(
            [], self.iam_url, port=self.api_port, ray=self.ray.address, args=PROBE
        )


PROBE = ["--probe-interval", "0.5", "--probe-timeout", "1", "--probe-misses", "3"]


def up_until_it_works(kit: Any, timeout: float = 120.0) -> int:
    """``dsec cluster up`` until every Ray node runs a daemon (a node Ray has not yet
    noticed is gone makes it fail, typed, meanwhile), as an operator's loop would; how many
    times it ran."""
    deadline = time.monotonic() + timeout
    n = 0
    while True:
        n += 1
        try:
            kit.up()
            return n
        except NodeUnavailable:
            if time.monotonic() > deadline:
                raise
            time.sleep(2.0)


class Injector:
    """Faults on a seeded schedule, each logged with its time and what it found."""

    def __init__(self, p: Platform, seed: int, log: Path, only: str = "") -> None:
        self.kinds = tuple(k for k in FAULTS if not only or k in only.split(","))
        self.p = p
        self.rng = random.Random(seed)
        self.log = log
        self.done: list[dict[str, Any]] = []
        self.led = Ledger(p.workdir / "injector.jsonl", "injector")

    def schedule(self, start: float, end: float) -> list[tuple[float, str]]:
        kinds = list(self.kinds)
        self.rng.shuffle(kinds)
        n = max(len(kinds), int((end - start) / 9.0))
        while len(kinds) < n:
            kinds.append(self.rng.choice(self.kinds))
        gap = (end - start) / n
        return [(start + i * gap, k) for i, k in enumerate(kinds)]

    def run(self, start: float, end: float, stop: threading.Event) -> None:
        for at, kind in self.schedule(start, end):
            while time.time() < at and not stop.is_set():
                time.sleep(0.1)
            if stop.is_set() or time.time() > end:
                return
            t0 = time.time()
            try:
                detail = getattr(self, kind)()
                ok = True
            except Exception as e:
                detail = f"{type(e).__name__}: {e}"[:400]
                ok = False
                traceback.print_exc()
            entry = {
                "t": t0,
                "kind": kind,
                "took": round(time.time() - t0, 2),
                "ok": ok,
                "detail": detail,
            }
            self.done.append(entry)
            with open(self.log, "a") as f:
                f.write(json.dumps(entry) + "\n")
            print(f"  fault {kind:16} {entry['took']:6.1f}s  {str(detail)[:90]}", flush=True)

    # --- the faults -----------------------------------------------------------------------
    def _node(self) -> str:
        return self.rng.choice([e.name for e in self.p.kit.endpoints])

    def daemon_kill(self) -> str:
        from dsec_core.cluster import status

        pids = {s.endpoint.name: s.pid for s in status(self.p.ray.address) if s.pid}
        name = self.rng.choice(sorted(pids))
        pid = pids[name]
        os.kill(pid, signal.SIGKILL)
        _gone(pid)
        time.sleep(self.rng.uniform(1.0, 4.0))
        up_until_it_works(self.p.kit)
        return f"{name}: daemon {pid} killed, up again as {self.p.kit.daemon_pids.get(name)}"

    def apiserver_kill(self) -> str:
        old = self.p.api
        old.stop(signal.SIGKILL)
        self.p.retired_apis.append(old)
        t0 = time.monotonic()
        self.p.start_apiserver()
        took = time.monotonic() - t0
        return f"pid {old.proc.pid} killed; pid {self.p.api.proc.pid} serves {took:.2f}s later"

    def lxcfs_kill(self) -> str:
        found = pids_matching("lxcfs", os.fspath(self.p.kit.home_root))
        if not found:
            return "no lxcfs running"
        pid = self.rng.choice(found)
        os.kill(pid, signal.SIGKILL)
        return f"lxcfs {pid} killed ({len(found)} ran)"

    def fuse_keeper_kill(self) -> str:
        found = pids_matching("dsec_core.lazy.fuse_keeper", os.fspath(self.p.kit.home_root))
        if not found:
            self._lazy_sandbox("s3")
            found = pids_matching("dsec_core.lazy.fuse_keeper", os.fspath(self.p.kit.home_root))
        if not found:
            return "no FUSE keeper running"
        pid = self.rng.choice(found)
        os.kill(pid, signal.SIGKILL)
        return f"FUSE keeper {pid} killed ({len(found)} ran)"

    def _lazy_sandbox(self, which: str) -> None:
        layer, _ = self.p.data[which]
        with self.p.client() as c:
            rid = self.led.begin("create")
            t0 = time.monotonic()
            try:
                sb = c.create(
                    layers=(layer, self.p.kit.layer.ref),
                    memory="64M",
                    ttl=120,
                    labels={"soak.trainer": "injector"},
                )
                self.led.end(rid, "create", t0, sid=sb.id)
                sb.exec("head -c 1 /data/blob > /dev/null")
                sb.kill()
            except DsecError as e:
                self.led.end(rid, "create", t0, error=e)

    def qemu_kill(self) -> str:
        home = os.fspath(self.p.kit.home_root)
        found = pids_matching("qemu-system", home)
        made = None
        if not found:
            with self.p.client() as c:
                rid = self.led.begin("create")
                t0 = time.monotonic()
                try:
                    made = c.create(
                        layers=(self.p.kit.layer.ref,),
                        backend="microvm",
                        memory="256M",
                        ttl=300,
                        labels={"soak.trainer": "injector"},
                    )
                    self.led.end(rid, "create", t0, sid=made.id)
                except DsecError as e:
                    self.led.end(rid, "create", t0, error=e)
                    return f"no VM to kill: {type(e).__name__}"
            found = pids_matching("qemu-system", home)
        if not found:
            return "no QEMU running"
        pid = self.rng.choice(found)
        os.kill(pid, signal.SIGKILL)
        seen = ""
        if made is not None:
            with self.p.client() as c:
                deadline = time.monotonic() + 20
                while time.monotonic() < deadline and not seen:
                    rid = self.led.begin("exec", made.id)
                    t0 = time.monotonic()
                    try:
                        c.exec(made.id, "true")
                        self.led.end(rid, "exec", t0, sid=made.id)
                        time.sleep(0.5)
                    except DsecError as e:
                        self.led.end(rid, "exec", t0, error=e, sid=made.id)
                        seen = type(e).__name__
                with contextlib.suppress(DsecError):
                    c.kill(made.id)
        return f"QEMU {pid} killed ({len(found)} ran){'; its exec: ' + seen if seen else ''}"

    def _outage(self, server: Relaunchable, which: str) -> str:
        """Kill the source while a node reads from it: a prefetch of a version no node has
        read yet, straight to a node; bring it back after a few seconds."""
        name = self._node()
        e = self.p.kit.endpoint(name)
        ref = self.p.data[f"{which}-fresh"].pop()[0] if self.p.data.get(f"{which}-fresh") else ""
        result: dict[str, str] = {}

        def read() -> None:
            if not ref:
                return
            rid = self.led.begin("prefetch")
            t0 = time.monotonic()
            try:
                with dsec.Client(e.url, token=e.token, retry=5.0) as c:
                    c.prefetch([ref])
                self.led.end(rid, "prefetch", t0)
                result["first"] = "ok"
            except DsecError as err:
                self.led.end(rid, "prefetch", t0, error=err)
                result["first"] = type(err).__name__

        t = threading.Thread(target=read)
        t.start()
        time.sleep(0.15)
        server.kill()
        down = self.rng.uniform(2.0, 5.0)
        time.sleep(down)
        server.start()
        t.join(120)
        after = ""
        if ref:
            rid = self.led.begin("prefetch")
            t0 = time.monotonic()
            try:
                with dsec.Client(e.url, token=e.token, retry=5.0) as c:
                    c.prefetch([ref])
                self.led.end(rid, "prefetch", t0)
                after = "ok"
            except DsecError as err:
                self.led.end(rid, "prefetch", t0, error=err)
                after = type(err).__name__
        return (
            f"{which} down {down:.1f}s during {name}'s read of {ref or '(none left)'}:"
            f" {result.get('first', '-')}, after: {after or '-'}"
        )

    def s3_outage(self) -> str:
        return self._outage(self.p.s3, "s3")

    def oci_outage(self) -> str:
        return self._outage(self.p.oci, "oci")

    def disk_fill(self) -> str:
        st = os.statvfs(self.p.homes)
        free = st.f_bfree * st.f_frsize
        filler = self.p.homes / "soak-filler"
        fd = os.open(filler, os.O_WRONLY | os.O_CREAT, 0o600)
        try:
            size = free
            while size > 1 << 20:  # what fallocate takes: the free blocks less metadata's
                try:
                    os.posix_fallocate(fd, 0, size)
                    break
                except OSError:
                    size = size * 15 // 16
            with contextlib.suppress(OSError):  # and the last blocks
                os.lseek(fd, 0, os.SEEK_END)
                while True:
                    os.write(fd, b"\0" * (1 << 20))
            hold = self.rng.uniform(3.0, 8.0)
            time.sleep(hold)
        finally:
            os.close(fd)
            filler.unlink()
        return f"{free >> 20} MiB filled for {hold:.1f}s"

    def sandbox_oom(self) -> str:
        """A command that eats memory until the OOM killer takes it, in a trainer's running
        container if one is still there when the exec lands, else in a sandbox of the
        injector's own; the result must say ``oom_killed`` and the sandbox must answer
        after."""
        with self.p.client() as c:
            live = [
                s.id
                for s in c.list()
                if s.labels.get("soak.trainer", "").startswith("t")
                and s.backend == "container"
                and s.state == "running"
            ]
            own = None
            for sid in [self.rng.choice(live)] if live else []:
                try:
                    return self._oom(c, sid)
                except (SandboxNotRunning, SandboxPaused, UnknownSandbox):
                    pass  # its trainer killed or paused it meanwhile
            rid = self.led.begin("create")
            t0 = time.monotonic()
            try:
                own = c.create(
                    layers=(self.p.kit.layer.ref,),
                    memory="64M",
                    ttl=120,
                    labels={"soak.trainer": "injector"},
                )
                self.led.end(rid, "create", t0, sid=own.id)
                return "own sandbox " + self._oom(c, own.id)
            except DsecError as e:
                self.led.end(rid, "create", t0, error=e)
                raise
            finally:
                if own is not None:
                    with contextlib.suppress(DsecError):
                        own.kill()

    def _oom(self, c: Any, sid: str) -> str:
        rid = self.led.begin("exec", sid)
        t0 = time.monotonic()
        try:
            res = c.exec(sid, "tail /dev/zero", timeout=60)
        except DsecError as e:
            self.led.end(rid, "exec", t0, error=e, sid=sid)
            raise
        self.led.end(rid, "exec", t0, sid=sid)
        if not res.oom_killed:
            raise AssertionError(f"{sid}: tail /dev/zero exited {res.exit_code}, no OOM seen")
        after = c.exec(sid, "echo alive").stdout.strip()
        return f"{sid}: oom_killed, exit {res.exit_code}, then {after.decode()!r}"

    def trainer_kill(self) -> str:
        with self.p.lock:
            running = {k: v for k, v in self.p.trainers.items() if v.poll() is None}
        if not running:
            return "no trainer running"
        key = self.rng.choice(sorted(running))
        proc = running[key]
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        tid = key.rsplit("-", 1)[0]
        cfg = dict(self.p.trainer_cfgs[tid])
        cfg["resume_from"] = cfg["ledger"]
        cfg["incarnation"] = cfg["incarnation"] + 1
        cfg["ledger"] = os.fspath(self.p.workdir / f"{tid}-{cfg['incarnation']}.jsonl")
        cfg["seed"] = cfg["seed"] + 1000
        self.p.start_trainer(tid, cfg)
        return f"{key} (pid {proc.pid}) killed; incarnation {cfg['incarnation']} takes over"

    def ray_node_lost(self) -> str:
        workers = [n.ip for n in self.p.ray.nodes[1:]]
        ip = self.rng.choice(workers)
        killed = self.p.ray.lose_node(ip)
        time.sleep(self.rng.uniform(1.0, 3.0))
        t0 = time.monotonic()
        self.p.ray.restart_node(ip)
        up_until_it_works(self.p.kit)
        return (
            f"Ray node {ip}: {len(killed)} processes killed; back in {time.monotonic() - t0:.1f}s"
        )


# --- the platform -----------------------------------------------------------------------------


@contextlib.contextmanager
def homes_fs(root: Path, size: str) -> Iterator[Path]:
    """An ext4 file system of ``size`` on a loop device, mounted at ``root/homes``: the node
    homes (stores, uppers, run dirs) go there, so a filled disk is this one only."""
    image = root / "homes.img"
    mnt = root / "homes"
    mnt.mkdir()
    subprocess.run(["truncate", "-s", size, image], check=True)
    subprocess.run(["mkfs.ext4", "-q", "-m", "0", "-E", "nodiscard", image], check=True)
    subprocess.run(["mount", "-o", "loop", image, mnt], check=True)
    try:
        os.chmod(mnt, 0o711)
        yield mnt
    finally:
        r = subprocess.run(["umount", mnt], capture_output=True)
        if r.returncode != 0:
            time.sleep(2)
            subprocess.run(["umount", "-l", mnt])
        image.unlink(missing_ok=True)


def data_layers(staging: Any, name: str, n: int) -> dict[str, str]:
    """``n`` versions of data layer ``name`` (``/data/blob``, DATA_MB of random bytes): ref
    -> digest of the blob."""
    from dsec_core.layers.build import build_layer

    out = {}
    for v in range(1, n + 1):
        with tempfile.TemporaryDirectory() as tmp:
            blob = os.urandom(DATA_MB << 20)
            (Path(tmp) / "data").mkdir()
            (Path(tmp) / "data" / "blob").write_bytes(blob)
            info = build_layer(tmp, name=name, version=str(v), kind="toolkit", store=staging)
        out[info.ref] = hashlib.sha256(blob).hexdigest()
    return out


def percentile(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def report(
    p: Platform,
    faults: list[dict[str, Any]],
    t_start: float,
    t_base: float,
    t_end: float,
    leaked: list[str],
    orphans: list[str],
) -> dict[str, Any]:
    events: list[dict[str, Any]] = []
    files = sorted(p.workdir.glob("*.jsonl"))
    dead = set()  # ledgers of SIGKILLed trainers
    for f in files:
        evs = read_ledger(f)
        if f.stem != "injector" and not any(e.get("ev") == "trainer_done" for e in evs):
            dead.add(f.stem)
        for e in evs:
            e["_ledger"] = f.stem
        events += evs
    begun = {e["rid"]: e for e in events if e.get("ev") == "begin"}
    ended = {e["rid"]: e for e in events if e.get("ev") == "end"}
    lost = [r for r in begun if r not in ended and begun[r]["_ledger"] not in dead]
    interrupted = [r for r in begun if r not in ended and begun[r]["_ledger"] in dead]
    by_kind = Counter(e["kind"] for e in ended.values())
    errors = Counter(e["error"] for e in ended.values() if not e["ok"])
    untyped = [
        e
        for e in ended.values()
        if not e["ok"]
        # an HTTP 500 is untyped whatever its class: the node did not say what went wrong
        and (not e["typed"] or e["status"] == 500 or e["error"] in ("DsecError", "SandboxError"))
    ]
    infra = Counter(e["infra"] for e in ended.values() if not e["ok"] and e["infra"])
    bad = Counter(
        e["ev"]
        for e in events
        if e.get("ev")
        in (
            "misattributed",
            "steps_bad",
            "fork_bad",
            "file_bad",
            "data_bad",
            "judge_bad",
            "fncall_bad",
            "crash",
        )
    )
    twice = sum(len(e["twice"]) for e in events if e.get("ev") == "steps_bad")
    steps_lost = sum(len(e["lost"]) for e in events if e.get("ev") == "steps_bad")
    given = Counter((e["kind"], e["why"], e["masked"]) for e in events if e.get("ev") == "given_up")

    def window(a: float, b: float) -> tuple[float, float]:
        creates = [
            e
            for e in ended.values()
            if e["kind"] == "create" and e["ok"] and a <= e["t"] < b and e["_ledger"] != "injector"
        ]
        execs = [
            e["ms"]
            for e in ended.values()
            if e["kind"] == "exec" and e["ok"] and a <= e["t"] < b and e["_ledger"] != "injector"
        ]
        return len(creates) / max(b - a, 1e-9), statistics.median(execs) if execs else float("nan")

    base_cps, base_exec = window(t_start, t_base)
    fault_cps, fault_exec = window(t_base, t_end)
    kinds = Counter(f["kind"] for f in faults if f["ok"])
    fig = {
        "minutes": round((t_end - t_start) / 60, 2),
        "requests": sum(by_kind.values()) + len(lost) + len(interrupted),
        "requests_by_kind": dict(sorted(by_kind.items())),
        "faults": len(faults),
        "faults_by_kind": dict(sorted(kinds.items())),
        "fault_kinds": len(kinds),
        "faults_failed": [f"{f['kind']}: {f['detail']}" for f in faults if not f["ok"]],
        "typed_errors_by_kind": dict(sorted(errors.items())),
        "masked_by_infra_kind": dict(sorted(infra.items())),
        "rollouts_done": sum(1 for e in events if e.get("ev") == "done"),
        "rollouts_given_up_masked": sum(v for (k, w, m), v in given.items() if m),
        "rollouts_given_up_unmasked": sum(v for (k, w, m), v in given.items() if not m),
        "given_up_why": {f"{k}:{w}": v for (k, w, m), v in sorted(given.items())},
        "steps_checked": sum(e["steps"] for e in events if e.get("ev") == "steps_ok"),
        "lost": len(lost),
        "untyped": len(untyped),
        "interrupted": len(interrupted),
        "steps_twice": twice,
        "steps_lost": steps_lost,
        "misattributed": bad.get("misattributed", 0),
        "wrong_answers": {k: v for k, v in bad.items() if k != "misattributed"},
        "orphans": len(orphans),
        "leaked": len(leaked),
        "creates_per_s_no_faults": round(base_cps, 2),
        "creates_per_s_faults": round(fault_cps, 2),
        "creates_per_s_ratio": round(fault_cps / base_cps, 3) if base_cps else None,
        "exec_p50_ms_no_faults": round(base_exec, 2),
        "exec_p50_ms_faults": round(fault_exec, 2),
    }
    fig["_lost"] = [begun[r] for r in lost][:10]
    fig["_untyped"] = untyped[:10]
    fig["_leaked"] = leaked[:20]
    fig["_orphans"] = orphans[:20]
    return fig


def run_soak(args: argparse.Namespace) -> dict[str, Any]:
    from oci_registry import local_registry
    from s3server import running_s3_server

    from dsec_core.catalog.model import Catalog, Environment
    from dsec_core.catalog.store import CatalogStore
    from dsec_core.config import NodeConfig
    from dsec_core.iam import Iam
    from dsec_core.layers.store import LayerStore
    from dsec_core.plugins import open_source
    from dsec_core.sources.transfer import push_layer
    from dsec_core.testing.ray import cluster_daemons, local_ray_cluster, ray_loopback_lock

    minutes = 2.0 if args.quick else args.minutes
    total = minutes * 60
    work = Path(tempfile.mkdtemp(prefix="dsec-soak-", dir="/var/tmp"))
    os.chmod(work, 0o711)
    leaked: list[str] = []
    orphans: list[str] = []
    faults: list[dict[str, Any]] = []
    fig: dict[str, Any] = {}
    p: Platform | None = None
    stack = contextlib.ExitStack()
    try:
        stack.enter_context(ray_loopback_lock())
        homes = stack.enter_context(homes_fs(work, args.disk))
        os.environ["DSEC_KIT_HOME"] = os.fspath(homes)
        print("starting: S3 server, OCI registry, Ray cluster of 3, node daemons...", flush=True)
        s3 = stack.enter_context(running_s3_server(("soak",)))
        reg = stack.enter_context(local_registry())
        staging = LayerStore(work / "staging")
        n_fresh = 2 + (0 if args.quick else int(minutes / 3))
        s3_url = s3.url("soak", "layers")
        oci_url = f"oci://{reg.address}/soak?insecure=1"
        os.environ.update(s3.env())
        layers = {}
        for url, which in ((s3_url, "s3"), (oci_url, "oci")):
            made = data_layers(staging, f"soak-{which}", 1 + n_fresh)
            src = open_source(url)
            for ref in made:
                push_layer(ref, src, staging)
            refs = list(made.items())
            layers[which] = refs[0]
            layers[f"{which}-fresh"] = refs[1:]
        ray = stack.enter_context(local_ray_cluster(3, overflow=0))
        kit_cm = cluster_daemons(ray, more_sources=(s3_url, oci_url), env=s3.env())
        kit = kit_cm.__enter__()
        try:
            for e in kit.endpoints:
                CatalogStore(NodeConfig(home=Path(kit.plan.home_root) / e.name).catalog_dir).save(
                    Catalog(name=ENV, environments=(Environment(name=ENV, base=kit.layer.ref),))
                )
            iam_url = f"sqlite://{work / 'iam.db'}"
            with Iam.open(iam_url) as iam:
                iam.create_project("soak")
                _, key = iam.create_key("soak", "member")
            from dsec_core.linux.processes import free_port

            p = Platform(
                ray=ray,
                kit=kit,
                s3=Relaunchable("s3", s3.pid, int(s3.endpoint.rsplit(":", 1)[1]), work / "s3.log"),
                oci=Relaunchable("oci", reg.process.pid, reg.port, work / "oci.log"),
                homes=homes,
                iam_url=iam_url,
                key=key,
                api=None,
                api_port=free_port(),
                workdir=work / "ledgers",
                data=layers,
            )
            p.workdir.mkdir()
            p.start_apiserver()
            with p.client() as c:  # every node is seen before the load starts
                deadline = time.monotonic() + 60
                while c.node_info()["home"] != "apiserver:3/3 nodes":
                    assert time.monotonic() < deadline, c.node_info()["home"]
                    time.sleep(0.2)
            t_start = time.time()
            t_base = t_start + total / 4
            t_end = t_start + total
            print(
                f"load: {args.trainers} trainers x {args.rollouts} rollouts for {minutes:g} min"
                f" (faults from minute {minutes / 4:g})",
                flush=True,
            )
            for k in range(args.trainers):
                tid = f"t{k}"
                p.start_trainer(
                    tid,
                    {
                        "id": tid,
                        "url": p.api.url,
                        "key": key,
                        "until": t_end,
                        "ledger": os.fspath(p.workdir / f"{tid}-0.jsonl"),
                        "incarnation": 0,
                        "seed": args.seed * 100 + k,
                        "rollouts": args.rollouts,
                        "layer": kit.layer.ref,
                        "vm": k == 0 and not args.no_vm,
                        "data": {w: list(layers[w]) for w in ("s3", "oci")},
                    },
                )
            stop = threading.Event()
            inj = Injector(p, args.seed, work / "faults.jsonl", args.faults)
            t = threading.Thread(target=inj.run, args=(t_base, t_end - 10, stop), daemon=True)
            if not args.no_faults:
                t.start()
            while time.time() < t_end:
                time.sleep(1)
            stop.set()
            if t.is_alive():
                t.join(300)
            faults = inj.done
            # the trainers finish their rollouts
            deadline = time.monotonic() + 240
            for key_, proc in list(p.trainers.items()):
                try:
                    proc.wait(max(1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
                    leaked.append(f"trainer {key_} did not finish in time")
            t_over = time.time()
            up_until_it_works(kit)  # every node back before the count
            with p.client() as c:
                deadline = time.monotonic() + 60
                while c.node_info()["home"] != "apiserver:3/3 nodes":
                    if time.monotonic() > deadline:
                        break
                    time.sleep(0.5)
                for sb in c.list():
                    orphans.append(f"{sb.id} {dict(sb.labels)} {sb.state}")
                    with contextlib.suppress(DsecError):
                        c.kill(sb.id)
            fig = report(p, faults, t_start, t_base, t_end, leaked, orphans)
            fig["drain_s"] = round(t_over - t_end, 1)
        finally:
            if p is not None and args.keep:
                keep_logs(p, Path(args.keep))
            if p is not None:
                for proc in p.trainers.values():
                    if proc.poll() is None:
                        proc.kill()
                        proc.wait()
                if p.api is not None:
                    p.api.stop()
                    p.api.log.unlink(missing_ok=True)
                for old in p.retired_apis:
                    old.log.unlink(missing_ok=True)
            try:
                kit_cm.__exit__(None, None, None)
            except AssertionError as e:
                leaked += [line for line in str(e).splitlines() if line.strip()]
            if p is not None:
                p.s3.stop()
                p.oci.stop()
        try:
            stack.close()
        except AssertionError as e:
            leaked += [line for line in str(e).splitlines() if line.strip()]
    finally:
        stack.close()
        os.environ.pop("DSEC_KIT_HOME", None)
        shutil.rmtree(work, ignore_errors=True)
    if fig:
        fig["leaked"] = len(leaked)
        fig["_leaked"] = leaked[:20]
    if leaked:
        scrub(leaked)
    return fig


def scrub(leaked: list[str]) -> None:
    """Remove what the soak found left behind (reported already): the processes in leaked
    cgroups, the cgroups, mounts and loop devices, so the machine is as it was."""
    import re

    text = "\n".join(leaked)
    cgroups = sorted(set(re.findall(r"/sys/fs/cgroup/[^'\s,\]]+", text)))
    for cg in cgroups:
        with contextlib.suppress(OSError):
            for pid in Path(cg, "cgroup.procs").read_text().split():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(int(pid), signal.SIGKILL)
    for pid in re.findall(r"'(\d+): ", text):
        with contextlib.suppress(ProcessLookupError, ValueError):
            os.kill(int(pid), signal.SIGKILL)
    time.sleep(1.0)
    mounts = sorted(set(re.findall(r"'(/var/tmp/dsec-soak-[^']+)'", text)), key=len, reverse=True)
    for m in mounts:
        subprocess.run(["umount", "-l", m], capture_output=True)
    for dev in set(re.findall(r"(/dev/loop\d+): ", text)):
        subprocess.run(["losetup", "-d", dev], capture_output=True)
    for cg in sorted(cgroups, key=len, reverse=True):
        with contextlib.suppress(OSError):
            os.rmdir(cg)


def keep_logs(p: Platform, keep: Path) -> None:
    """The ledgers, the fault log, the trainers', apiservers' and node daemons' logs, kept
    in ``keep`` (replaced) for a look after the run."""
    shutil.rmtree(keep, ignore_errors=True)
    keep.mkdir(parents=True)
    shutil.copytree(p.workdir, keep / "ledgers")
    with contextlib.suppress(OSError):
        shutil.copy(p.workdir.parent / "faults.jsonl", keep)
    for k, api in enumerate([*p.retired_apis, p.api]):
        if api is not None:
            with contextlib.suppress(OSError):
                shutil.copy(api.log, keep / f"apiserver-{k}.log")
    for home in sorted(Path(p.kit.plan.home_root).iterdir()):
        for name in ("dsecd.log", "dsecd.log.1", "dsecd.stderr"):
            with contextlib.suppress(OSError):
                shutil.copy(home / name, keep / f"{home.name}-{name}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="2 minutes of load")
    ap.add_argument("--minutes", type=float, default=20.0)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--trainers", type=int, default=3)
    ap.add_argument("--rollouts", type=int, default=3, help="rollouts at once per trainer")
    ap.add_argument("--disk", default="6G", help="size of the node homes' file system")
    ap.add_argument("--no-faults", action="store_true", help="the load alone")
    ap.add_argument("--no-vm", action="store_true", help="no microVM rollouts")
    ap.add_argument(
        "--keep",
        default="/tmp/dsec-soak-last",
        help="where the ledgers and logs are kept ('' for nowhere)",
    )
    ap.add_argument("--faults", default="", help="only these kinds (comma-separated)")
    ap.add_argument("--trainer", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.trainer:
        Trainer(json.loads(Path(args.trainer).read_text())).run()
        return
    fig = run_soak(args)
    print_table(fig)
    details = {k: fig.pop(k) for k in list(fig) if k.startswith("_")}
    for k, v in details.items():
        if v:
            print(f"{k[1:]}:")
            for item in v:
                print(f"  {item}")
    fig["quick"] = args.quick
    fig["seed"] = args.seed
    print(json.dumps(fig))
    bad = [
        k
        for k in (
            "lost",
            "untyped",
            "leaked",
            "steps_twice",
            "steps_lost",
            "misattributed",
            "orphans",
            "faults_failed",  # a fault the platform did not come back from
        )
        if fig.get(k)
    ]
    if not fig or bad or (fig.get("fault_kinds", 0) < 8 and not args.no_faults):
        sys.exit(1)


def print_table(fig: dict[str, Any]) -> None:
    if not fig:
        print("soak: no figures (the platform did not come up)")
        return
    print()
    print(
        f"{'requests by kind':32} "
        + ", ".join(f"{k} {v}" for k, v in fig["requests_by_kind"].items())
    )
    print(
        f"{'faults by kind':32} " + ", ".join(f"{k} {v}" for k, v in fig["faults_by_kind"].items())
    )
    print(
        f"{'typed errors by kind':32} "
        + ", ".join(f"{k} {v}" for k, v in fig["typed_errors_by_kind"].items())
    )
    print(
        f"{'masked (infra kinds)':32} "
        + ", ".join(f"{k} {v}" for k, v in fig["masked_by_infra_kind"].items())
    )
    rows = [
        (
            "rollouts done / given up masked / unmasked",
            f"{fig['rollouts_done']} / {fig['rollouts_given_up_masked']}"
            f" / {fig['rollouts_given_up_unmasked']}",
        ),
        ("trajectory steps checked exactly once", fig["steps_checked"]),
        ("lost (target 0)", fig["lost"]),
        ("untyped (target 0)", fig["untyped"]),
        ("leaked (target 0)", fig["leaked"]),
        ("orphans (target 0)", fig["orphans"]),
        ("steps run twice / lost (target 0)", f"{fig['steps_twice']} / {fig['steps_lost']}"),
        ("misattributed (target 0)", fig["misattributed"]),
        ("interrupted by a trainer's SIGKILL", fig["interrupted"]),
        (
            "creates/s without / with faults",
            f"{fig['creates_per_s_no_faults']} / {fig['creates_per_s_faults']}",
        ),
        (
            "exec p50 ms without / with faults",
            f"{fig['exec_p50_ms_no_faults']} / {fig['exec_p50_ms_faults']}",
        ),
    ]
    for name, value in rows:
        print(f"{name:44} {value}")


if __name__ == "__main__":
    main()
