"""pack_diff: a sandbox's writable layer packed as an incremental EROFS layer over its layers.

The overlay's upper directory already is the diff, in the form a lower layer needs: whiteouts
are 0:0 character devices, opaque directories carry ``trusted.overlay.opaque``, and the node
mounts overlays without ``metacopy`` or ``redirect_dir``, so every changed file is a full copy.
Only owners differ: the sandbox wrote them as host ids of its range, while layers hold
in-sandbox ids. So the upper is read through an idmapped clone whose maps are the sandbox's read
backwards (``IdMap.unshift_uid_lines``): mkfs.erofs sees in-sandbox owners and nothing is
copied. (``tests/test_snapshots.py`` prints the time and size of a small pack with ``-s``.)

The sandbox is frozen (cgroup freezer) while mkfs.erofs reads, so a snapshot taken while it
writes is one consistent state, and thawed on every path out.
"""

from __future__ import annotations

import contextlib
import os
import posixpath
import time
from collections.abc import Iterable, Sequence
from pathlib import Path

from ..errors import InvalidSpec, NodeUnavailable
from ..layers.store import LayerStore
from ..linux.cgroups import freeze, thaw
from ..linux.erofs import mkfs_erofs
from ..linux.files import remove_tree
from ..linux.mounts import (
    UserNamespaceHandle,
    attach,
    clone_idmapped,
    mounted_under,
    unmount,
)
from ..records import IdMap, LayerInfo

__all__ = [
    "PACK_TIMEOUT",
    "RUNTIME_PATHS",
    "SCRUBBED",
    "SNAPSHOT_COMPRESSION",
    "exclude_paths",
    "pack_upper",
    "recover_packs",
]

#: How snapshot images are compressed: not at all, since the sandbox stays frozen while
#: mkfs.erofs runs. Measured for 40 MiB of mixed data: none 0.07 s, lz4 0.7 s, lz4hc 12 s
#: (sizes 42, 32 and 30 MB). Recompressing a snapshot that is kept for long is a next step.
SNAPSHOT_COMPRESSION: str | None = None

#: Seconds mkfs.erofs may take before the pack fails (and the sandbox thaws): bounds how long
#: a sandbox can stay frozen. Uncompressed, it packs hundreds of MB a second here.
PACK_TIMEOUT = 600.0

#: What ``scrub=True`` leaves out of every snapshot (relative to the sandbox's root): scratch
#: space, caches and shell histories, which a restored sandbox should not inherit.
SCRUBBED = (
    "tmp",
    "var/tmp",
    "var/cache",
    "root/.cache",
    "root/.ash_history",
    "root/.bash_history",
    "root/.python_history",
)


#: Never packed: where the runtime mounts the agent (runc creates the mount point in every
#: sandbox's writable layer; each restored sandbox gets its own again).
RUNTIME_PATHS = (".dsec",)


def exclude_paths(exclude: Iterable[str], scrub: bool) -> tuple[str, ...]:
    """``exclude`` (absolute or relative paths inside the sandbox) as mkfs.erofs wants them,
    relative and normalized, after ``RUNTIME_PATHS`` and, if ``scrub``, ``SCRUBBED``;
    ``InvalidSpec`` for a path that leaves the root or names it."""
    out: list[str] = [*RUNTIME_PATHS, *(SCRUBBED if scrub else ())]
    for path in exclude:
        if not isinstance(path, str):
            raise InvalidSpec(f"exclude: {path!r} is not a path", field="exclude")
        norm = posixpath.normpath("/" + path).lstrip("/")
        if not norm or ".." in path.split("/") or "\0" in path:
            raise InvalidSpec(f"exclude: {path!r} does not name a path below /", field="exclude")
        if norm not in out:
            out.append(norm)
    return tuple(out)


def pack_upper(
    upper: Path,
    idmap: IdMap,
    cgroup: str,
    store: LayerStore,
    *,
    name: str,
    version: str | None,
    parents: Sequence[LayerInfo],
    exclude: Sequence[str],
    source: str,
    env: Sequence[str] = (),
    workdir: str = "",
    marker: Path | None = None,
    paused: bool = False,
) -> tuple[LayerInfo, float]:
    """Freeze ``cgroup``, pack ``upper`` (a writable layer of ``idmap``'s sandbox) into a
    ``snapshot`` layer of ``store`` over ``parents`` (recording the sandbox's ``env`` and
    ``workdir``), thaw; returns the layer and how long the
    sandbox stayed frozen (seconds). Blocking: call it in a thread. Nothing is left mounted.
    ``marker`` exists while the sandbox may be frozen, so a daemon that died meanwhile is
    followed by one that thaws it (``recover_packs``). A ``paused`` sandbox is frozen already
    and stays so."""
    with store.scratch("pack-") as tmp:
        view = tmp / "upper"
        view.mkdir()
        image = tmp / "layer.erofs"
        userns = UserNamespaceHandle(idmap.unshift_uid_lines(), idmap.unshift_gid_lines())
        try:
            fd = clone_idmapped(upper, userns)
        finally:
            userns.close()  # the clone keeps it
        try:
            attach(fd, view)
        finally:
            os.close(fd)
        try:
            t0 = time.perf_counter()
            if marker is not None and not paused:
                marker.write_text(cgroup)
            _set_frozen(cgroup, True)
            try:
                mkfs_erofs(
                    view,
                    image,
                    all_root=False,
                    exclude=exclude,
                    compression=SNAPSHOT_COMPRESSION,
                    timeout=PACK_TIMEOUT,
                )
            finally:
                frozen = time.perf_counter() - t0
                if not paused:
                    _set_frozen(cgroup, False)
                if marker is not None:
                    marker.unlink(missing_ok=True)
        finally:
            with contextlib.suppress(Exception):  # remove_tree detaches what is left anyway
                unmount(view)
        info = store.add(
            image,
            name=name,
            version=version,
            kind="snapshot",
            source=source,
            parents=[p.ref for p in parents],
            parent_digests=[p.digest for p in parents],
            env=env,
            workdir=workdir,
        )
        return info, frozen


def recover_packs(store: LayerStore, markers: Iterable[Path]) -> None:
    """After a daemon died mid-pack: detach the upper views left attached in ``store``'s
    scratch, remove those scratch dirs, and thaw the cgroup each of ``markers`` names."""
    tmp = store.tmp_dir
    for scratch in sorted(tmp.glob("pack-*")) if tmp.is_dir() else []:
        for point in mounted_under(scratch):
            unmount(point, lazy=True)  # nothing of ours uses it any more
        remove_tree(scratch)
    for marker in markers:
        try:
            cgroup = marker.read_text().strip()
        except FileNotFoundError:
            continue
        with contextlib.suppress(NodeUnavailable):  # its cgroup is gone: so is the sandbox
            _set_frozen(cgroup, False)
        marker.unlink(missing_ok=True)


def _set_frozen(cgroup: str, on: bool) -> None:
    """Freeze or thaw ``cgroup``; ``NodeUnavailable`` if its freezer is gone or does not
    settle (a freeze that does not is thawed again by ``cgroups.freeze``)."""
    try:
        (freeze if on else thaw)(cgroup, timeout=10.0)
    except (OSError, TimeoutError) as e:
        raise NodeUnavailable(
            f"cannot {'freeze' if on else 'thaw'} cgroup {cgroup}: {e}", cgroup=cgroup
        ) from e
