"""The node's registry of built catalogs: where the node daemon looks environments and tasks up."""

from __future__ import annotations

import json
import time
from pathlib import Path

from ..errors import CatalogInvalid, UnknownEnvironment
from ..linux.files import write_atomic
from .model import Catalog, Environment, Task, catalog_fields, parse_catalog, pick_named

__all__ = ["CatalogStore"]


class CatalogStore:
    """Built catalogs, one ``<name>.json`` each under ``root``; the node looks environments up
    here. Every environment and task is known as ``<catalog>/<name>``; a bare name is
    accepted when exactly one catalog defines it, and is ``AmbiguousName`` (listing the
    qualified choices) when several do: nothing silently shadows."""

    def __init__(self, root: Path | str) -> None:
        self.root = Path(root)
        # file -> (stat identity, parsed catalog): the node looks environments up on every
        # create, and schema validation costs more than the rest of the lookup.
        self._parsed: dict[Path, tuple[tuple[int, int, int], Catalog]] = {}

    def __repr__(self) -> str:
        return f"CatalogStore({str(self.root)!r})"

    def save(self, catalog: Catalog) -> Path:
        record = {
            "saved": time.time(),
            "path": catalog.path,
            "root": catalog.root,
            "catalog": catalog.to_document(),
        }
        target = self.root / f"{catalog.name}.json"
        write_atomic(target, json.dumps(record, indent=2).encode() + b"\n")
        return target

    def catalog(self, name: str) -> Catalog:
        """The registered catalog ``name``; ``UnknownEnvironment`` naming the known ones."""
        for catalog in self.catalogs():
            if catalog.name == name:
                return catalog
        known = [c.name for c in self.catalogs()]
        raise UnknownEnvironment(
            f"no catalog {name!r} is registered (known: {', '.join(known) or 'none'})",
            name=name,
            known=known,
        )

    def remove(self, name: str) -> None:
        """Unregister catalog ``name`` (its layers stay in the layer store)."""
        target = self.root / f"{name}.json"
        if not target.exists():
            raise UnknownEnvironment(
                f"no catalog {name!r}", name=name, known=[c.name for c in self.catalogs()]
            )
        target.unlink()

    def catalogs(self) -> list[Catalog]:
        out = []
        for file in sorted(self.root.glob("*.json")) if self.root.is_dir() else []:
            try:
                st = file.stat()
                key = (st.st_ino, st.st_size, st.st_mtime_ns)
                hit = self._parsed.get(file)
                if hit and hit[0] == key:
                    out.append(hit[1])
                    continue
                record = json.loads(file.read_text())
            except FileNotFoundError:
                continue
            except json.JSONDecodeError as e:
                raise CatalogInvalid(
                    f"{file}: not valid JSON: {e}", path="$", file=str(file)
                ) from e
            # Built catalogs no longer need their sources: the layers are in the store.
            catalog = parse_catalog(
                record["catalog"],
                where=str(file),
                root=record.get("root", "."),
                check_sources=False,
                check_layers=False,
            )
            catalog = Catalog(**{**catalog_fields(catalog), "path": record.get("path", "")})
            self._parsed[file] = (key, catalog)
            out.append(catalog)
        return out

    def environments(self) -> list[Environment]:
        """Every registered environment, by catalog name, then in its catalog's order."""
        return [env for catalog in self.catalogs() for env in catalog.environments]

    def environment(self, name: str) -> Environment:
        """The environment ``name`` means: ``<catalog>/<name>``, or a bare name one catalog
        alone defines (several: ``AmbiguousName``; none: ``UnknownEnvironment``)."""
        return pick_named(self.environments(), name, "environment")

    def tasks(self) -> list[Task]:
        """Every registered task, by catalog name, then in its catalog's order."""
        return [task for catalog in self.catalogs() for task in catalog.tasks]

    def task(self, name: str) -> Task:
        """The task ``name`` means, as ``environment`` finds an environment."""
        return pick_named(self.tasks(), name, "task")

    def shadowed(self, catalog: Catalog) -> list[str]:
        """The qualified names of other registered catalogs' environments and tasks that
        ``catalog`` defines too: their bare names are ambiguous from now on."""
        envs = {e.name for e in catalog.environments}
        tasks = {t.name for t in catalog.tasks}
        out = [e.qualified for e in self.environments() if e.name in envs]
        out += [t.qualified for t in self.tasks() if t.name in tasks]
        return sorted(q for q in out if not q.startswith(f"{catalog.name}/"))
