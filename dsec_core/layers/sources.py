"""Opening layer sources by URL, and a node's ordered list of them.

``local`` is the node's own store; other schemes come from plugins (``posix``, ``s3``, ``oci``).
An unknown scheme gets ``UnknownSource`` naming the known ones.
"""

from __future__ import annotations

from ..config import NodeConfig
from ..errors import InvalidSpec, UnknownLayer
from ..plugins import registry
from ..records import LayerInfo, LayerRef
from .source import LayerSource

__all__ = ["split_url", "open_source", "node_sources", "find_layer"]


def split_url(url: str) -> tuple[str, str]:
    """``s3://bucket/p`` -> ("s3", "bucket/p"); ``posix:/mnt/x`` -> ("posix", "/mnt/x");
    ``local`` -> ("local", "")."""
    url = url.strip()
    if not url:
        raise InvalidSpec("empty layer source URL")
    if "://" in url:
        scheme, _, rest = url.partition("://")
    elif ":" in url:
        scheme, _, rest = url.partition(":")
    else:
        scheme, rest = url, ""
    return scheme.lower(), rest


def open_source(url: str, config: NodeConfig | None = None) -> LayerSource:
    config = config or NodeConfig.from_env()
    scheme, location = split_url(url)
    cls = registry().layer_source(scheme)
    if scheme == "local" and not location:
        location = str(config.layer_dir)
    return cls(location, cache_dir=config.cache_dir)


def node_sources(config: NodeConfig) -> list[LayerSource]:
    """The node's sources in the order they are asked."""
    return [open_source(url, config) for url in config.layer_sources]


def find_layer(sources: list[LayerSource], text: str) -> tuple[LayerSource, LayerInfo]:
    """The first source holding ``name@version``; ``UnknownLayer`` naming what exists."""
    ref = LayerRef.parse(text)
    for source in sources:
        info = source.resolve(ref)
        if info is not None:
            return source, info
    known = sorted({i.ref for s in sources for i in s.list()})
    raise UnknownLayer(f"unknown layer {text!r} in {', '.join(s.url for s in sources)}",
                       name=text, known=known)
