"""Layer recipes: how a catalog says what goes into a layer, and the code that builds one.

A recipe's ``source`` combines at most one root filesystem (``debootstrap``, ``tar`` or
``docker``) with an optional ``dir`` copied in at ``to`` and an optional ``pip`` install of
pure-Python packages for the base image's Debian python3. Recipes made only of ``dir`` and
``pip`` are owned by root and stamped with one fixed mtime, so they rebuild to the same digest;
their Python modules are compiled (hash-based ``.pyc``, see ``compile_python``) so a sandbox
never compiles them into its writable layer.

Each built layer records its recipe's fingerprint (``recipe_fingerprint``): a recipe whose
inputs changed while its ``name@version`` stayed is ``LayerStale``. Every root filesystem a
recipe builds gets apt and pip pointed at placeholders (``APT_PLACEHOLDER``,
``PIP_PLACEHOLDER``) that fail fast and say why; a build policy grants a real mirror with
``mirror_env`` and ``mirror_files``.
"""

from __future__ import annotations

import configparser
import hashlib
import json
import os
import re
import shutil
import stat
import subprocess
import sys
import urllib.parse
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import InvalidSpec, LayerBuildError, LayerExists, LayerStale, ToolError
from ..linux.tools import run_tool
from ..records import LayerInfo
from .build import build_tree, export_docker_image, extract_tar
from .store import LayerStore, Progress, check_kind

__all__ = [
    "APT_PLACEHOLDER",
    "PIP_PLACEHOLDER",
    "RECIPE_EPOCH",
    "Debootstrap",
    "LayerRecipe",
    "PipInstall",
    "build_dir_at",
    "build_recipe",
    "compile_python",
    "debian_mirror",
    "mirror_env",
    "mirror_files",
    "offline_files",
    "recipe_fingerprint",
]

# 1980-01-01: the reproducible-builds habit (zip and wheels cannot go earlier).
RECIPE_EPOCH = 315532800
DEFAULT_DEBIAN_MIRROR = "http://deb.debian.org/debian"

#: Where a dsec-built base's apt and pip look for packages until a build policy grants a
#: mirror: names under ``.invalid`` (RFC 2606) never resolve, so both fail at once, and the
#: name says why. ``offline_files`` is what a base ships; ``mirror_files``/``mirror_env``
#: what a granted mirror replaces it with.
APT_PLACEHOLDER = "http://apt-mirror.dsec-no-network.invalid/debian"
PIP_PLACEHOLDER = "http://pip-index.dsec-no-network.invalid/simple/"

_OFFLINE_NOTE = """\
dsec: sandboxes reach no package mirror unless a build policy grants one (the builder then
points this file at the granted mirror). This placeholder never resolves, so installs fail
at once instead of hanging."""


def _comment(text: str, mark: str = "#") -> str:
    return "".join(f"{mark} {line}\n" for line in text.splitlines())


_APT_CONF = (
    _comment(_OFFLINE_NOTE, "//")
    + """// `apt-get update` exits non-zero when a source fails (apt's default: a warning, 0).
APT::Update::Error-Mode "any";
Acquire::Retries "0";
Acquire::http::Timeout "5";
Acquire::https::Timeout "5";
"""
)


def offline_files(suite: str = "bookworm", components: Iterable[str] = ("main",)) -> dict[str, str]:
    """The apt and pip configuration a dsec-built base ships (path inside the image ->
    text): sources and index at the placeholders, no retries, short timeouts, and
    ``apt-get update`` exiting non-zero on a failed source. A builder restores these before
    packing what it built with a granted mirror."""
    return {
        "/etc/apt/sources.list": (
            _comment(_OFFLINE_NOTE) + f"deb {APT_PLACEHOLDER} {suite} {' '.join(components)}\n"
        ),
        "/etc/apt/apt.conf.d/99dsec-offline": _APT_CONF,
        "/etc/pip.conf": (
            _comment(_OFFLINE_NOTE) + f"[global]\nindex-url = {PIP_PLACEHOLDER}\n"
            "retries = 0\ntimeout = 5\n"
        ),
    }


def mirror_files(
    apt_mirror: str, suite: str = "bookworm", components: Iterable[str] = ("main",)
) -> dict[str, str]:
    """The apt sources (path inside the image -> text) that grant ``apt_mirror`` to a
    sandbox whose policy lets it reach that mirror; ``offline_files`` undoes it."""
    _check_url(apt_mirror, "apt_mirror")
    return {
        "/etc/apt/sources.list": (
            f"# dsec: a mirror granted by a build policy\n"
            f"deb {apt_mirror} {suite} {' '.join(components)}\n"
        )
    }


