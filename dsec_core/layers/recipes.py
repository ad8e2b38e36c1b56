"""Layer recipes: how a catalog says what goes into a layer, and the code that builds one.

A recipe's ``source`` combines at most one root filesystem (``debootstrap``, ``tar`` or
``docker``) with an optional ``dir`` copied in at ``to`` and an optional ``pip`` install of
pure-Python packages for the base image's Debian python3. Recipes made only of ``dir`` and
``pip`` are owned by root and stamped with one fixed mtime, so they rebuild to the same digest.
"""

from __future__ import annotations

import configparser
import os
import re
import shutil
import sys
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import InvalidSpec, LayerBuildError, LayerExists, ToolError
from ..linux.tools import run_tool
from ..records import LayerInfo
from .build import build_tree, export_docker_image, extract_tar
from .store import LayerStore, Progress, check_kind

__all__ = [
    "RECIPE_EPOCH",
    "Debootstrap",
    "LayerRecipe",
    "PipInstall",
    "build_recipe",
    "debian_mirror",
]

# 1980-01-01: the reproducible-builds habit (zip and wheels cannot go earlier).
RECIPE_EPOCH = 315532800
DEFAULT_DEBIAN_MIRROR = "http://deb.debian.org/debian"


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
    shutil.copytree(src, dest, symlinks=True, dirs_exist_ok=True)
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


# --- building ------------------------------------------------------------------------------


def build_recipe(
    recipe: LayerRecipe, store: LayerStore, progress: Progress | None = None
) -> LayerInfo:
    """Build ``recipe`` into ``store``; a ref that is already there is returned as it is."""
    if store.exists(recipe.ref):
        return store.resolve(recipe.ref)
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
            )
        except LayerExists:
            # Another build of the same recipe finished first (debootstrap is not
            # reproducible, so the digests differ); versions are immutable, so take that one.
            return store.resolve(recipe.ref)
