"""A VM guest's boot files: a Debian kernel fetched once into a cache (``ensure_kernel``), the
modules a guest needs with their dependencies (``module_closure``) and an initramfs holding
busybox, those modules and the caller's files (``build_initramfs``).

The kernel is Debian's own package, fetched with ``apt-get download`` and unpacked with
``dpkg-deb``: the host's apt configuration (mirror, proxy, pinning) applies, and nothing is
installed on the host. Of the package only ``boot/vmlinuz-*`` and ``lib/modules/<release>``
are kept.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import stat
import sys
import tempfile
import threading
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from ..errors import GuestImageError, InvalidSpec
from ..linux.tools import run_tool
from .cpio import CpioEntry, write_newc
from .elf import ElfError, ElfFile

__all__ = [
    "DEFAULT_KERNEL_PACKAGE",
    "GuestKernel",
    "build_initramfs",
    "ensure_kernel",
    "module_closure",
]

DEFAULT_KERNEL_PACKAGE = "linux-image-cloud-amd64"

#: Where the initramfs's busybox comes from: Debian's busybox-static (a dynamic busybox would
#: need a libc in the guest).
HOST_BUSYBOX = Path("/bin/busybox")

_MANIFEST = "kernel.json"
_PROGRESS_AFTER = 3.0  # seconds a download runs before we say on stderr what we wait for
_COMPRESSED_MODULE = (".ko.xz", ".ko.zst", ".ko.gz")
#: Directories every initramfs has: mount points for the init script and the new root.
_BASE_DIRS = ("bin", "dev", "lib", "lib/modules", "mnt", "newroot", "proc", "run", "sys")
_FORMAT = b"dsec initramfs 1\0"  # bump when the layout changes, so cached archives are not reused


@dataclass(frozen=True)
class GuestKernel:
    """A kernel unpacked in the cache: the ``package`` asked for (its name, also when a local
    ``.deb`` was given), its Debian ``version``, the ``release`` (``uname -r``), the
    ``vmlinuz`` to boot and ``modules_dir`` (``.../lib/modules/<release>``)."""

    package: str
    version: str
    release: str
    vmlinuz: Path
    modules_dir: Path


# ---- the kernel package ------------------------------------------------------------------------


def ensure_kernel(
    cache_dir: Path, package: str = DEFAULT_KERNEL_PACKAGE, version: str | None = None
) -> GuestKernel:
    """The kernel of Debian package ``package`` (a name, or the path of a local ``.deb``) at
    ``version``, fetched and unpacked into ``cache_dir/<package>_<version>/`` unless it is
    there already; a cached kernel needs no network.

    ``version=None`` means apt's candidate version (``apt-cache policy``, which reads only the
    local lists); where apt cannot tell, the kernel of that package cached last. A meta package
    (``linux-image-cloud-amd64``) is followed to the image package it depends on. Concurrent
    callers are safe: one fetches under a lock file while the others wait, then reuse it.
    Raises ``GuestImageError`` if apt cannot get the package or the version.
    """
    cache_dir.mkdir(parents=True, exist_ok=True)
    local = _local_deb(package)
    if local is not None:
        fields = _deb_fields(local)
        package, found = fields["Package"], fields["Version"]
        if version is not None and version != found:
            raise InvalidSpec(f"{local} is {package} {found}, not version {version}")
        version = found
    wanted = version or _remembered_candidate(cache_dir, package)
    if wanted and (kernel := _cached(cache_dir, package, wanted)):
        return kernel
    with _locked(cache_dir / ".lock"):
        if wanted and (kernel := _cached(cache_dir, package, wanted)):
            return kernel  # another caller fetched it while we waited for the lock
        try:
            return _fetch(cache_dir, package, version, local)
        except GuestImageError:
            # no candidate known and none fetched: apt is missing or offline
            latest = None if wanted else _latest_cached(cache_dir, package)
            if latest is None:
                raise
            return latest


def _local_deb(package: str) -> Path | None:
    if not (package.endswith(".deb") or os.sep in package):
        return None
    path = Path(package)
    if not path.is_file():
        raise GuestImageError(f"no such kernel package file: {path}", path=str(path))
    return path.resolve()


def _entry_dir(cache_dir: Path, package: str, version: str) -> Path:
    return cache_dir / f"{package}_{version}"


def _cached(cache_dir: Path, package: str, version: str) -> GuestKernel | None:
    entry = _entry_dir(cache_dir, package, version)
    try:
        manifest = json.loads((entry / _MANIFEST).read_text())
    except FileNotFoundError:
        return None
    release = manifest["release"]
    return GuestKernel(
        package=manifest["package"],
        version=manifest["version"],
        release=release,
        vmlinuz=entry / "boot" / f"vmlinuz-{release}",
        modules_dir=entry / "lib" / "modules" / release,
    )


def _latest_cached(cache_dir: Path, package: str) -> GuestKernel | None:
    """The kernel of ``package`` cached most recently, whatever its version."""
    manifests = sorted(
        cache_dir.glob(f"{package}_*/{_MANIFEST}"), key=lambda p: p.stat().st_mtime, reverse=True
    )
    for manifest in manifests:
        version = json.loads(manifest.read_text())["version"]
        if manifest.parent.name == f"{package}_{version}":
            return _cached(cache_dir, package, version)
    return None


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _run(argv: list[str], what: str, cwd: Path | None = None) -> str:
    """Run a packaging program; its failure becomes ``GuestImageError`` with its output."""
    return run_tool(argv, what, cwd=cwd, error=GuestImageError).stdout


#: What apt's candidate version of a package depends on: its lists (``apt-get update`` renames
#: new ones into the directory), its configuration (sources, pinning) and what is installed.
APT_STATE = (
    Path("/var/lib/apt/lists"),
    Path("/etc/apt/sources.list"),
    Path("/etc/apt/sources.list.d"),
    Path("/etc/apt/preferences"),
    Path("/etc/apt/preferences.d"),
    Path("/etc/apt/apt.conf.d"),
    Path("/var/lib/dpkg/status"),
)
_CANDIDATES = "candidates.json"


def _apt_stamp() -> list[list[object]]:
    """Each of ``APT_STATE``'s modification time and size (absent: none): what changes
    whenever apt's answer may."""
    stamp: list[list[object]] = []
    for path in APT_STATE:
        try:
            st = path.stat()
        except OSError:
            stamp.append([os.fspath(path)])
            continue
        stamp.append([os.fspath(path), st.st_mtime_ns, st.st_size])
    return stamp


