"""Persistence and adoption: every sandbox's state in ``<run_dir>/sandboxes/<id>/state.json`` (a
tmpfs), and a restarted daemon's reading of it back.

``write_state`` saves a sandbox after each change the next daemon must know of. At start,
``StateFiles.recover`` finishes what a daemon that died left half done (a pack that may hold a
writable layer frozen), reads every state back, and sorts the sandboxes into those that still
run (adopted: their policies are told so) and the rest (stopped, their directories removed,
their policies released). What the adopted ones hold of the node (uids, devices, layer mounts,
timers) the node takes back itself.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import shutil
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

from ..backend import DeviceNode, Feature, LayerImage, RootfsForm
from ..errors import DsecError
from ..layers.store import LayerStore
from ..linux.mounts import ensure_tmpfs, mounted_under, unmount
from ..records import IdMap, InfraEvent, LayerInfo, SandboxSpec
from .host import StateHost
from .policies import PolicyPlanner
from .sandbox import Sandbox
from .snapshots import PACK_MARKER, recover_packs

__all__ = ["STATE_FILE", "StateFiles", "scrub_dir", "state_doc", "write_state"]

log = logging.getLogger("dsec.node")

#: A sandbox's state, in its runtime directory.
STATE_FILE = "state.json"


def state_doc(sb: Sandbox) -> dict[str, Any]:
    """What a restarted daemon needs of ``sb`` (``StateFiles.load`` reads it back)."""
    return {
        "id": sb.rt.id,
        "spec": sb.rt.spec.to_dict(),
        "backend": sb.backend.name,
        "created": sb.created,
        "expires": sb.expires,
        "status": sb.status,
        "paused": sb.paused,
        "preempted": sb.preempted,
        "events": [e.to_dict() for e in sb.events],
        "oom_kills": sb.oom_kills,
        "warm": sb.warm,
        "layers": [layer.to_dict() for layer in sb.layers],
        "backend_state": sb.backend_state,
        "idmap": [sb.rt.idmap.host_base, sb.rt.idmap.size, sb.rt.idmap.group],
        "rootfs": None if sb.rt.rootfs is None else os.fspath(sb.rt.rootfs),
        "images": [
            [i.ref, i.digest, os.fspath(i.image), i.device and os.fspath(i.device)]
            for i in sb.rt.images
        ],
        "disk": None if sb.rt.disk is None else os.fspath(sb.rt.disk),
        "disk_size": sb.rt.disk_size,
        "kernel": sb.rt.kernel,
        "devices": [d.to_dict() for d in sb.rt.devices],
        "policy_plan": {
            "chosen": {p.name: s for p, s in sb.policies.chosen},
            "skipped": sb.policies.skipped,
        },
    }


def write_state(sb: Sandbox) -> None:
    """Save ``sb``'s state (atomically) in its runtime directory."""
    path = sb.rt.dir / STATE_FILE
    tmp = path.with_suffix(".tmp")
    # 0600: the directory admits the sandboxes' group (runc's way to rootfs/), the state
    # is root's alone
    # dumps, not dump: json.dump streams through the pure-Python encoder (3-4x slower here,
    # and a create or a warm claim writes its state twice or once)
    text = json.dumps(state_doc(sb))
    with open(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "w") as f:
        f.write(text)
    os.replace(tmp, path)


def scrub_dir(sdir: Path) -> None:
    """Remove a sandbox's runtime directory and whatever is still mounted under it."""
    for mp in mounted_under(sdir):
        unmount(mp)
    shutil.rmtree(sdir, ignore_errors=True)


