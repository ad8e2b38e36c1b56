"""The node's own layer store as a layer source (scheme ``local``); part of core, always loaded.

The location is the store's root directory (default: the node's ``NodeConfig().layer_dir``,
i.e. ``$DSEC_HOME/layers``). Images are used in place (``LayerSource.local``).
"""

from __future__ import annotations

import builtins
import json
import shutil
from pathlib import Path
from typing import Any

from ..config import NodeConfig
from ..errors import LayerCorrupt, UnknownEnvironment, UnknownLayer
from ..hookspecs import hookimpl
from ..layers.store import LayerStore
from ..lazy.layout import ReadProfile
from ..linux.files import write_atomic
from ..records import LayerInfo, LayerRef
from .base import LayerSource

__all__ = ["LocalLayerSource"]


class LocalLayerSource(LayerSource):
    """Layers from a ``LayerStore`` on this machine; images need no fetching."""

    scheme = "local"
    local = True

    def __init__(self, location: str = "", *, cache_dir: Path | None = None) -> None:
        root = Path(location) if location else NodeConfig.from_env().layer_dir
        super().__init__(str(root), cache_dir=cache_dir)
        self.store = LayerStore(root)

    @property
    def url(self) -> str:
        return f"local:{self.location}"

    def resolve(self, ref: LayerRef) -> LayerInfo | None:
        try:
            return self.store.resolve(ref)
        except UnknownLayer:
            return None

    def list(self) -> list[LayerInfo]:
        return self.store.list()

    def image_path(self, info: LayerInfo) -> Path:
        return self.store.image_path(info)

    def push(self, info: LayerInfo, image: Path, *, profile: ReadProfile | None = None) -> bool:
        moved = not (
            self.store.exists(info.ref) and self.store.resolve(info.ref).digest == info.digest
        )
        if moved:
            with self.store.scratch("push-") as tmp:
                copy = tmp / "image.erofs"
                shutil.copyfile(image, copy)  # add() moves its input into the store
                added = self.store.add(
                    copy,
                    name=info.name,
                    version=info.version,
                    kind=info.kind,
                    source=info.source,
                    **info.lineage(),
                )
            if added.digest != info.digest:
                self.store.remove(info.ref, force=True)
                raise LayerCorrupt(
                    f"{image} is not {info.digest}", digest=info.digest, source=self.url
                )
        if profile is not None and profile.layer_digest == info.digest:
            self.store.save_profile(profile)  # a profile travels with its layer
        return moved

    def _catalog_file(self, name: str) -> Path:
        return Path(self.location) / "published-catalogs" / f"{name}.json"

    def put_catalog(self, name: str, document: dict[str, Any]) -> None:
        write_atomic(self._catalog_file(name), json.dumps(document, indent=2).encode())

    def get_catalog(self, name: str) -> dict[str, Any]:
        try:
            return json.loads(self._catalog_file(name).read_text())
        except FileNotFoundError:
            raise UnknownEnvironment(
                f"{self.url}: no catalog {name!r}", name=name, known=self.catalogs()
            ) from None

    def catalogs(self) -> builtins.list[str]:
        d = Path(self.location) / "published-catalogs"
        return sorted(p.stem for p in d.glob("*.json")) if d.is_dir() else []


@hookimpl
def dsec_register_layer_sources(register):
    register(LocalLayerSource)
