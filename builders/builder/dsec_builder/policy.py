"""A build's network policy: the package indexes its session may reach, and nothing else.

A policy file is YAML, ``indexes: [{pip: http://127.0.0.1:8080/simple}, {apt: http://...}]``.
Each index becomes one egress allow rule (``host:port/tcp``) of the session's sandbox, and the
session's pip and apt are pointed at it. With no indexes the session has no network at all.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import yaml

from dsec_core.errors import InvalidSpec
from dsec_core.layers.recipes import mirror_env, mirror_files

__all__ = ["INDEX_KINDS", "BuildPolicy", "PackageIndex"]

#: What an index serves: ``pip`` (a PEP 503 simple index) or ``apt`` (a Debian mirror).
INDEX_KINDS = ("pip", "apt")


@dataclass(frozen=True)
class PackageIndex:
    """One package index a build may reach: ``kind`` (``INDEX_KINDS``) at ``url``."""

    kind: str
    url: str

    def __post_init__(self) -> None:
        if self.kind not in INDEX_KINDS:
            raise InvalidSpec(
                f"index kind {self.kind!r}: expected one of {', '.join(INDEX_KINDS)}",
                field="indexes",
            )
        parts = urlsplit(self.url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise InvalidSpec(
                f"{self.kind} index {self.url!r}: expected an http(s)://host[:port]/path URL",
                field="indexes",
            )
        try:
            parts.port  # noqa: B018 - a bad port is refused here, not when the rule is made
        except ValueError as e:
            raise InvalidSpec(f"{self.kind} index {self.url!r}: {e}", field="indexes") from e

    @property
    def host(self) -> str:
        return urlsplit(self.url).hostname or ""

    @property
    def port(self) -> int:
        parts = urlsplit(self.url)
        return parts.port or (443 if parts.scheme == "https" else 80)

    @property
    def rule(self) -> str:
        """The egress allow rule that lets a sandbox reach this index and nothing beside it."""
        return f"{self.host}:{self.port}/tcp"


@dataclass(frozen=True)
class BuildPolicy:
    """What a build session may reach: ``indexes`` (none: no network)."""

    indexes: tuple[PackageIndex, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "indexes", tuple(self.indexes))

    @classmethod
    def from_dict(cls, doc: Mapping[str, Any] | None) -> BuildPolicy:
        """Read ``{indexes: [{pip: URL}, {apt: URL}]}``; ``InvalidSpec`` names what is wrong."""
        if doc is None:
            return cls()
        if not isinstance(doc, Mapping):
            raise InvalidSpec("a build policy is a mapping with 'indexes'", field="policy")
        unknown = sorted(set(doc) - {"indexes"})
        if unknown:
            raise InvalidSpec(f"build policy: unknown field(s) {unknown}", field="policy")
        items = doc.get("indexes") or []
        if not isinstance(items, list):
            raise InvalidSpec("build policy: indexes must be a list", field="indexes")
        indexes = []
        for i, item in enumerate(items):
            if not (isinstance(item, Mapping) and len(item) == 1):
                raise InvalidSpec(
                    f"build policy: indexes[{i}] must be one of {{pip: URL}}, {{apt: URL}}",
                    field="indexes",
                )
            ((kind, url),) = item.items()
            if not isinstance(url, str):
                raise InvalidSpec(
                    f"build policy: indexes[{i}].{kind} must be a URL", field="indexes"
                )
            indexes.append(PackageIndex(str(kind), url))
        return cls(tuple(indexes))

    @classmethod
    def load(cls, path: Path | str) -> BuildPolicy:
        """The policy in YAML file ``path``."""
        try:
            doc = yaml.safe_load(Path(path).read_text())
        except OSError as e:
            raise InvalidSpec(f"build policy {path}: {e}", path=str(path)) from e
        except yaml.YAMLError as e:
            raise InvalidSpec(f"build policy {path}: not valid YAML: {e}", path=str(path)) from e
        return cls.from_dict(doc)

    def to_dict(self) -> dict[str, Any]:
        return {"indexes": [{i.kind: i.url} for i in self.indexes]}

    @property
    def network(self) -> str:
        """The session sandbox's network mode: an allowlist of the indexes, or none."""
        return "allowlist" if self.indexes else "none"

    @property
    def policies(self) -> dict[str, dict[str, Any]]:
        """The session sandbox's security policies: egress allowed to the indexes only."""
        if not self.indexes:
            return {}
        rules = sorted({i.rule for i in self.indexes})
        return {"egress": {"allow": rules}}

    def first(self, kind: str) -> PackageIndex | None:
        return next((i for i in self.indexes if i.kind == kind), None)

    def mirror_env(self) -> dict[str, str]:
        """Environment variables that point the session's pip at the pip index (and name the
        apt mirror): ``dsec_core.layers.recipes.mirror_env``."""
        pip, apt = self.first("pip"), self.first("apt")
        return mirror_env(pip_index=pip.url if pip else None, apt_mirror=apt.url if apt else None)

    def mirror_files(self) -> dict[str, str]:
        """Files (path in the sandbox -> text) that point the session's apt at the apt index
        (``dsec_core.layers.recipes.mirror_files``); the session puts back what they replaced
        before packing."""
        apt = self.first("apt")
        return mirror_files(apt.url) if apt else {}
