"""The node's devices (accelerators, or any host device node) and which sandboxes hold them.

The inventory comes from ``NodeConfig.devices`` (``DSEC_DEVICES``) and is checked when the node
opens: each path must be a char or block device node, or the node does not open. A sandbox asks
for ``count`` distinct devices of a kind (``SandboxSpec.devices``), held either

- "exclusive": the device is the sandbox's alone; no other sandbox, exclusive or shared, gets it
  until the sandbox is gone; or
- "shared": with at most ``NodeConfig.share_cap(kind)`` sandboxes on the device, none of them
  exclusive; a shared request takes the least-loaded devices, so sharers spread out.

A request the node cannot meet now is ``AdmissionRejected`` with ``reason="devices"`` and
``pool="devices:<kind>"``, saying what holds the devices: the sandbox is never started to fail
in its OCI runtime. Accounting is in the node's process only; a restarted daemon rebuilds it
from the sandboxes it re-adopts (``adopt``), whose state records the devices they hold.
"""

from __future__ import annotations

import logging
import os
import stat
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from ..backend import DeviceNode
from ..config import NodeConfig
from ..errors import AdmissionRejected, InvalidSpec
from ..records import DeviceRequest

__all__ = ["Device", "DevicePool"]

log = logging.getLogger("dsec.devices")


@dataclass(frozen=True)
class Device:
    """One device of the inventory, as ``stat`` found it when the node opened."""

    kind: str
    path: str
    type: str  # "c" | "b"
    major: int
    minor: int
    mode: int  # permission bits

    @classmethod
    def probe(cls, kind: str, path: str) -> Device:
        """The device node at ``path``; ``InvalidSpec`` naming ``DSEC_DEVICES`` if there is
        none (missing, or not a char or block device)."""
        try:
            st = os.stat(path)
        except OSError as e:
            raise InvalidSpec(
                f"DSEC_DEVICES: {kind} device {path}: {e.strerror}",
                field="DSEC_DEVICES",
                kind=kind,
                path=path,
            ) from None
        if stat.S_ISCHR(st.st_mode):
            kind_of = "c"
        elif stat.S_ISBLK(st.st_mode):
            kind_of = "b"
        else:
            raise InvalidSpec(
                f"DSEC_DEVICES: {kind} device {path} is not a char or block device node",
                field="DSEC_DEVICES",
                kind=kind,
                path=path,
            )
        if st.st_mode & 0o006 != 0o006:
            # runc bind-mounts the node in (oci_devices): its host mode holds inside, where
            # its owner (host root) is nobody, so only the "others" bits count there
            log.warning(
                "DSEC_DEVICES: %s device %s has mode %o: sandboxes get it but cannot open it "
                "for reading and writing unless others may (chmod o+rw)",
                kind,
                path,
                st.st_mode & 0o777,
            )
        return cls(
            kind, path, kind_of, os.major(st.st_rdev), os.minor(st.st_rdev), st.st_mode & 0o777
        )

    def node(self) -> DeviceNode:
        """How a sandbox gets it: at the same path inside, with the host's file mode."""
        return DeviceNode(
            kind=self.kind,
            host_path=self.path,
            path=self.path,
            type=self.type,
            major=self.major,
            minor=self.minor,
            mode=self.mode,
        )


