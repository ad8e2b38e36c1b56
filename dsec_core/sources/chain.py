"""Layer source URLs, and finding a layer in a node's ordered list of sources.

Opening a source by URL needs the plugins that provide its scheme: that is
``dsec_core.plugins.Registry.open_source``.
"""

from __future__ import annotations

from collections.abc import Sequence

from ..errors import InvalidSpec, SourceUnavailable, UnknownLayer
from ..records import LayerInfo, LayerRef
from .base import LayerSource

__all__ = ["find_layer", "split_url"]


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


def find_layer(sources: Sequence[LayerSource], text: str) -> tuple[LayerSource, LayerInfo]:
    """The first source holding ``name@version``; ``UnknownLayer`` naming what exists. A
    source that cannot be reached is passed over: a later one that has the layer serves it (a
    node's own store, last, still has the snapshots it packed while S3 is away);
    ``SourceUnavailable`` of the first such source if none does, since it may."""
    ref = LayerRef.parse(text)
    away: list[SourceUnavailable] = []
    for source in sources:
        try:
            info = source.resolve(ref)
        except SourceUnavailable as e:
            away.append(e)
            continue
        if info is not None:
            return source, info
    if away:
        raise away[0]
    known = sorted({i.ref for s in sources for i in s.list()})
    raise UnknownLayer(
        f"unknown layer {text!r} in {', '.join(s.url for s in sources)}", name=text, known=known
    )