def mirror_env(pip_index: str | None = None, apt_mirror: str | None = None) -> dict[str, str]:
    """Environment variables that point a sandbox's pip (and, as ``DSEC_APT_MIRROR``, tells
    a builder which apt mirror ``mirror_files`` should write) at mirrors a build policy
    grants; they win over ``/etc/pip.conf``'s placeholder. An http index is trusted by host
    (no TLS to check)."""
    env: dict[str, str] = {}
    if pip_index is not None:
        url = _check_url(pip_index, "pip_index")
        env["PIP_INDEX_URL"] = pip_index
        env["PIP_RETRIES"] = "2"
        env["PIP_TIMEOUT"] = "30"
        if url.scheme == "http" and url.hostname:
            env["PIP_TRUSTED_HOST"] = url.hostname
    if apt_mirror is not None:
        _check_url(apt_mirror, "apt_mirror")
        env["DSEC_APT_MIRROR"] = apt_mirror
    return env


def _check_url(text: str, field: str) -> urllib.parse.SplitResult:
    url = urllib.parse.urlsplit(text)
    if url.scheme not in ("http", "https") or not url.hostname:
        raise InvalidSpec(f"{field}: expected an http(s) URL, got {text!r}", field=field)
    return url


def _write_offline_config(root: Path, spec: Debootstrap) -> None:
    sources_d = root / "etc/apt/sources.list.d"
    for path in [*sources_d.glob("*.list"), *sources_d.glob("*.sources")]:
        path.unlink()
    for name, text in offline_files(spec.suite, spec.components).items():
        path = _inside_layer(root, name)
        _make_dirs(path.parent)
        path.write_text(text)
        path.chmod(0o644)


@dataclass(frozen=True)
class Debootstrap:
    """A Debian root filesystem made by debootstrap."""

    suite: str = "bookworm"
    variant: str = "minbase"
    include: tuple[str, ...] = ()
    components: tuple[str, ...] = ("main",)
    mirror: str | None = None  # None: the machine's apt sources, or DSEC_DEBIAN_MIRROR

    def __post_init__(self) -> None:
        object.__setattr__(self, "include", tuple(self.include))
        object.__setattr__(self, "components", tuple(self.components))


@dataclass(frozen=True)
class PipInstall:
    """Pure-Python wheels installed for the image's ``/usr/bin/python3`` (never the host's)."""

    packages: tuple[str, ...]
    python: str = "3.11"

    def __post_init__(self) -> None:
        object.__setattr__(self, "packages", tuple(self.packages))


@dataclass(frozen=True)
class LayerRecipe:
    """One catalog layer: ``name@version`` of ``kind``, built from its source parts.

    ``root`` is the directory that relative ``dir`` and ``tar`` paths start from (the
    catalog file's directory).
    """

    name: str
    version: str
    kind: str
    dir: str | None = None
    to: str = "/"
    tar: str | None = None
    docker: str | None = None
    debootstrap: Debootstrap | None = None
    pip: PipInstall | None = None
    root: str = "."
    description: str = ""

    def __post_init__(self) -> None:
        check_kind(self.kind)
        bases = [k for k in ("debootstrap", "tar", "docker") if getattr(self, k) is not None]
        if len(bases) > 1:
            raise InvalidSpec(f"layer {self.ref}: choose one of {' / '.join(bases)}", ref=self.ref)
        if not bases and self.dir is None and self.pip is None:
            raise InvalidSpec(f"layer {self.ref}: empty source", ref=self.ref)

    @property
    def ref(self) -> str:
        return f"{self.name}@{self.version}"

    @property
    def dir_path(self) -> Path | None:
        return None if self.dir is None else Path(self.root, self.dir)

    @property
    def tar_path(self) -> Path | None:
        return None if self.tar is None else Path(self.root, self.tar)

    @classmethod
    def from_source(
        cls,
        name: str,
        version: str,
        kind: str,
        source: Mapping[str, Any],
        root: str | Path = ".",
        description: str = "",
    ) -> LayerRecipe:
        """Read the ``source`` mapping of a catalog entry (already schema-checked)."""
        deb = source.get("debootstrap")
        pip = source.get("pip")
        return cls(
            name=name,
            version=str(version),
            kind=kind,
            dir=source.get("dir"),
            to=source.get("to", "/"),
            tar=source.get("tar"),
            docker=source.get("docker"),
            debootstrap=None if deb is None else Debootstrap(**deb),
            pip=None if pip is None else PipInstall(**pip),
            root=str(root),
            description=description,
        )

    def describe(self) -> str:
        """A short human description of the source, kept in ``LayerInfo.source``."""
        parts = []
        if self.debootstrap:
            d = self.debootstrap
            parts.append(
                f"debootstrap {d.suite}/{d.variant}"
                + (f" +{','.join(d.include)}" if d.include else "")
            )
        if self.tar:
            parts.append(f"tar {self.tar}")
        if self.docker:
            parts.append(f"docker:{self.docker}")
        if self.dir:
            parts.append(f"dir {self.dir}" + (f" -> {self.to}" if self.to != "/" else ""))
        if self.pip:
            parts.append(f"pip {' '.join(self.pip.packages)}")
        return "; ".join(parts)