def _remembered_candidate(cache_dir: Path, package: str) -> str | None:
    """``_candidate_version(package)``, remembered in ``cache_dir`` for as long as apt's lists,
    configuration and installed packages stay as they were: ``apt-cache policy`` takes a
    second or more on a loaded machine, and every fresh node asked it again before its first
    VM."""
    memo = cache_dir / _CANDIDATES
    stamp = _apt_stamp()
    try:
        known = json.loads(memo.read_text())
    except (OSError, ValueError):
        known = {}
    if not isinstance(known, dict):
        known = {}
    entry = known.get(package)
    if isinstance(entry, dict) and entry.get("apt") == stamp and entry.get("version"):
        return str(entry["version"])
    version = _candidate_version(package)
    if version is None:
        return None
    known[package] = {"apt": stamp, "version": version}
    fd, tmp = tempfile.mkstemp(dir=cache_dir, prefix=f".{_CANDIDATES}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(known, f)
        os.rename(tmp, memo)
    except OSError:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
    return version


def _candidate_version(package: str) -> str | None:
    """apt's candidate version of ``package`` from the local lists; None where apt cannot tell
    (no apt, no lists yet, unknown package)."""
    try:
        out = _run(["apt-cache", "policy", package], "apt-cache policy")
    except GuestImageError:
        return None
    for line in out.splitlines():
        key, _, value = line.strip().partition(":")
        if key == "Candidate" and value.strip() not in ("", "(none)"):
            return value.strip()
    return None


def _deb_fields(deb: Path) -> dict[str, str]:
    """A package's control fields (all of them: ``dpkg-deb -f`` given one field name prints
    its bare value, with no name to parse); continuation lines are joined."""
    out = _run(["dpkg-deb", "-f", str(deb)], f"reading {deb.name}")
    fields: dict[str, str] = {}
    key = ""
    for line in out.splitlines():
        if line[:1] in (" ", "\t") and key:
            fields[key] += " " + line.strip()
        else:
            key, _, value = line.partition(":")
            fields[key] = value.strip()
    return fields


def _apt_download(spec: str, workdir: Path) -> Path:
    """``apt-get download spec`` into ``workdir``; the downloaded ``.deb``. Runs ``apt-get
    update`` once and tries again if the first attempt fails (no lists yet, or stale ones)."""
    argv = ["apt-get", "download", "-o", "APT::Sandbox::User=root", spec]
    before = set(workdir.glob("*.deb"))
    try:
        with _slow_notice(f"fetching {spec} with apt-get"):
            try:
                _run(argv, f"apt-get download {spec}", cwd=workdir)
            except GuestImageError as e:
                if e.exit_code is None:
                    raise
                _run(["apt-get", "update"], "apt-get update")
                _run(argv, f"apt-get download {spec}", cwd=workdir)
    except GuestImageError as e:
        if e.exit_code is None:
            raise  # apt-get is not installed: that says it better
        raise GuestImageError(
            f"apt cannot get kernel package {spec}",
            command=e.command,
            exit_code=e.exit_code,
            stderr=e.stderr,
            package=spec,
        ) from e
    (deb,) = set(workdir.glob("*.deb")) - before
    return deb


@contextlib.contextmanager
def _slow_notice(message: str) -> Iterator[None]:
    """Say ``message`` on stderr if the block takes longer than a few seconds; quiet otherwise."""
    timer = threading.Timer(_PROGRESS_AFTER, lambda: print(f"{message} ...", file=sys.stderr))
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        timer.cancel()


def _image_dependency(deb: Path) -> str:
    """The ``apt-get download`` spec of the image package a meta package depends on:
    ``linux-image-<release>[=<version>]``."""
    depends = _deb_fields(deb).get("Depends", "")
    for clause in depends.split(","):
        for alternative in clause.split("|"):
            name, _, relation = alternative.strip().partition(" ")
            if name.startswith("linux-image-"):
                op, _, ver = relation.strip("() ").partition(" ")
                return f"{name}={ver.strip()}" if op == "=" else name
    raise GuestImageError(
        f"{deb.name} has no kernel image and depends on no linux-image package "
        f"(Depends: {depends or 'nothing'})",
        package=deb.name,
    )


def _fetch(cache_dir: Path, package: str, version: str | None, local: Path | None) -> GuestKernel:
    """Download (unless ``local``), unpack and cache; the caller holds the cache lock."""
    with tempfile.TemporaryDirectory(dir=cache_dir, prefix=".fetch-") as tmp:
        work = Path(tmp)
        deb = local or _apt_download(f"{package}={version}" if version else package, work)
        fields = _deb_fields(deb)
        version = fields["Version"]
        if kernel := _cached(cache_dir, package, version):
            return kernel  # the candidate was unknown to apt-cache but is cached
        unpacked = work / "deb"
        for _ in range(3):  # a meta package, perhaps a meta of a meta, then the image
            _run(["dpkg-deb", "-x", str(deb), str(unpacked)], f"unpacking {deb.name}")
            if list((unpacked / "boot").glob("vmlinuz-*")):
                break
            deb = _apt_download(_image_dependency(deb), work)
        else:
            raise GuestImageError(f"{package} {version} leads to no kernel image", package=package)
        entry = _keep_kernel(unpacked, work / "entry", package, version)
        final = _entry_dir(cache_dir, package, version)
        os.rename(entry, final)
    kernel = _cached(cache_dir, package, version)
    assert kernel is not None
    return kernel


def _keep_kernel(unpacked: Path, entry: Path, package: str, version: str) -> Path:
    """Move the vmlinuz and its modules from an unpacked image package into ``entry`` and write
    the manifest; everything else of the package is left behind."""
    (vmlinuz,) = (unpacked / "boot").glob("vmlinuz-*")
    release = vmlinuz.name.removeprefix("vmlinuz-")
    modules = next(
        (
            d / release
            for d in (unpacked / "lib" / "modules", unpacked / "usr" / "lib" / "modules")
            if (d / release).is_dir()
        ),
        None,
    )
    if modules is None:
        raise GuestImageError(f"{package} {version} has no lib/modules/{release}", package=package)
    (entry / "boot").mkdir(parents=True)
    (entry / "lib" / "modules").mkdir(parents=True)
    os.rename(vmlinuz, entry / "boot" / vmlinuz.name)
    os.rename(modules, entry / "lib" / "modules" / release)
    manifest = {"package": package, "version": version, "release": release}
    (entry / _MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
    return entry


# ---- kernel modules ----------------------------------------------------------------------------


def _module_name(name: str) -> str:
    return name.replace("-", "_")


def _module_index(kernel: GuestKernel) -> dict[str, Path]:
    """Every loadable module of the kernel by normalised name (``virtio-rng`` -> ``virtio_rng``)."""
    index = {}
    for path in kernel.modules_dir.rglob("*.ko*"):  # kernel/, and updates/ or extra/ if any
        base = path.name.split(".ko")[0]
        index[_module_name(base)] = path
    return index


def _builtin_modules(kernel: GuestKernel) -> set[str]:
    """Modules compiled into the kernel (``modules.builtin``): nothing to load for them."""
    try:
        lines = (kernel.modules_dir / "modules.builtin").read_text().split()
    except FileNotFoundError:
        return set()
    return {_module_name(PurePosixPath(line).name.split(".ko")[0]) for line in lines}


def _read_module(name: str, path: Path) -> ElfFile:
    if path.name.endswith(_COMPRESSED_MODULE):
        raise GuestImageError(
            f"kernel module {name} is compressed ({path.name}); compressed modules (as Debian 13 "
            "ships them) are not supported yet: use a kernel with plain .ko modules (Debian 12)",
            module=name,
            path=str(path),
        )
    try:
        return ElfFile(path.read_bytes())
    except ElfError as e:
        raise GuestImageError(f"kernel module {name} ({path}): {e}", module=name) from e


def module_closure(kernel: GuestKernel, names: Iterable[str]) -> list[str]:
    """``names`` and every module they depend on, each once, dependencies before the modules
    that need them: the order to ``insmod`` them in. Dependencies are read from each module's
    ``.modinfo`` (``depends=``), not from ``modules.dep``, which ``depmod`` writes only when the
    package is installed. Dashes and underscores are the same (``virtio-rng`` is
    ``virtio_rng``); a module built into the kernel is left out, as there is nothing to load.
    An unknown module is a ``GuestImageError`` naming it."""
    index = _module_index(kernel)
    builtin = _builtin_modules(kernel)
    order: list[str] = []
    state: dict[str, str] = {}  # "visiting" while its dependencies are walked, then "done"

    def visit(name: str, wanted_by: str | None) -> None:
        if state.get(name) == "done" or name in builtin:
            return
        if state.get(name) == "visiting":
            raise GuestImageError(f"kernel modules depend on each other in a cycle at {name}")
        if name not in index:
            by = f" (a dependency of {wanted_by})" if wanted_by else ""
            raise GuestImageError(
                f"no kernel module {name}{by} in {kernel.package} {kernel.version} "
                f"({kernel.release})",
                module=name,
            )
        state[name] = "visiting"
        info = _read_module(name, index[name]).modinfo()
        for dep in info.get("depends", []):
            for dep_name in filter(None, dep.split(",")):
                visit(_module_name(dep_name.strip()), name)
        for soft in _soft_pre(info.get("softdep", []), index, builtin):
            visit(soft, name)
        state[name] = "done"
        order.append(name)

    for name in names:
        visit(_module_name(name), None)
    return order


def _soft_pre(softdeps: Iterable[str], index: Mapping[str, Path], builtin: set[str]) -> list[str]:
    """The modules a module's ``softdep=pre: ...`` asks for first, where one can be named
    without modprobe's alias table: the module of that name, else its ``_generic`` one
    (``libcrc32c`` wants ``crc32c``: ``crc32c_generic``, which any CPU runs; without it the
    generic kernel's libcrc32c fails to load). The rest are left out: soft dependencies are
    optional."""
    found = []
    for line in softdeps:
        pre = line.split("post:")[0].split("pre:")[1:] if "pre:" in line else []
        for word in " ".join(pre).split():
            for candidate in (_module_name(word), _module_name(word) + "_generic"):
                if candidate in index or candidate in builtin:
                    found.append(candidate)
                    break
    return found


# ---- the initramfs -----------------------------------------------------------------------------


def _host_busybox() -> bytes:
    try:
        data = HOST_BUSYBOX.read_bytes()
    except FileNotFoundError as e:
        raise GuestImageError(
            f"{HOST_BUSYBOX} is missing: install busybox-static", path=str(HOST_BUSYBOX)
        ) from e
    if ElfFile(data).is_dynamic():
        raise GuestImageError(
            f"{HOST_BUSYBOX} is linked dynamically and would not run in the initramfs: "
            "install busybox-static",
            path=str(HOST_BUSYBOX),
        )
    return data


def _file_entry(guest_path: str, source: Path | bytes) -> CpioEntry:
    """A caller's file: bytes are 0755 if they start with ``#!``, else 0644; a host file keeps
    its permission bits (its owner does not matter: the archive's files are root's)."""
    if isinstance(source, bytes):
        return CpioEntry.file(guest_path, source, 0o755 if source.startswith(b"#!") else 0o644)
    try:
        st = os.stat(source)
        data = Path(source).read_bytes()
    except OSError as e:
        raise GuestImageError(f"cannot read {source} for {guest_path}: {e}") from e
    if not stat.S_ISREG(st.st_mode):
        raise GuestImageError(f"{source} for {guest_path} is not a regular file")
    return CpioEntry.file(guest_path, data, stat.S_IMODE(st.st_mode))


def _guest_path(path: str) -> str:
    """``/etc/x`` -> ``etc/x``; a path that is not absolute or climbs out is an ``InvalidSpec``."""
    pure = PurePosixPath(path)
    if not pure.is_absolute() or ".." in pure.parts or len(pure.parts) < 2:
        raise InvalidSpec(f"initramfs path {path!r} must be absolute, below /, without '..'")
    return str(pure.relative_to("/"))


def _entries(
    kernel: GuestKernel | None, modules: Iterable[str], files: Mapping[str, Path | bytes]
) -> list[CpioEntry]:
    """Every archive member, parents first; a caller's file replaces ours at the same path."""
    modules = list(modules)
    if modules and kernel is None:
        raise InvalidSpec(f"modules {', '.join(modules)} asked for without a kernel")
    members: dict[str, CpioEntry] = {d: CpioEntry.directory(d) for d in _BASE_DIRS}
    members["dev/console"] = CpioEntry.char_device("dev/console", 5, 1)
    members["bin/busybox"] = CpioEntry.file("bin/busybox", _host_busybox(), 0o755)
    members["bin/sh"] = CpioEntry.symlink("bin/sh", "busybox")
    if kernel is not None:
        order = module_closure(kernel, modules)
        index = _module_index(kernel)
        for name in order:
            data = index[name].read_bytes()
            members[f"lib/modules/{name}.ko"] = CpioEntry.file(f"lib/modules/{name}.ko", data)
        listing = "".join(f"{name}\n" for name in order).encode()
        members["lib/modules/order"] = CpioEntry.file("lib/modules/order", listing)
    for guest_path, source in files.items():
        rel = _guest_path(guest_path)
        for parent in reversed(PurePosixPath(rel).parents[:-1]):
            members.setdefault(str(parent), CpioEntry.directory(str(parent)))
        members[rel] = _file_entry(rel, source)
    return [members[path] for path in sorted(members)]


def _digest(entries: list[CpioEntry]) -> str:
    h = hashlib.sha256(_FORMAT)
    for e in entries:
        head = f"{e.path}\0{e.mode:o}\0{e.rdev[0]}:{e.rdev[1]}\0{len(e.data)}\0"
        h.update(head.encode())
        h.update(e.data)
    return h.hexdigest()[:32]


def build_initramfs(
    out_dir: Path,
    kernel: GuestKernel | None,
    modules: Iterable[str],
    files: Mapping[str, Path | bytes],
) -> Path:
    """An uncompressed newc initramfs, ``out_dir/initramfs-<digest>.cpio``, reused if built
    before from the same inputs (the digest covers every member's path, mode and bytes).

    It holds ``/bin/busybox`` (the host's busybox-static) and ``/bin/sh`` linked to it; the
    directories ``/dev`` (with ``console``), ``/proc``, ``/sys``, ``/mnt``, ``/run`` and
    ``/newroot``; ``module_closure(kernel, modules)`` as ``/lib/modules/<name>.ko`` with
    ``/lib/modules/order`` naming them one a line in load order; and ``files`` (guest absolute
    path -> host file or bytes), parent directories made as needed. Applets are called as
    ``/bin/busybox <applet>``: no applet links are made. ``kernel`` may be None only with no
    modules.
    """
    entries = _entries(kernel, modules, files)
    out = out_dir / f"initramfs-{_digest(entries)}.cpio"
    if out.exists():
        return out
    out_dir.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=out_dir, prefix=f".{out.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            write_newc(f, entries)
        os.chmod(tmp, 0o644)
        os.rename(tmp, out)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    return out
