"""Docker images as base layers: ``resolve`` makes an image, named as a Dockerfile's ``FROM``
names it, into a base layer of the node's store, so a template or build can start from it.

Where an image is looked for, in order: the node's local docker (``DOCKER_HOST``'s daemon;
nothing is pulled), then each of the node's layer sources that holds docker images
(``LayerSource.find_image``: an OCI registry the node reads layers from may hold images too).
Neither: ``UnknownImage`` naming the image and where it was looked for.

The layer is content-addressed: ``image-<path>@<tag>-<12 hex digits of the image id or
manifest digest>``, so the same image resolves to the layer made the first time (``cached``)
and a changed image under the same tag to a new one. Resolves of one image run one at a time;
every scratch file is removed on every path out.
"""

from __future__ import annotations

import asyncio
import logging
import re
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

from ..config import NodeConfig
from ..errors import DsecError, UnknownImage
from ..layers.build import build_tree
from ..layers.image import ImageReference, flatten_oci_layout, import_image, local_docker_image
from ..layers.store import LayerStore
from ..records import ResolvedImage
from ..sources.base import LayerSource

__all__ = ["ImageHost", "Images", "image_layer_ref"]

log = logging.getLogger("dsec.node")


class ImageHost(Protocol):
    """What resolving images needs: the node's settings and layer sources."""

    @property
    def config(self) -> NodeConfig: ...

    @property
    def layer_sources(self) -> Sequence[LayerSource]: ...


def _name_part(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "-", text).strip("-.") or "image"


def image_layer_ref(ref: ImageReference, digest: str) -> tuple[str, str]:
    """The layer (name, version) image ``ref`` with id or manifest ``digest`` becomes."""
    tag = ref.tag or "latest"
    return f"image-{_name_part(ref.path)}", f"{_name_part(tag)}-{digest.split(':')[-1][:12]}"


def _resolved(
    image: str, layer: str, source: str, config: Mapping[str, Any], cached: bool
) -> ResolvedImage:
    return ResolvedImage(
        image=image,
        layer=layer,
        source=source,
        env=tuple(str(e) for e in config.get("Env") or ()),
        workdir=str(config.get("WorkingDir") or ""),
        user=str(config.get("User") or ""),
        cmd=tuple(str(a) for a in [*(config.get("Entrypoint") or ()), *(config.get("Cmd") or ())]),
        cached=cached,
    )


class Images:
    """``resolve`` for ``host``'s node."""

    def __init__(self, host: ImageHost) -> None:
        self.host = host
        self._locks: dict[str, asyncio.Lock] = {}

    async def resolve(self, image: str) -> ResolvedImage:
        ref = ImageReference.parse(image)  # InvalidSpec before anything runs
        # one lock per image the node was asked for (a handful: templates share bases)
        async with self._locks.setdefault(str(ref), asyncio.Lock()):
            return await asyncio.to_thread(self._resolve, image, ref)

    def _store(self) -> LayerStore:
        return LayerStore(self.host.config.layer_dir)

    def _resolve(self, image: str, ref: ImageReference) -> ResolvedImage:
        store = self._store()
        docker = local_docker_image(str(ref))
        if docker is not None:
            image_id, config = docker
            name, version = image_layer_ref(ref, image_id)
            cached = store.exists(f"{name}@{version}")
            if not cached:
                import_image(store, str(ref), name=name, version=version)
                log.info(
                    "made image %s (docker %s) into layer %s@%s", image, image_id, name, version
                )
            return _resolved(image, f"{name}@{version}", "docker", config, cached)
        looked = ["the node's docker"]
        for source in self.host.layer_sources:
            try:
                digest = source.find_image(str(ref))
            except DsecError as e:  # one source down does not hide an image another holds
                log.warning("layer source %s could not look up image %s: %s", source.url, image, e)
                looked.append(f"{source.url} ({type(e).__name__})")
                continue
            if digest is None:
                if type(source).find_image is not LayerSource.find_image:
                    looked.append(source.url)
                continue
            name, version = image_layer_ref(ref, digest)
            cached = store.exists(f"{name}@{version}")
            if cached:
                config = source.fetch_image(str(ref), None)
                return _resolved(image, f"{name}@{version}", source.url, config, cached)
            with store.scratch("image-") as scratch:
                config = source.fetch_image(str(ref), scratch / "layout")
                tree = flatten_oci_layout(scratch / "layout", scratch / "rootfs")
                build_tree(
                    tree,
                    name=name,
                    version=version,
                    kind="base",
                    store=store,
                    all_root=False,
                    source=f"{source.url} image {ref}",
                )
            log.info("made image %s (%s) into layer %s@%s", image, source.url, name, version)
            return _resolved(image, f"{name}@{version}", source.url, config, cached)
        raise UnknownImage(
            f"image {image!r} was not found: not in {', '.join(looked)} "
            "(dsec never pulls from public registries: load it into the node's docker, or push "
            "it to one of the node's OCI layer sources)",
            name=image,
        )