# --- debootstrap ---------------------------------------------------------------------------


def _deb822(text: str) -> Iterable[dict[str, str]]:
    stanza: dict[str, str] = {}
    key = None
    for line in text.splitlines():
        if line.startswith("#"):
            continue
        if not line.strip():
            if stanza:
                yield stanza
            stanza, key = {}, None
        elif line[0] in " \t" and key:
            stanza[key] += " " + line.strip()
        elif ":" in line:
            key, _, value = line.partition(":")
            key = key.strip().lower()
            stanza[key] = value.strip()
    if stanza:
        yield stanza


def _apt_sources(apt_dir: Path) -> list[tuple[str, list[str]]]:
    """(uri, suites) of every enabled ``deb`` source, in apt's reading order."""
    found: list[tuple[str, list[str]]] = []
    one_line = [apt_dir / "sources.list", *sorted((apt_dir / "sources.list.d").glob("*.list"))]
    for path in one_line:
        if not path.is_file():
            continue
        for text in path.read_text(errors="replace").splitlines():
            words = re.sub(r"\[[^\]]*\]", " ", text.split("#", 1)[0]).split()
            if len(words) >= 3 and words[0] == "deb":
                found.append((words[1], [words[2]]))
    for path in sorted((apt_dir / "sources.list.d").glob("*.sources")):
        for stanza in _deb822(path.read_text(errors="replace")):
            if stanza.get("enabled", "yes").lower() == "no":
                continue
            if "deb" not in stanza.get("types", "").split():
                continue
            for uri in stanza.get("uris", "").split():
                found.append((uri, stanza.get("suites", "").split()))
    return found


def debian_mirror(apt_dir: Path = Path("/etc/apt")) -> str:
    """The main Debian archive this machine uses: ``DSEC_DEBIAN_MIRROR``, else apt's sources.

    The main archive is a ``deb`` source with a plain release suite (``bookworm``, not
    ``bookworm-security`` or ``-updates``) that is not a security archive; a URI ending in
    ``/debian`` wins a tie. Falls back to deb.debian.org.
    """
    if os.environ.get("DSEC_DEBIAN_MIRROR"):
        return os.environ["DSEC_DEBIAN_MIRROR"]
    candidates = [
        (0 if uri.rstrip("/").endswith("/debian") else 1, rank, uri)
        for rank, (uri, suites) in enumerate(_apt_sources(apt_dir))
        if "security" not in uri and any("-" not in s and "/" not in s for s in suites)
    ]
    return min(candidates)[2] if candidates else DEFAULT_DEBIAN_MIRROR


def _debootstrap(spec: Debootstrap, target: Path, progress: Progress) -> None:
    mirror = spec.mirror or debian_mirror()
    cmd = ["debootstrap", f"--variant={spec.variant}", f"--components={','.join(spec.components)}"]
    if spec.include:
        cmd.append(f"--include={','.join(spec.include)}")
    cmd += [spec.suite, str(target), mirror]
    env = dict(
        os.environ,
        DEBIAN_FRONTEND="noninteractive",
        PATH="/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
    )
    progress("debootstrap", None)
    try:
        run_tool(cmd, f"debootstrap {spec.suite} from {mirror}", env=env, timeout=3600)
    except ToolError as e:
        # debootstrap says little on stderr; its log in the target says why.
        log = target / "debootstrap" / "debootstrap.log"
        if not log.is_file():
            raise
        raise ToolError(
            f"debootstrap {spec.suite} from {mirror} failed",
            command=e.command,
            exit_code=e.exit_code,
            stdout=e.stdout,
            stderr=(e.stderr + "\n" + log.read_text(errors="replace")[-3000:]),
        ) from e
    _slim_rootfs(target)
    _write_offline_config(target, spec)
    progress("debootstrap", 1.0)


