"""Where a node keeps its state and what it may hold: paths under ``DSEC_HOME`` and capacity.

Everything a node writes lives under one directory (default ``/var/lib/dsec``), so tests can
run an isolated node by pointing ``DSEC_HOME`` at a temporary directory.
"""

from __future__ import annotations

import functools
import hashlib
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .errors import InvalidSpec
from .linux.hostmem import meminfo
from .records import parse_size

__all__ = [
    "NodeConfig",
    "default_home",
    "default_runtime",
    "mem_total",
    "parse_devices",
    "parse_share_caps",
]


def default_home() -> Path:
    return Path(os.environ.get("DSEC_HOME", "/var/lib/dsec"))


def default_runtime() -> str | None:
    """The node's OCI runtime for sandboxes that name none (``DSEC_RUNTIME``, e.g. ``runsc``)."""
    return os.environ.get("DSEC_RUNTIME", "").strip().lower() or None


@functools.lru_cache(maxsize=1)
def mem_total() -> int:
    """The host's RAM in bytes."""
    return meminfo("MemTotal").get("MemTotal", 1 << 30)


_NODE_NAME = re.compile(r"[a-z0-9]{1,16}")
_LABEL_KEY = re.compile(r"[A-Za-z0-9][A-Za-z0-9._/-]{0,62}")


def check_node_name(name: str) -> str:
    """``name`` if it can name a node (``[a-z0-9]{1,16}``: it ends every sandbox id the node
    makes, after a ``-``), else ``InvalidSpec``."""
    if not isinstance(name, str) or not _NODE_NAME.fullmatch(name):
        raise InvalidSpec(
            f"a node name is 1-16 lowercase letters and digits, got {name!r}",
            field="DSEC_NODE_NAME",
        )
    return name


def parse_labels(text: str, where: str) -> dict[str, str]:
    """``"k=v,k2=v2"`` -> ``{"k": "v", "k2": "v2"}``; keys ``[A-Za-z0-9][A-Za-z0-9._/-]*``,
    values anything without a comma."""
    out: dict[str, str] = {}
    for item in text.split(","):
        item = item.strip()
        if not item:
            continue
        key, eq, value = item.partition("=")
        key = key.strip()
        if not eq or not _LABEL_KEY.fullmatch(key):
            raise InvalidSpec(f"{where}: expected key=value pairs, got {item!r}", field=where)
        out[key] = value.strip()
    return out


def _positive_int(name: str) -> int:
    text = os.environ[name].strip()
    if not text.isdigit() or int(text) < 1:
        raise InvalidSpec(f"{name} must be a positive integer, got {text!r}", field=name)
    return int(text)


