"""How runc starts: ``dsec-runc-launch`` (``launch.c`` says why and how), the small mount
namespace the node keeps for it to copy (``LaunchNamespace``), so that starting a sandbox
neither reads nor copies the other sandboxes' mounts, and the sealed copy of runc it runs
(``SealedBinary``), so that runc's init does not copy runc on every start."""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import shutil
import subprocess
from collections.abc import Hashable, Sequence
from pathlib import Path

from dsec_core.errors import BackendUnavailable
from dsec_core.linux.mounts import mount_points
from dsec_core.linux.tools import compile_static

__all__ = ["LAUNCHER_SOURCE", "LaunchNamespace", "SealedBinary", "detachable", "ensure_launcher"]

log = logging.getLogger("dsec.node")

LAUNCHER_SOURCE = Path(__file__).with_name("launch.c")
# Kept whole in the launch namespace: what runc reads (cgroups, /proc/self) and the devices it
# binds into sandboxes.
KERNEL_TREES = ("/proc", "/sys", "/dev")
HOLD_TIMEOUT = 10.0


def ensure_launcher(bin_dir: Path) -> Path:
    """``bin_dir/dsec-runc-launch-<digest>`` (``launch.c``), compiled first if missing."""
    digest = hashlib.sha256(LAUNCHER_SOURCE.read_bytes()).hexdigest()[:12]
    target = bin_dir / f"dsec-runc-launch-{digest}"
    if target.exists():
        return target
    return compile_static(
        [LAUNCHER_SOURCE], target, "the runc launcher", missing=BackendUnavailable
    )


def _within(path: str, tree: str) -> bool:
    return path == tree or path.startswith(tree.rstrip("/") + "/")


def detachable(mount_points: Sequence[str], needed: Sequence[Path]) -> list[str]:
    """The mount points of ``mount_points`` (a mount table's, in its order) that runc needs
    nothing under: neither one of the ``needed`` paths nor a directory above one, nor in the
    kernel's trees (``KERNEL_TREES``). Detaching them takes their children too."""
    keep = [os.fspath(p) for p in needed]
    out = []
    for mp in mount_points:
        if any(_within(mp, t) for t in KERNEL_TREES):
            continue
        if any(_within(p, mp) for p in keep):
            continue
        out.append(mp)
    return out


class LaunchNamespace:
    """A mount namespace that holds what runc needs (``needed``: paths whose mounts stay, with
    every mount above them) and nothing else, made once by ``dsec-runc-launch --hold`` and
    held by its descriptor; made again when ``key`` changes (a new lxcfs mount). Each start
    copies this one, not the node's."""

    def __init__(self, launcher: Path) -> None:
        self.launcher = launcher
        self._fd = -1
        self._key: Hashable = None
        self._failed: Hashable = None
        self._detached: frozenset[str] = frozenset()

    def fd(
        self,
        key: Hashable,
        needed: Sequence[Path],
        hide: Sequence[Path],
        mask: Sequence[Path] = (),
    ) -> int | None:
        """The namespace's descriptor for ``key``, made if it is not made for it, with the
        files ``mask`` masked (launch.c's ``--mask``); None if it cannot be made (logged once
        per key: a start then copies the node's namespace)."""
        if self._fd >= 0 and self._key == key:
            return self._fd
        if self._failed == key:
            return None
        try:
            fd = self._make(needed, hide, mask)
        except (OSError, subprocess.SubprocessError, ValueError) as e:
            log.warning("cannot make runc's launch namespace (each start copies the node's): %s", e)
            self._failed = key
            return None
        self.close()
        self._fd, self._key = fd, key
        return fd

    def covers(self, sources: Sequence[str]) -> bool:
        """Whether the namespace made last shows each of ``sources`` (paths a sandbox's
        config binds in) as the node's does: none is at or below a mount it detached."""
        for src in sources:
            p = Path(src)
            for d in (p, *p.parents):
                if os.fspath(d) in self._detached:
                    return False
        return True

    def _make(self, needed: Sequence[Path], hide: Sequence[Path], mask: Sequence[Path]) -> int:
        with open("/proc/self/mountinfo") as f:
            points = mount_points(f.read())
        detach = [*map(os.fspath, hide), *detachable(points, needed)]
        self._detached = frozenset(detach)
        argv = [os.fspath(self.launcher), "--hold"]
        for masked in mask:
            argv += ["--mask", os.fspath(masked)]
        for d in detach:
            argv += ["--hide", d]
        proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        try:
            assert proc.stdout is not None and proc.stdin is not None
            line = proc.stdout.readline()
            if line != b"ready\n":
                raise ValueError(f"dsec-runc-launch --hold answered {line!r}")
            return os.open(f"/proc/{proc.pid}/ns/mnt", os.O_RDONLY | os.O_CLOEXEC)
        finally:
            if proc.stdin is not None:
                proc.stdin.close()
            proc.wait(HOLD_TIMEOUT)
            if proc.stdout is not None:
                proc.stdout.close()

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


#: The seals runc's init looks for on /proc/self/exe (``is_self_cloned`` in runc's
#: ``cloned_binary.c``): with exactly these, it trusts the binary it runs from.
RUNC_SEALS = fcntl.F_SEAL_SEAL | fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_WRITE


class SealedBinary:
    """A sealed memfd copy of the program at ``path``, made once and made again when the file
    changes (an upgrade), for the launcher to run (``--exec-fd``).

    Why: a container that could write to the runc binary its init runs from could replace the
    host's runc (CVE-2019-5736). So runc's init, unless /proc/self/exe is already a memfd with
    ``RUNC_SEALS``, copies runc (9 MB) into a new sealed memfd and executes itself again, on
    every start: about a tenth of a start's CPU. Run from this copy, its init finds the seals and
    goes on. The seals forbid any write, so one copy can serve every start (runc's own comment
    on ``is_self_cloned`` says as much), and its pages are shared by them all.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        self._fd = -1
        self._stamp: tuple[int, ...] = ()

    def fd(self) -> int | None:
        """The memfd (close-on-exec in the node; the launcher clears that for its exec), or
        None if it cannot be made (logged once per version of the file: runc then copies
        itself on each start, as it does when run from its path)."""
        try:
            st = os.stat(self.path)
        except OSError as e:
            log.warning("cannot find %s to seal a copy of it: %s", self.path, e)
            return None
        stamp = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
        if stamp == self._stamp:
            return self._fd if self._fd >= 0 else None
        self.close()
        self._stamp = stamp
        try:
            self._fd = _sealed_copy(self.path)
        except OSError as e:
            log.warning("cannot make a sealed copy of %s (each start copies it): %s", self.path, e)
        return self._fd if self._fd >= 0 else None

    def close(self) -> None:
        self._stamp = ()
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


def _sealed_copy(path: Path) -> int:
    fd = os.memfd_create("runc_cloned:/proc/self/exe", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        with open(path, "rb") as src, open(fd, "wb", closefd=False) as dst:
            shutil.copyfileobj(src, dst, 1 << 20)
        os.fchmod(fd, 0o755)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, RUNC_SEALS)
    except BaseException:
        os.close(fd)
        raise
    return fd