def _empty_dir(path: Path) -> None:
    if path.is_dir():
        for child in path.iterdir():
            if child.is_dir() and not child.is_symlink():
                shutil.rmtree(child)
            else:
                child.unlink()


def _slim_rootfs(root: Path) -> None:
    """Drop what a sandbox never needs and what leaks the build host."""
    _empty_dir(root / "var/lib/apt/lists")
    for path in (root / "var/cache/apt/archives").glob("*.deb"):
        path.unlink()
    for path in (root / "var/cache/apt").glob("*.bin"):
        path.unlink()
    for path in (root / "var/cache/debconf").glob("*-old"):
        path.unlink()
    # debootstrap copies these from the host; the sandbox runtime provides its own.
    for name, text in (("etc/resolv.conf", ""), ("etc/hostname", "sandbox\n")):
        path = root / name
        if path.is_symlink() or path.exists():
            path.unlink()
        path.write_text(text)


# --- dir and pip ---------------------------------------------------------------------------


def _inside_layer(root: Path, to: str) -> Path:
    rel = Path(to.lstrip("/"))
    if ".." in rel.parts:
        raise InvalidSpec(f"layer path {to!r} must not contain '..'", path=to)
    return root / rel


def _make_dirs(path: Path) -> None:
    missing = []
    while not path.exists():
        missing.append(path)
        path = path.parent
    for d in reversed(missing):
        d.mkdir()
        d.chmod(0o755)  # not whatever the builder's umask says


def _copy_dir(src: Path, dest: Path) -> None:
    if not src.is_dir():
        raise LayerBuildError(f"recipe directory {src} does not exist", path=str(src))
    _make_dirs(dest)
    # a developer's own bytecode caches are not recipe inputs (compile_python makes the
    # layer's own)
    shutil.copytree(
        src,
        dest,
        symlinks=True,
        dirs_exist_ok=True,
        ignore=shutil.ignore_patterns("__pycache__"),
    )
    for dirpath, dirnames, filenames in os.walk(dest):
        for name in [*dirnames, *filenames]:
            os.lchown(os.path.join(dirpath, name), 0, 0)


_SCRIPT = """#!/usr/bin/python3
import re
import sys
from {module} import {attr}
if __name__ == "__main__":
    sys.argv[0] = re.sub(r"(-script\\.pyw|\\.exe)?$", "", sys.argv[0])
    sys.exit({call}())
"""


def _console_scripts(site: Path) -> dict[str, str]:
    scripts: dict[str, str] = {}
    for entry_points in sorted(site.glob("*.dist-info/entry_points.txt")):
        parser = configparser.ConfigParser(delimiters=("=",), interpolation=None)
        parser.optionxform = str  # type: ignore[assignment,method-assign]
        parser.read(entry_points)
        if parser.has_section("console_scripts"):
            scripts.update(parser["console_scripts"])
    return scripts


def _pip_install(spec: PipInstall, root: Path, progress: Progress) -> None:
    site = root / f"usr/local/lib/python{spec.python}/dist-packages"
    progress("pip install", None)
    _make_dirs(site)
    run_tool(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--target",
            str(site),
            "--no-compile",
            "--disable-pip-version-check",
            "--no-warn-script-location",
            "--only-binary=:all:",
            "--python-version",
            spec.python,
            "--implementation",
            "py",
            "--abi",
            "none",
            "--platform",
            "any",
            *spec.packages,
        ],
        f"pip install {' '.join(spec.packages)}",
        timeout=1800,
    )
    # pip's scripts name the host's python; write our own for the image's python3.
    shutil.rmtree(site / "bin", ignore_errors=True)
    bin_dir = root / "usr/local/bin"
    _make_dirs(bin_dir)
    for name, target in _console_scripts(site).items():
        module, _, call = target.partition(":")
        call = call.split("[")[0].strip()
        attr = call.split(".")[0]
        path = bin_dir / name
        path.write_text(_SCRIPT.format(module=module.strip(), attr=attr, call=call))
        path.chmod(0o755)
    progress("pip install", 1.0)