class StateFiles:
    """The saved states of ``host``'s sandboxes; ``planner`` gives back their policies."""

    def __init__(self, host: StateHost, planner: PolicyPlanner) -> None:
        self.host = host
        self.planner = planner

    def open(self) -> None:
        """Mount the runtime tmpfs the states live in (if no daemon before did) and make the
        sandboxes' directory in it; runc's init passes both on its way to a root filesystem."""
        cfg = self.host.config
        ensure_tmpfs(cfg.run_dir, mode=0o710, gid=cfg.sandbox_gid)
        cfg.on_sandbox_path(cfg.run_dir)  # a tmpfs a daemon before this change mounted 0711
        cfg.runtime_dir.mkdir(exist_ok=True)
        cfg.on_sandbox_path(cfg.runtime_dir)

    async def recover(self, died: Callable[[Sandbox], object] = lambda sb: None) -> list[Sandbox]:
        """The sandboxes a previous daemon left running (unexpired), their policies told they
        are adopted; every other one a state names is stopped and cleaned up. ``died`` is told
        of each that was running, unexpired, and stopped on its own while no daemon watched
        (a VM's QEMU killed with its daemon), before its backend's traces go."""
        cfg = self.host.config
        runtime = cfg.runtime_dir
        # first: a pack that died holds a view of a writable layer and may leave it frozen
        markers = list(runtime.glob(f"*/{PACK_MARKER}")) if runtime.exists() else []
        await asyncio.to_thread(recover_packs, LayerStore(cfg.layer_dir), markers)
        adopted = []
        for sdir in sorted(runtime.iterdir()) if runtime.exists() else []:
            try:
                sb = self.load(sdir)
            except Exception as e:  # unreadable state: nothing to adopt, only to clean
                log.warning("sandbox dir %s: %s; removing", sdir, e)
                scrub_dir(sdir)
                continue
            alive = sb.status == "running" and await sb.backend.alive(sb.rt, sb.backend_state)
            unexpired = sb.expires is None or sb.expires > time.time()
            if alive and unexpired:
                adopted.append(sb)
                for policy, settings in sb.policies.chosen:
                    policy.adopted(sb.rt, settings)
                continue
            if sb.status == "running" and unexpired:
                log.warning("sandbox %s died while no daemon watched; cleaning up", sb.rt.id)
                died(sb)
            else:
                log.info("sandbox %s is gone or expired; cleaning up", sb.rt.id)
            try:
                await sb.backend.stop(sb.rt, sb.backend_state)
            except DsecError as e:
                log.warning("stopping %s: %s", sb.rt.id, e)
            scrub_dir(sdir)
            for policy, _ in sb.policies.chosen:  # pinned objects, devices it made
                try:
                    policy.released(sb.rt)
                except DsecError as e:
                    log.warning("releasing policy %s of %s: %s", policy.name, sb.rt.id, e)
        return adopted

    def load(self, sdir: Path) -> Sandbox:
        """The sandbox whose state is in runtime directory ``sdir``."""
        doc = json.loads((sdir / STATE_FILE).read_text())
        spec = SandboxSpec.from_dict(doc["spec"])
        backend = self.host.backend(doc["backend"])
        layers = [LayerInfo.from_dict(d) for d in doc["layers"]]
        sid = doc["id"]
        # State written before runtimes recorded their form: a composed root is at rootfs/.
        composed = os.fspath(sdir / "rootfs") if backend.rootfs is RootfsForm.COMPOSED else None
        rootfs = doc.get("rootfs", composed)
        rt = replace(
            self.host.runtime(sid, spec, backend, IdMap(*doc["idmap"])),
            rootfs=Path(rootfs) if rootfs else None,
            images=tuple(
                LayerImage(ref, digest, Path(image), Path(device) if device else None)
                for ref, digest, image, device in doc.get("images", [])
            ),
            disk=Path(doc["disk"]) if doc.get("disk") else None,
            disk_size=int(doc.get("disk_size") or 0),
            devices=tuple(DeviceNode.from_dict(d) for d in doc.get("devices") or ()),
            kernel=doc.get("kernel"),
        )
        sb = Sandbox(
            rt=rt,
            backend=backend,
            layers=layers,
            created=doc["created"],
            expires=doc["expires"],
            backend_state=doc.get("backend_state") or {},
            status=doc.get("status", "creating"),
            policies=self.planner.recorded(sid, doc.get("policy_plan"), spec, backend),
            events=[InfraEvent.from_dict(e) for e in doc.get("events") or ()],
            oom_kills=int(doc.get("oom_kills") or 0),
            warm=bool(doc.get("warm")),
            preempted=bool(doc.get("preempted")),
            # the freezer is the truth: a pause or resume may have been cut short by a crash
            paused=Feature.PAUSE in backend.features
            and backend.paused(rt, doc.get("backend_state") or {}),
        )
        sb.preempted = sb.preempted and sb.paused  # a crash between freezer and record
        return sb
