"""``dsec plugin new backend|source|policy NAME``: write a plugin package a third party starts
from.

The package (pyproject with the ``dsec`` entry point, the dsec versions it is written for
(``release_range``) and the kit opted in, the module, a test
that subclasses the conformance kit, a README) is rendered from the templates in
``templates/<kind>/`` with ``string.Template`` and installs and passes its kit as generated.
"""

from __future__ import annotations

import os
import re
import shutil
import string
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import click

from ..errors import InvalidSpec
from ..plugins import registry, release_range

__all__ = ["KINDS", "PluginSkeleton", "plugin", "plugin_skeleton", "write_plugin"]

TEMPLATE_DIR = Path(__file__).with_name("templates")
#: A backend name, source scheme or policy name: lowercase, digits, inner hyphens (a URL scheme
#: and, with hyphens as underscores, a Python module name).
NAME_PATTERN = re.compile(r"[a-z][a-z0-9]*(?:-[a-z0-9]+)*")
NAME_MAX = 40
#: kind -> (distribution prefix, entry-point prefix, what the class is called after its name)
KINDS = {
    "backend": ("dsec-backend-", "backend_", "Backend"),
    "source": ("dsec-layer-", "layer_", "LayerSource"),
    "policy": ("dsec-security-", "security_", "Policy"),
}
#: template file -> where it goes in the package ("{module}" and "{stem}" filled in)
LAYOUT = {
    "pyproject.toml.tmpl": "pyproject.toml",
    "README.md.tmpl": "README.md",
    "module.py.tmpl": "{module}/__init__.py",
    "test.py.tmpl": "tests/test_{stem}.py",
}


@dataclass(frozen=True)
class PluginSkeleton:
    """The names a generated plugin package uses."""

    kind: str  # "backend" | "source" | "policy"
    name: str  # the backend's name, the source's URL scheme or the policy's name
    dist: str  # distribution and directory: dsec-backend-NAME, dsec-layer-NAME, dsec-security-NAME
    module: str  # dsec_backend_NAME, dsec_layer_NAME, dsec_security_NAME
    entry_point: str  # backend_NAME, layer_NAME, security_NAME
    class_name: str  # NameBackend, NameLayerSource, NamePolicy

    def values(self) -> dict[str, str]:
        return {
            "kind": self.kind,
            "name": self.name,
            "dist": self.dist,
            "module": self.module,
            "entry_point": self.entry_point,
            "class_name": self.class_name,
            "stem": self.name.replace("-", "_"),
        }


def plugin_skeleton(kind: str, name: str) -> PluginSkeleton:
    """The names of a new ``kind`` plugin called ``name``; ``InvalidSpec`` if the kind is
    unknown, the name is not a valid backend name or URL scheme, or a loaded plugin already
    offers it."""
    if kind not in KINDS:
        raise InvalidSpec(
            f"plugin kind must be one of {', '.join(KINDS)}, not {kind!r}", field="kind"
        )
    if not NAME_PATTERN.fullmatch(name) or len(name) > NAME_MAX:
        raise InvalidSpec(
            f"plugin name {name!r} must be lowercase letters and digits, starting "
            f"with a letter, words joined by single hyphens, at most {NAME_MAX} "
            "characters (it becomes the backend name, URL scheme or policy name and, "
            "with underscores, a Python module name)",
            field="name",
        )
    reg = registry()
    offered: dict[str, Mapping[str, type]] = {
        "backend": reg.backends,
        "source": reg.layer_sources,
        "policy": reg.security_policies,
    }
    taken = offered[kind]
    if name in taken:
        owner = taken[name]
        raise InvalidSpec(
            f"a {kind} named {name!r} is already loaded ({owner.__module__}); choose another name",
            field="name",
            module=owner.__module__,
        )
    prefix, entry_prefix, suffix = KINDS[kind]
    dist = prefix + name
    stem = name.replace("-", "_")
    return PluginSkeleton(
        kind=kind,
        name=name,
        dist=dist,
        module=dist.replace("-", "_"),
        entry_point=entry_prefix + stem,
        class_name="".join(w.capitalize() for w in name.split("-")) + suffix,
    )


def write_plugin(kind: str, name: str, dest: Path) -> Path:
    """Write the package for a new plugin into ``dest/<dist>`` and return that directory.

    Refuses (``InvalidSpec``) to touch an existing directory. The package is rendered in a
    temporary directory next to it and renamed into place, so it appears whole or not at all.
    """
    skel = plugin_skeleton(kind, name)
    dest = Path(dest)
    target = dest / skel.dist
    if target.exists() or target.is_symlink():
        raise InvalidSpec(
            f"{target} already exists; dsec plugin new does not overwrite "
            "anything (remove it or pass another --dir)",
            path=os.fspath(target),
        )
    dest.mkdir(parents=True, exist_ok=True)
    values = {**skel.values(), "dsec_range": release_range()}
    work = Path(tempfile.mkdtemp(prefix=f".{skel.dist}.", dir=dest))
    try:
        for template, relative in LAYOUT.items():
            text = (TEMPLATE_DIR / kind / template).read_text()
            out = work / relative.format(module=skel.module, stem=values["stem"])
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(string.Template(text).substitute(values))
        os.chmod(work, 0o755)  # mkdtemp's 0700 would keep the package from other users
        os.rename(work, target)
    except BaseException:
        shutil.rmtree(work, ignore_errors=True)
        raise
    return target


@click.group("plugin")
def plugin() -> None:
    """Start a plugin of your own."""


@plugin.command("new")
@click.argument("kind", type=click.Choice(sorted(KINDS)))
@click.argument("name")
@click.option(
    "--dir",
    "dest",
    type=click.Path(file_okay=False, path_type=Path),
    default=Path("."),
    show_default=True,
    help="Where to write the package directory.",
)
def plugin_new(kind: str, name: str, dest: Path) -> None:
    """Write dsec-backend-NAME/, dsec-layer-NAME/ or dsec-security-NAME/: a plugin package with
    its entry point, a working minimal module and the conformance kit's tests, ready to install
    and run."""
    target = write_plugin(kind, name, dest)
    click.echo(
        f"wrote {target}\n"
        f"  pip install -e {target}\n"
        f"  pytest {target / 'tests'}    # dsec's conformance kit"
        f"{' (as root: it runs a real node)' if kind in ('backend', 'policy') else ''}"
    )