@dataclass(frozen=True)
class NodeConfig:
    """A node's paths and admission limits. ``overcommit`` multiplies CPU and memory capacity."""

    home: Path = field(default_factory=default_home)
    cpu_overcommit: float = 50.0  # sandboxes are idle most of the time (DSec: >50x)
    # The sum of sandboxes' memory limits may reach this many times the host's RAM: a backstop.
    # What admits a sandbox is the memory really in use: the host must keep ``memory_reserve``
    # bytes available beyond what the sandboxes being created will take, and memory pressure
    # (PSI "some" over the last 10 s, in %) must stay under ``memory_pressure_limit``.
    memory_overcommit: float = 32.0
    memory_reserve: int = field(default_factory=lambda: max(1 << 30, mem_total() // 20))
    memory_pressure_limit: float = 10.0
    max_sandboxes: int = 4096
    # The most sandboxes one create request may ask for; a bigger batch is refused before any
    # work (n=100000 once took a daemon to 400 MiB of pending creates).
    max_batch: int = 1024
    # Sandboxes starting at once (admitted, not yet running); more creates wait for a start slot
    # in the create queue's fair order: a burst then costs each create its turn, not a
    # thrashing host (verl caps its STARTING sandboxes at 128 for this).
    max_starting: int = field(default_factory=lambda: max(16, 2 * (os.cpu_count() or 1)))
    # Each sandbox gets a host uid range of its own, ``uid_size`` ids wide, from a pool of
    # ``uid_ranges`` ranges starting at ``uid_base`` (range k: uid_base + k * uid_size); root's
    # group inside is host gid ``uid_base`` in every sandbox (``sandbox_gid``).
    uid_base: int = 100000
    uid_size: int = 65536
    uid_ranges: int = 8192
    # Seconds a layer stays mounted after its last user leaves: bursts of the same
    # environment then pay for one mount, not one per sandbox.
    layer_linger: float = 10.0
    # Where layers come from, in order (URLs; see dsec_core.layers.source).
    layer_sources: tuple[str, ...] = ("local",)
    # Layers from sources that publish a lazy form are loaded on demand (chunks on first read)
    ondemand: bool = True
    chunk_cache_bytes: int = 10 << 30  # the node's shared chunk cache, LRU beyond this
    fetch_timeout: float = 10.0  # a chunk fetch slower than this fails the read with EIO
    # Record which pages of each on-demand blob are read, in order (``dsec catalog profile``)
    trace_reads: bool = False
    # Fetch the chunks a profiled layer's sandboxes read first as soon as it is mounted
    prefetch_hot: bool = True
    # Network listeners besides the unix socket (``http://127.0.0.1:8400``, ``https://...``);
    # every request on them must carry ``api_token``, and https needs ``tls_cert``/``tls_key``.
    listen: tuple[str, ...] = ()
    api_token: str | None = field(default=None, repr=False)
    tls_cert: Path | None = None
    tls_key: Path | None = None
    # The daemon's log rotates at this size (three old files are kept beside it)
    log_max_bytes: int = 10 << 20
    # The daemon runs in cgroups of its own (``daemon_cgroup``) with this memory limit, so
    # nothing a sandbox does can grow it without bound; 0 leaves it where it was started
    daemon_memory: int = 2 << 30
    # The filesystem of each sandbox's writable layer: "ext4", or "xfs" (with reflink; 300 MiB
    # at the least)
    disk_fs: str = "ext4"
    # Devices sandboxes may ask for (``SandboxSpec.devices``), by kind: host paths of char or
    # block device nodes (``DSEC_DEVICES="gpu=/dev/nvidia0,/dev/nvidia1;fpga=/dev/xdma0"``),
    # checked when the node opens. A device held "shared" takes at most ``device_share_cap``
    # sandboxes at once, or the kind's own cap (``DSEC_DEVICE_SHARE_CAP="4"``, ``"gpu:2"``,
    # ``"4,gpu:2"``).
    devices: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    device_share_cap: int = 4
    device_share_caps: Mapping[str, int] = field(default_factory=dict)
    # The OCI runtime of sandboxes whose spec names none (``SandboxSpec.runtime``): None is
    # the backend's own default (crun, else runc, for the container backend); "runsc" runs
    # them under gVisor (``DSEC_RUNTIME``).
    runtime: str | None = None
    # The node's name in a cluster (``DSEC_NODE_NAME``, ``[a-z0-9]{1,16}``). A named node makes
    # sandbox ids ``<12 hex>-<name>``, so a stateless apiserver routes an id to its node by the
    # part after the last ``-``; placement knows the node by it (else by its home).
    node_name: str | None = None
    # What placement may select the node by (``DSEC_NODE_LABELS="dsec.pool=overflow,zone=a"``):
    # ``NodeLoad.labels``. ``dsec.pool`` names the node's pool (home when absent).
    node_labels: Mapping[str, str] = field(default_factory=dict)

    @classmethod
    def from_env(cls) -> NodeConfig:
        kw: dict[str, Any] = {}
        if os.environ.get("DSEC_NODE_NAME", "").strip():
            kw["node_name"] = check_node_name(os.environ["DSEC_NODE_NAME"].strip())
        if os.environ.get("DSEC_NODE_LABELS", "").strip():
            kw["node_labels"] = parse_labels(os.environ["DSEC_NODE_LABELS"], "DSEC_NODE_LABELS")
        if "DSEC_CPU_OVERCOMMIT" in os.environ:
            kw["cpu_overcommit"] = float(os.environ["DSEC_CPU_OVERCOMMIT"])
        if "DSEC_MEMORY_OVERCOMMIT" in os.environ:
            kw["memory_overcommit"] = float(os.environ["DSEC_MEMORY_OVERCOMMIT"])
        if os.environ.get("DSEC_MEMORY_RESERVE"):
            kw["memory_reserve"] = parse_size(
                os.environ["DSEC_MEMORY_RESERVE"], "DSEC_MEMORY_RESERVE"
            )
        if os.environ.get("DSEC_MEMORY_PRESSURE_LIMIT"):
            kw["memory_pressure_limit"] = float(os.environ["DSEC_MEMORY_PRESSURE_LIMIT"])
        if "DSEC_MAX_SANDBOXES" in os.environ:
            kw["max_sandboxes"] = int(os.environ["DSEC_MAX_SANDBOXES"])
        if "DSEC_MAX_BATCH" in os.environ:
            kw["max_batch"] = _positive_int("DSEC_MAX_BATCH")
        if "DSEC_MAX_STARTING" in os.environ:
            kw["max_starting"] = _positive_int("DSEC_MAX_STARTING")
        if "DSEC_UID_BASE" in os.environ:
            kw["uid_base"] = _positive_int("DSEC_UID_BASE")
        if "DSEC_UID_SIZE" in os.environ:
            kw["uid_size"] = _positive_int("DSEC_UID_SIZE")
        if "DSEC_UID_RANGES" in os.environ:
            kw["uid_ranges"] = _positive_int("DSEC_UID_RANGES")
        if "DSEC_LAYER_LINGER" in os.environ:
            kw["layer_linger"] = float(os.environ["DSEC_LAYER_LINGER"])
        if "DSEC_ONDEMAND" in os.environ:
            kw["ondemand"] = os.environ["DSEC_ONDEMAND"] not in ("0", "false", "no", "")
        if "DSEC_PREFETCH_HOT" in os.environ:
            kw["prefetch_hot"] = os.environ["DSEC_PREFETCH_HOT"] not in ("0", "false", "no", "")
        if "DSEC_CHUNK_CACHE" in os.environ:
            kw["chunk_cache_bytes"] = parse_size(os.environ["DSEC_CHUNK_CACHE"], "DSEC_CHUNK_CACHE")
        if "DSEC_FETCH_TIMEOUT" in os.environ:
            kw["fetch_timeout"] = float(os.environ["DSEC_FETCH_TIMEOUT"])
        if os.environ.get("DSEC_LAYER_SOURCES"):
            kw["layer_sources"] = tuple(
                u.strip() for u in os.environ["DSEC_LAYER_SOURCES"].split(",") if u.strip()
            )
        if os.environ.get("DSEC_LISTEN"):
            kw["listen"] = tuple(
                a.strip() for a in os.environ["DSEC_LISTEN"].split(",") if a.strip()
            )
        if os.environ.get("DSEC_API_TOKEN"):
            kw["api_token"] = os.environ["DSEC_API_TOKEN"]
        if os.environ.get("DSEC_TLS_CERT"):
            kw["tls_cert"] = Path(os.environ["DSEC_TLS_CERT"])
        if os.environ.get("DSEC_TLS_KEY"):
            kw["tls_key"] = Path(os.environ["DSEC_TLS_KEY"])
        if os.environ.get("DSEC_LOG_MAX"):
            kw["log_max_bytes"] = parse_size(os.environ["DSEC_LOG_MAX"], "DSEC_LOG_MAX")
        if os.environ.get("DSEC_DISK_FS"):
            kw["disk_fs"] = os.environ["DSEC_DISK_FS"].strip().lower()
        if os.environ.get("DSEC_DAEMON_MEMORY"):
            kw["daemon_memory"] = parse_size(os.environ["DSEC_DAEMON_MEMORY"], "DSEC_DAEMON_MEMORY")
        if default_runtime():
            kw["runtime"] = default_runtime()
        if os.environ.get("DSEC_DEVICES"):
            kw["devices"] = parse_devices(os.environ["DSEC_DEVICES"])
        if os.environ.get("DSEC_DEVICE_SHARE_CAP"):
            caps = parse_share_caps(os.environ["DSEC_DEVICE_SHARE_CAP"])
            if None in caps:
                kw["device_share_cap"] = caps.pop(None)
            kw["device_share_caps"] = caps
        return cls(**kw)

    def share_cap(self, kind: str) -> int:
        """How many sandboxes may hold one device of ``kind`` shared at once."""
        return self.device_share_caps.get(kind, self.device_share_cap)

    # --- capacity -------------------------------------------------------------------------
    @property
    def cpu_capacity(self) -> float:
        return (os.cpu_count() or 1) * self.cpu_overcommit

    @property
    def memory_capacity(self) -> int:
        return int(mem_total() * self.memory_overcommit)

    @property
    def daemon_cgroup(self) -> str:
        """The daemon's cgroup, relative to each hierarchy's root: ``dsec-daemon/<12 hex of
        sha256(home)>``, one per node home, beside (never above) the sandboxes' ``dsec/``."""
        digest = hashlib.sha256(os.fsencode(os.path.abspath(self.home))).hexdigest()[:12]
        return f"dsec-daemon/{digest}"

    # --- paths ----------------------------------------------------------------------------
    @property
    def layer_dir(self) -> Path:
        """Content-addressed EROFS images and their name@version refs."""
        return self.home / "layers"

    @property
    def cache_dir(self) -> Path:
        """Images fetched from remote layer sources, by digest."""
        return self.home / "cache"

    @property
    def catalog_dir(self) -> Path:
        return self.home / "catalogs"

    @property
    def mount_dir(self) -> Path:
        """Shared, reference-counted mounts of layers (one per layer per node)."""
        return self.home / "mnt"

    @property
    def sandbox_dir(self) -> Path:
        """One directory per sandbox: the mount point of its writable layer's own filesystem
        (``upper/``, ``work/`` inside) for composed roots, or its disk file for image backends.
        Root only (mode 0700)."""
        return self.home / "sandboxes"

    @property
    def disk_dir(self) -> Path:
        """The sandboxes' writable-layer filesystem images (``<id>.img``, sparse) and the
        formatted templates they are cloned from (``templates/``). Root only (mode 0700)."""
        return self.home / "disks"

    @property
    def run_dir(self) -> Path:
        """Runtime state on a tmpfs the node mounts: daemon socket and pid file, runc state,
        and per sandbox its bundle (config.json, state.json, agent.sock, rootfs mount point).
        Kept off the disk because a create/kill cycle makes and removes a dozen inodes there;
        it survives daemon restarts (what re-adoption needs) but not reboots, which the
        sandboxes do not survive either."""
        return self.home / "run"

    @property
    def runtime_dir(self) -> Path:
        """Per-sandbox runtime directories, under ``run_dir``."""
        return self.run_dir / "sandboxes"

    @property
    def socket_path(self) -> Path:
        return self.run_dir / "dsecd.sock"

    @property
    def pid_file(self) -> Path:
        """Locked by the running daemon; holds its pid."""
        return self.run_dir / "dsecd.pid"

    @property
    def log_path(self) -> Path:
        """The daemon's log, rotated at ``log_max_bytes`` (``dsecd.log.1`` .. ``.3``)."""
        return self.home / "dsecd.log"

    @property
    def stderr_path(self) -> Path:
        """What the daemon printed outside its log (a crash); started afresh on each start."""
        return self.home / "dsecd.stderr"

    @property
    def bin_dir(self) -> Path:
        """Built helper binaries (the in-sandbox agent)."""
        return self.home / "bin"

    @property
    def sandbox_gid(self) -> int:
        """The host gid of root's group in every sandbox (``uid_base``): the one group, besides
        root, that may enter the directories on the way to a sandbox's root filesystem."""
        return self.uid_base

    def ensure_dirs(self) -> None:
        """Make the node's directories and give each the narrowest access that works.

        A sandbox's files must be out of every host user's reach: its writable layer could
        hold a setuid-root binary or anything it wants read, all owned by the sandbox's host
        uid. Yet runc's init runs as that unprivileged uid, inside the sandbox's user namespace
        where the host's root-owned directories grant it nothing, and must still walk to the
        sandbox's root filesystem (``run/sandboxes/<id>/rootfs``) and to the agent binary
        (``bin/``). So the directories on those paths (``$DSEC_HOME``, ``run/``,
        ``run/sandboxes/`` and each sandbox's directory there, ``bin/``) are mode 0710 with
        the sandboxes' host group (``sandbox_gid``): root and that group may enter them, nobody
        else may, and nobody but root may list them. Everything else is mode 0700: the
        overlay reads its layers and writable layer with the credentials of its mounter
        (root), so no sandbox process ever needs a path through ``mnt/``, ``sandboxes/`` or
        ``disks/``; layers, catalogs and caches are the daemon's (root's) business alone."""
        private = (
            self.layer_dir,
            self.catalog_dir,
            self.cache_dir,
            self.mount_dir,
            self.sandbox_dir,
            self.disk_dir,
        )
        for d in (*private, self.run_dir, self.bin_dir, self.runtime_dir):
            d.mkdir(parents=True, exist_ok=True)
        for d in (self.home, self.run_dir, self.runtime_dir, self.bin_dir):
            self.on_sandbox_path(d)
        for d in private:
            if d.stat().st_mode & 0o777 != 0o700:
                os.chmod(d, 0o700)
        for d in self.home.resolve().parents:
            st = d.stat()
            if not _enterable(st, self.uid_base, self.sandbox_gid):
                raise InvalidSpec(
                    f"DSEC_HOME {self.home} is inside {d}, which a sandbox's root (host uid "
                    f"{self.uid_base}, gid {self.sandbox_gid}) cannot enter (mode "
                    f"{st.st_mode & 0o777:o}, owner {st.st_uid}:{st.st_gid}); runc starts a "
                    "sandbox as that uid and must reach its root filesystem there. Use "
                    f"another DSEC_HOME, chmod o+x {d}, or give it group {self.sandbox_gid} "
                    "with g+x.",
                    path=str(d),
                )

    def on_sandbox_path(self, d: Path) -> None:
        """Mode 0710, owned by root and the sandboxes' host group: a directory runc's init
        must pass through on the way to a sandbox's root filesystem (see ``ensure_dirs``)."""
        st = d.stat()
        if st.st_uid != 0 or st.st_gid != self.sandbox_gid:
            os.chown(d, 0, self.sandbox_gid)
        if st.st_mode & 0o7777 != 0o710:
            os.chmod(d, 0o710)


def parse_devices(text: str) -> dict[str, tuple[str, ...]]:
    """``"gpu=/dev/a,/dev/b;fpga=/dev/c"`` -> ``{"gpu": ("/dev/a", "/dev/b"), "fpga": ...}``
    (kinds apart by ";", paths by ","; a kind given twice adds its paths)."""
    out: dict[str, list[str]] = {}
    for item in filter(None, (i.strip() for i in text.split(";"))):
        kind, sep, paths = item.partition("=")
        kind = kind.strip()
        found = [p.strip() for p in paths.split(",") if p.strip()]
        if not sep or not kind or not found or not all(p.startswith("/") for p in found):
            raise InvalidSpec(
                f"DSEC_DEVICES: expected KIND=/abs/path[,/abs/path...][;KIND=...], got {item!r}",
                field="DSEC_DEVICES",
            )
        out.setdefault(kind, []).extend(found)
    return {k: tuple(v) for k, v in out.items()}


def parse_share_caps(text: str) -> dict[str | None, int]:
    """``"4,gpu:2"`` -> ``{None: 4, "gpu": 2}`` (None: every kind not named)."""
    out: dict[str | None, int] = {}
    for item in filter(None, (i.strip() for i in text.split(","))):
        kind, sep, value = item.rpartition(":")
        if not value.strip().isdigit() or int(value) < 1 or (sep and not kind.strip()):
            raise InvalidSpec(
                f"DSEC_DEVICE_SHARE_CAP: expected N or KIND:N (N >= 1), comma-separated, "
                f"got {item!r}",
                field="DSEC_DEVICE_SHARE_CAP",
            )
        out[kind.strip() or None] = int(value)
    return out


def _enterable(st: os.stat_result, uid: int, gid: int) -> bool:
    """Whether a process with host ``uid``/``gid`` (and no capability over the directory) may
    enter a directory with this stat."""
    if st.st_uid == uid:
        return bool(st.st_mode & 0o100)
    if st.st_gid == gid:
        return bool(st.st_mode & 0o010)
    return bool(st.st_mode & 0o001)
