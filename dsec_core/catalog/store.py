"""The node's registry of built catalogs: where the node daemon looks environments and tasks up."""

from __future__ import annotations

import json
import time
from pathlib import Path

from ..errors import CatalogInvalid, UnknownEnvironment
from ..linux.files import write_atomic
from .model import Catalog, Environment, Task, catalog_fields, parse_catalog

__all__ = ["CatalogStore"]


class CatalogStore:
    """Built catalogs, one ``<name>.json`` each under ``root``; the node looks environments up
    here. Where two catalogs define the same environment or task name, the catalog whose name
    sorts first wins."""

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

    def remove(self, name: str) -> None:
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
        out: dict[str, Environment] = {}
        for catalog in self.catalogs():
            for env in catalog.environments:
                out.setdefault(env.name, env)
        return list(out.values())

    def environment(self, name: str) -> Environment:
        envs = self.environments()
        for env in envs:
            if env.name == name:
                return env
        raise UnknownEnvironment(
            f"unknown environment {name!r}", name=name, known=sorted(e.name for e in envs)
        )

    def tasks(self) -> list[Task]:
        out: dict[str, Task] = {}
        for catalog in self.catalogs():
            for task in catalog.tasks:
                out.setdefault(task.name, task)
        return list(out.values())

    def task(self, name: str) -> Task:
        tasks = self.tasks()
        for task in tasks:
            if task.name == name:
                return task
        raise UnknownEnvironment(
            f"unknown task {name!r}", name=name, known=sorted(t.name for t in tasks)
        )
