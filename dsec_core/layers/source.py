"""The contract for layer sources: where EROFS layers and catalogs are found by name or digest.

A node lists its sources in order; a layer is taken from the first source that has it. The
local store is one source; S3, OCI registries and shared filesystems are others.
"""

from __future__ import annotations

import abc
from pathlib import Path
from typing import ClassVar

from ..records import LayerInfo, LayerRef

__all__ = ["LayerSource"]


class LayerSource(abc.ABC):
    """Subclass, set ``scheme``, register from ``dsec_register_layer_sources``."""

    scheme: ClassVar[str]

    def __init__(self, location: str = "") -> None:
        self.location = location

    @abc.abstractmethod
    def resolve(self, ref: LayerRef) -> LayerInfo | None:
        """The layer ``ref`` names (newest version if unversioned), or None if not here."""

    @abc.abstractmethod
    def list(self) -> list[LayerInfo]:
        """Every layer this source holds."""

    @abc.abstractmethod
    def image_path(self, info: LayerInfo) -> Path:
        """A local path to the layer's EROFS image, fetching it first if needed."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.scheme}:{self.location})"