# --- compiled Python -----------------------------------------------------------------------


def _host_python(version: str) -> str | None:
    """A python of ``version`` (``"3.11"``) on this host: it writes the same bytecode as the
    image's python of that version (the magic number is per minor version)."""
    if f"{sys.version_info.major}.{sys.version_info.minor}" == version:
        return sys.executable
    return shutil.which(f"python{version}")


def compile_python(tree: Path, python: str, progress: Progress | None = None) -> bool:
    """Compile every ``.py`` under ``tree`` (a layer's root) for python ``python``
    (``"3.11"``), so sandboxes import it without writing ``__pycache__`` to their writable
    layer. The ``.pyc`` files are reproducible: hash-based and never checked against their
    source (``unchecked-hash``: the layer is read-only, its sources never change), with paths
    as seen inside the sandbox and a fixed hash seed. False (with a progress note, nothing
    compiled) when the host has no python of that version."""
    progress = progress or (lambda stage, fraction: None)
    host = _host_python(python)
    if host is None:
        progress(f"no .pyc: no python{python} on this host", 1.0)
        return False
    progress("compile .pyc", None)
    status = subprocess.run(
        [
            host,
            "-m",
            "compileall",
            "-q",
            "--invalidation-mode",
            "unchecked-hash",
            "-s",
            str(tree),
            "-p",
            "/",
            str(tree),
        ],
        env={**os.environ, "PYTHONHASHSEED": "0"},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        timeout=1800,
    ).returncode
    # a file that does not compile (a template, Python 2) stays source only, as pip leaves it
    progress("compile .pyc" + ("" if status == 0 else " (some files stay source only)"), 1.0)
    return True


# --- fingerprints --------------------------------------------------------------------------

#: Bumped when what a fingerprint covers changes (old layers then read as "unknown", never
#: as stale: see ``build_recipe``).
_FINGERPRINT_FORMAT = 1


def _hash_file(h: Any, path: Path) -> None:
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)


def _hash_tree(h: Any, root: Path) -> None:
    """Paths, types, executable bits, contents and link targets under ``root``, in a fixed
    order (``__pycache__`` left out, as the copy leaves it out). Only the executable bit of a
    mode counts, as git keeps it: a checkout under another umask is the same recipe."""
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d != "__pycache__")
        for name in sorted([*dirnames, *filenames]):
            path = Path(dirpath, name)
            st = path.lstat()
            rel = path.relative_to(root).as_posix()
            x = "x" if stat.S_ISREG(st.st_mode) and st.st_mode & 0o111 else "-"
            h.update(f"\0{rel}\0{stat.S_IFMT(st.st_mode):o}{x}\0".encode())
            if stat.S_ISLNK(st.st_mode):
                h.update(os.readlink(path).encode())
            elif stat.S_ISREG(st.st_mode):
                _hash_file(h, path)


def recipe_fingerprint(recipe: LayerRecipe) -> str | None:
    """``sha256:<hex>`` of what the recipe builds from: its kind and source fields (not the
    mirror: any mirror serves the same suite), the contents of its ``dir`` and ``tar``, its
    pip packages. None when a ``dir`` or ``tar`` is gone (a built layer whose source was
    removed: nothing to compare). A docker source counts by image name only."""
    doc: dict[str, Any] = {
        "format": _FINGERPRINT_FORMAT,
        "kind": recipe.kind,
        "to": recipe.to if recipe.dir is not None else None,
        "docker": recipe.docker,
        "has_dir": recipe.dir is not None,
        "has_tar": recipe.tar is not None,
    }
    if recipe.debootstrap:
        d = recipe.debootstrap
        doc["debootstrap"] = [d.suite, d.variant, sorted(d.include), list(d.components)]
    if recipe.pip:
        doc["pip"] = [list(recipe.pip.packages), recipe.pip.python]
    h = hashlib.sha256(json.dumps(doc, sort_keys=True).encode())
    if recipe.tar_path is not None:
        if not recipe.tar_path.is_file():
            return None
        h.update(b"\0tar\0")
        _hash_file(h, recipe.tar_path)
    if recipe.dir_path is not None:
        if not recipe.dir_path.is_dir():
            return None
        h.update(b"\0dir\0")
        _hash_tree(h, recipe.dir_path)
    return f"sha256:{h.hexdigest()}"


