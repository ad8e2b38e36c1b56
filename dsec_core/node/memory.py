"""VM memory snapshots: a running sandbox's memory, devices and writable disk saved at one
instant (``Feature.MEMORY_SNAPSHOT``), and sandboxes started from that instant.

Each snapshot is a directory ``<home>/memory-snapshots/<name>`` holding what the backend saved
and ``meta.json`` (a ``MemorySnapshot``).
"""

from __future__ import annotations

import json
import re
import shutil
import time
from pathlib import Path

from ..backend import Feature
from ..errors import (
    FeatureUnavailable,
    InvalidSpec,
    SandboxPaused,
    SnapshotInUse,
    UnknownSnapshot,
)
from ..linux.files import write_atomic
from ..records import MemorySnapshot, SandboxInfo, SandboxSpec, user_labels
from .host import SnapshotHost, create_all

__all__ = ["SNAPSHOT_NAME", "MemorySnapshots"]

#: A memory snapshot's name (a directory under ``<home>/memory-snapshots``).
SNAPSHOT_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")


class MemorySnapshots:
    """The memory snapshots of ``host``'s node."""

    def __init__(self, host: SnapshotHost) -> None:
        self.host = host

    @property
    def root(self) -> Path:
        return self.host.config.home / "memory-snapshots"

    def directory(self, name: str, must_exist: bool = True) -> Path:
        """Snapshot ``name``'s directory: ``InvalidSpec`` for a bad name, ``UnknownSnapshot``
        if there is none (unless not ``must_exist``; then a bad name gives a directory that
        never exists: the name may be a layer's)."""
        if not isinstance(name, str) or not SNAPSHOT_NAME.fullmatch(name):
            if not must_exist:
                return self.root / ".none"
            raise InvalidSpec(
                f"memory snapshot name {name!r}: 1-64 of letters, digits, '.', '_', '-'",
                field="name",
            )
        d = self.root / name
        if must_exist and not (d / "meta.json").is_file():
            raise UnknownSnapshot(f"no memory snapshot {name!r} on this node", name=name)
        return d

    def exists(self, name: str) -> bool:
        """Whether ``name`` names a memory snapshot of this node (not a layer)."""
        return self.directory(name, must_exist=False).is_dir()

    async def save(self, sid: str, name: str | None = None) -> MemorySnapshot:
        """Save a running sandbox's memory, devices and writable disk at one instant (VM
        backends); it runs on. ``restore(name, n)`` then starts n sandboxes from there."""
        sb = self.host.sandbox(sid)
        if sb.status != "running":
            raise sb.not_running()
        if sb.paused:
            raise SandboxPaused(f"sandbox {sid} is paused; resume it first", sandbox_id=sid)
        if Feature.MEMORY_SNAPSHOT not in sb.backend.features:
            raise FeatureUnavailable(
                f"backend {sb.backend.name!r} cannot save a sandbox's memory (only VM "
                "backends can; pack_diff saves any sandbox's files)",
                backend=sb.backend.name,
                feature=Feature.MEMORY_SNAPSHOT.value,
            )
        name = name or f"{sid}-{int(time.time())}"
        d = self.directory(name, must_exist=False)
        if d.exists():
            raise InvalidSpec(f"memory snapshot {name!r} exists already", field="name")
        d.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        try:
            with self.host.expect_exit(sb):  # the guest stops for the save: not a death
                await sb.backend.save(sb.rt, sb.backend_state, d)
        except FileExistsError:
            raise InvalidSpec(f"memory snapshot {name!r} exists already", field="name") from None
        snap = MemorySnapshot(
            name=name,
            sandbox_id=sid,
            backend=sb.backend.name,
            created=time.time(),
            bytes=sum(f.stat().st_blocks * 512 for f in d.iterdir() if f.is_file()),
            spec=sb.rt.spec.to_dict(),
        )
        write_atomic(d / "meta.json", json.dumps(snap.to_dict()).encode(), 0o600)
        return snap

    def get(self, name: str) -> MemorySnapshot:
        d = self.directory(name)
        return MemorySnapshot.from_dict(json.loads((d / "meta.json").read_text()))

    def users(self, name: str) -> list[str]:
        """The sandboxes whose memory is snapshot ``name``'s saved RAM (started from it,
        mapping it still): the backend's state names the file (``memory_from``)."""
        d = self.directory(name)
        return sorted(
            sid
            for sid, sb in self.host.sandboxes.items()
            if str(sb.backend_state.get("memory_from") or "").startswith(f"{d}/")
        )

    def remove(self, name: str) -> None:
        """Remove snapshot ``name``; ``SnapshotInUse`` while sandboxes map its memory."""
        users = self.users(name)
        if users:
            raise SnapshotInUse(
                f"memory snapshot {name!r} is the memory of {len(users)} running "
                f"sandbox(es) ({', '.join(users[:5])}); kill them first",
                name=name,
                sandboxes=users,
            )
        shutil.rmtree(self.directory(name))

    def restore_spec(self, snap: MemorySnapshot, spec: SandboxSpec | None) -> SandboxSpec:
        """The saved sandbox's spec, with ``spec``'s ttl and labels (a VM must have the saved
        one's RAM and vCPUs to load its state)."""
        fields = dict(snap.spec)
        if spec is not None:
            fields.update(ttl=spec.ttl, labels={**fields.get("labels", {}), **spec.labels})
        # not the saved sandbox's create key: the n restored are n creates of their own
        fields["labels"] = user_labels(fields.get("labels") or {})
        return SandboxSpec(**fields)

    async def restore(
        self, name: str, n: int, spec: SandboxSpec | None = None
    ) -> list[SandboxInfo]:
        """``n`` sandboxes from memory snapshot ``name``, all or nothing (``create_all``)."""
        made_spec = self.restore_spec(self.get(name), spec)
        return await create_all(self.host, made_spec, n, saved=self.directory(name))