class DevicePool:
    """The inventory and who holds what: ``holders[path]`` maps sandbox ids to the mode they
    hold the device in. Only the node's event loop uses it (no lock)."""

    def __init__(
        self, devices: Sequence[Device] = (), caps: Mapping[str, int] | None = None
    ) -> None:
        self.devices = list(devices)
        self.by_path = {d.path: d for d in self.devices}
        self.caps = dict(caps or {})
        self.holders: dict[str, dict[str, str]] = {d.path: {} for d in self.devices}

    @classmethod
    def probe(cls, config: NodeConfig) -> DevicePool:
        """The node's inventory (``NodeConfig.devices``), each path checked."""
        devices: list[Device] = []
        seen: dict[str, str] = {}
        for kind, paths in config.devices.items():
            DeviceRequest(kind)  # the kind must be a name a spec can ask for
            for path in paths:
                if path in seen:
                    raise InvalidSpec(
                        f"DSEC_DEVICES: {path} is listed twice ({seen[path]} and {kind})",
                        field="DSEC_DEVICES",
                        path=path,
                    )
                seen[path] = kind
                devices.append(Device.probe(kind, path))
        caps = {kind: config.share_cap(kind) for kind in config.devices}
        return cls(devices, caps)

    def kinds(self) -> list[str]:
        return sorted({d.kind for d in self.devices})

    def _of(self, kind: str) -> list[Device]:
        return [d for d in self.devices if d.kind == kind]

    def _exclusive(self, path: str) -> bool:
        return "exclusive" in self.holders[path].values()

    def _room(self, d: Device, mode: str) -> bool:
        held = self.holders[d.path]
        if mode == "exclusive":
            return not held
        return not self._exclusive(d.path) and len(held) < self.caps.get(d.kind, 1)

    # --- allocate and give back -----------------------------------------------------------
    def allocate(self, sid: str, requests: Sequence[DeviceRequest]) -> tuple[DeviceNode, ...]:
        """Devices for sandbox ``sid``, all requests or none: ``AdmissionRejected`` naming the
        kind's pool when one cannot be met."""
        picked: list[tuple[Device, str]] = []
        for req in requests:
            picked += [(d, req.mode) for d in self._pick(req)]
        for d, mode in picked:
            self.holders[d.path][sid] = mode
        return tuple(d.node() for d, _ in picked)

    def check(self, requests: Sequence[DeviceRequest]) -> None:
        """``AdmissionRejected`` (saying what holds the devices) if ``allocate`` would refuse
        ``requests`` now; takes nothing."""
        for req in requests:
            self._pick(req)

    def _pick(self, req: DeviceRequest) -> list[Device]:
        mine = self._of(req.kind)
        pool = f"devices:{req.kind}"
        if not mine:
            raise AdmissionRejected(
                f"this node has no devices of kind {req.kind!r} "
                f"(it has: {', '.join(self.kinds()) or 'none'}; DSEC_DEVICES)",
                reason="devices",
                pool=pool,
                kind=req.kind,
            )
        fits = [d for d in mine if self._room(d, req.mode)]
        if len(fits) < req.count:
            raise AdmissionRejected(
                f"devices {req.kind}: asked {req.count} {req.mode}, "
                f"{len(fits)} of {len(mine)} can take it now ({self._describe(mine)})",
                reason="devices",
                pool=pool,
                kind=req.kind,
                asked=req.count,
                mode=req.mode,
            )
        if req.mode == "shared":  # least loaded first; the inventory's order breaks ties
            fits.sort(key=lambda d: len(self.holders[d.path]))
        return fits[: req.count]

    def _describe(self, devices: Iterable[Device]) -> str:
        """What holds each device, for a refusal: ``/dev/a exclusive by 3f2a..., /dev/b shared
        by 2 of 4``."""
        out = []
        for d in devices:
            held = self.holders[d.path]
            if not held:
                out.append(f"{d.path} free")
            elif self._exclusive(d.path):
                out.append(f"{d.path} exclusive to {next(iter(held))}")
            else:
                out.append(f"{d.path} shared by {len(held)} of {self.caps.get(d.kind, 1)}")
        return ", ".join(out)

    def release(self, sid: str) -> None:
        """Give back every device sandbox ``sid`` holds (none: nothing happens)."""
        for held in self.holders.values():
            held.pop(sid, None)

    def adopt(
        self, sid: str, requests: Sequence[DeviceRequest], nodes: Iterable[DeviceNode]
    ) -> None:
        """After a daemon restart: sandbox ``sid`` holds ``nodes`` (from its state), in the
        mode its spec asked for them. A device no longer in the inventory stays the sandbox's
        but is not counted (there is nothing to count it against)."""
        modes = {r.kind: r.mode for r in requests}
        for n in nodes:
            held = self.holders.get(n.host_path)
            if held is None:
                log.warning(
                    "sandbox %s holds %s, which is no longer in DSEC_DEVICES", sid, n.host_path
                )
                continue
            held[sid] = modes.get(n.kind, "exclusive")

    def held_by(self, sid: str) -> list[str]:
        return [path for path, held in self.holders.items() if sid in held]

    # --- what placement and status see ----------------------------------------------------
    def usage(self) -> dict[str, dict[str, int]]:
        """By kind: ``total``, ``idle`` (no holder) and ``shareable`` (room for one more
        shared holder): ``NodeLoad.devices``."""
        out: dict[str, dict[str, int]] = {}
        for d in self.devices:
            u = out.setdefault(d.kind, {"total": 0, "idle": 0, "shareable": 0})
            u["total"] += 1
            u["idle"] += self._room(d, "exclusive")
            u["shareable"] += self._room(d, "shared")
        return out

    def holdings(self) -> list[tuple[Device, dict[str, str]]]:
        """Each device with its holders (sandbox id -> mode), in the inventory's order."""
        return [(d, dict(self.holders[d.path])) for d in self.devices]