def _check_fresh(recipe: LayerRecipe, info: LayerInfo, fingerprint: str | None) -> LayerInfo:
    """``info`` (the built ``recipe.ref``) unless the recipe changed since: ``LayerStale``."""
    if fingerprint and info.recipe_digest and info.recipe_digest != fingerprint:
        raise LayerStale(
            f"layer {recipe.ref}: its recipe changed since it was built (inputs "
            f"{fingerprint[:19]}, built from {info.recipe_digest[:19]}) but its version did "
            f"not: bump its version (versions are immutable), or remove the old one "
            f"(`dsec layer rm {recipe.ref}`) to rebuild it",
            ref=recipe.ref,
            recipe_digest=fingerprint,
            built_from=info.recipe_digest,
        )
    return info


# --- building ------------------------------------------------------------------------------


def build_recipe(
    recipe: LayerRecipe, store: LayerStore, progress: Progress | None = None
) -> LayerInfo:
    """Build ``recipe`` into ``store``. A ref that is already there is returned as it is if
    the recipe's fingerprint matches the one it was built from (or either is unknown: a layer
    built before fingerprints, a source directory gone); a changed recipe is ``LayerStale``."""
    fingerprint = recipe_fingerprint(recipe)
    if store.exists(recipe.ref):
        return _check_fresh(recipe, store.resolve(recipe.ref), fingerprint)
    progress = progress or (lambda stage, fraction: None)
    with store.scratch("recipe-") as scratch:
        tree = scratch / "rootfs"
        if recipe.debootstrap:
            _debootstrap(recipe.debootstrap, tree, progress)
        elif recipe.tar:
            extract_tar(recipe.tar_path, tree, progress)  # type: ignore[arg-type]
        elif recipe.docker:
            archive = export_docker_image(recipe.docker, scratch / "image.tar", progress)
            extract_tar(archive, tree, progress)
            archive.unlink()
        else:
            tree.mkdir()
            tree.chmod(0o755)
        if recipe.dir is not None:
            _copy_dir(recipe.dir_path, _inside_layer(tree, recipe.to))  # type: ignore[arg-type]
        if recipe.pip is not None:
            _pip_install(recipe.pip, tree, progress)
        plain = not (recipe.debootstrap or recipe.tar or recipe.docker)
        if plain and recipe.kind != "workspace":
            # toolkits and other read-only Python: compiled once here, not in every sandbox.
            # A workspace is left as source: its files are meant to be edited, and an
            # unchecked .pyc would shadow the edit.
            compile_python(
                tree, recipe.pip.python if recipe.pip else PipInstall(()).python, progress
            )
        try:
            return build_tree(
                tree,
                name=recipe.name,
                version=recipe.version,
                kind=recipe.kind,
                store=store,
                all_root=plain,
                timestamp=RECIPE_EPOCH if plain else None,
                source=recipe.describe(),
                progress=progress,
                recipe_digest=fingerprint or "",
            )
        except LayerExists:
            # Another build of the same recipe finished first (debootstrap is not
            # reproducible, so the digests differ); versions are immutable, so take that one.
            return _check_fresh(recipe, store.resolve(recipe.ref), fingerprint)


def build_dir_at(
    source: Path | str,
    to: str,
    *,
    name: str,
    version: str | None,
    kind: str,
    store: LayerStore,
    progress: Progress | None = None,
    all_root: bool = True,
) -> LayerInfo:
    """Build a layer holding directory ``source`` at ``to`` inside it (``dsec layer build
    DIR --to /workspace/x``): the parent directories are made (mode 755), the rest as
    ``build_layer`` makes a directory layer."""
    if not to.startswith("/"):
        raise InvalidSpec(f"--to must be an absolute path, got {to!r}", field="to")
    src = Path(source)
    if not src.is_dir():
        raise LayerBuildError(f"--to places a directory; {source} is not one", source=str(source))
    with store.scratch("dir-") as scratch:
        tree = scratch / "rootfs"
        tree.mkdir()
        tree.chmod(0o755)
        dest = _inside_layer(tree, to)
        _make_dirs(dest.parent)
        shutil.copytree(src, dest, symlinks=True)
        if all_root:
            for dirpath, dirnames, filenames in os.walk(tree):
                for entry in [*dirnames, *filenames]:
                    os.lchown(os.path.join(dirpath, entry), 0, 0)
        return build_tree(
            tree,
            name=name,
            version=version,
            kind=kind,
            store=store,
            all_root=all_root,
            source=f"{source} -> {to}",
            progress=progress,
        )
