"""dsec layer source plugin: EROFS layers and catalogs as OCI artifacts in a container registry.

``oci://HOST:PORT/optional/prefix?insecure=1`` (``insecure=1``: plain HTTP, for a loopback or
lab registry). The layout, one OCI artifact per layer version and per catalog:

- layer ``name@version``: repository ``<prefix>/<name>``, tag ``<version>`` (``+`` becomes
  ``_``, tags cannot hold it); an image manifest whose only layer is the EROFS image, media type
  ``application/vnd.erofs.layer.v1`` (its OCI digest is the layer's sha256 digest), the empty
  config ``application/vnd.oci.empty.v1+json``, and annotations ``org.dsec.layer.{name,version,
  kind,created,source}``.
- its lazy (split) form, for on-demand loading: same repository, tag ``lazy-<layer sha256 hex>``;
  a manifest of three blobs: the metadata image ``application/vnd.erofs.meta.v1``, the chunked
  data blob ``application/vnd.erofs.blob.v1`` and the ``LazyForm`` JSON (chunk index)
  ``application/vnd.dsec.chunk-index.v1+json``, annotated ``org.dsec.layer.digest``. A second
  tag rather than more blobs in the layer's manifest: the version manifest stays exactly what
  older readers expect (one layer), and keying by content means two versions of the same image
  share one lazy form, split and uploaded once. It is pushed before the version tag, so a
  visible version has its lazy form if it ever will; layers pushed before lazy forms existed
  (or by a host that could not split) have none and are fetched whole.
- catalog ``name``: repository ``<prefix>/catalogs/<name>``, tag ``latest``; one blob of media
  type ``application/vnd.dsec.catalog.v1+json`` holding the catalog JSON.

oras-py (``oras.provider.Registry``) builds the URLs and answers token/basic auth challenges;
its ``do_request`` is replaced so that one request is one try with short timeouts (oras retries
for half a minute) and transport errors become ``SourceUnavailable``. Credentials come from
``DSEC_OCI_USERNAME``/``DSEC_OCI_PASSWORD`` or the docker config file oras reads. Blobs are
fetched in ranges through ``fetch_verified``, so every byte is checked before anything mounts it;
lazily read data-blob ranges (``read_blob``, a Range GET) are checked per chunk by the node.
"""

from __future__ import annotations

import builtins
import functools
import hashlib
import json
import os
import platform
import re
import time
import urllib.parse
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import oras.auth
import oras.container
import oras.provider
import requests

from dsec_core.errors import (
    DsecError,
    InvalidSpec,
    LayerCorrupt,
    LayerExists,
    SourceUnavailable,
    UnknownEnvironment,
    UnknownImage,
    UnknownLayer,
)
from dsec_core.hookspecs import hookimpl
from dsec_core.layers.image import ImageReference
from dsec_core.lazy.layout import ReadProfile
from dsec_core.lazy.split import LazyForm
from dsec_core.records import LayerInfo, LayerRef
from dsec_core.sources.base import LayerSource, fetch_verified, split_for_publishing

#: The dsec plugin API this plugin is written for (docs/plugins/index.md, "Writing a plugin").
DSEC_PLUGIN_API = 2

__all__ = [
    "ANNOTATION_PREFIX",
    "BLOB_MEDIA_TYPE",
    "CATALOG_MEDIA_TYPE",
    "CHUNK_INDEX_MEDIA_TYPE",
    "LAYER_MEDIA_TYPE",
    "META_MEDIA_TYPE",
    "OciLayerSource",
]

LAYER_MEDIA_TYPE = "application/vnd.erofs.layer.v1"
META_MEDIA_TYPE = "application/vnd.erofs.meta.v1"
BLOB_MEDIA_TYPE = "application/vnd.erofs.blob.v1"
CHUNK_INDEX_MEDIA_TYPE = "application/vnd.dsec.chunk-index.v1+json"
LAZY_TAG_PREFIX = "lazy-"
CATALOG_MEDIA_TYPE = "application/vnd.dsec.catalog.v1+json"
MANIFEST_MEDIA_TYPE = "application/vnd.oci.image.manifest.v1+json"
EMPTY_MEDIA_TYPE = "application/vnd.oci.empty.v1+json"
#: What a docker image's manifest may be: an index (a manifest list) or one image's manifest,
#: in OCI's or docker's own media types.
IMAGE_INDEX_TYPES = (
    "application/vnd.oci.image.index.v1+json",
    "application/vnd.docker.distribution.manifest.list.v2+json",
)
IMAGE_MANIFEST_TYPES = (
    MANIFEST_MEDIA_TYPE,
    "application/vnd.docker.distribution.manifest.v2+json",
)
#: The largest manifest or config read whole (registries cap manifests at 4 MiB).
MAX_MANIFEST = 4 << 20
EMPTY_BLOB = b"{}"
EMPTY_DIGEST = "sha256:" + hashlib.sha256(EMPTY_BLOB).hexdigest()
ANNOTATION_PREFIX = "org.dsec.layer."
CATALOG_ANNOTATION = "org.dsec.catalog.name"
CATALOG_REPO = "catalogs"

CONNECT_TIMEOUT = 3.0
READ_TIMEOUT = 60.0

# OCI distribution spec: one path component of a repository name, and a tag.
_COMPONENT = re.compile(r"[a-z0-9]+(?:(?:\.|_|__|-+)[a-z0-9]+)*")
_TAG = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]{0,127}")


def _digest_of(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def _architecture() -> str:
    """This machine's architecture as OCI platforms name it."""
    machine = platform.machine()
    return {"x86_64": "amd64", "aarch64": "arm64"}.get(machine, machine)


def _rfc3339(ts: float) -> str:
    return datetime.fromtimestamp(ts, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


class _Registry(oras.provider.Registry):
    """oras's registry client, with one try per request, timeouts, and errors mapped to ours."""

    def __init__(self, hostname: str, *, insecure: bool, source: str) -> None:
        super().__init__(hostname=hostname, insecure=insecure)
        self.source = source
        self.basic_challenge = False  # set once the registry asked for basic auth
        # oras's token auth calls the session directly, so the timeout goes on the session.
        self.session.request = functools.partial(
            self.session.request, timeout=(CONNECT_TIMEOUT, READ_TIMEOUT)
        )
        user, password = os.environ.get("DSEC_OCI_USERNAME"), os.environ.get("DSEC_OCI_PASSWORD")
        if user and password:
            self.auth.set_basic_auth(user, password)
        else:
            try:
                self.auth.load_configs(self.container("x"))
            except Exception:  # an unreadable docker config means anonymous, not a failure
                pass

    def container(self, name: str) -> oras.container.Container:
        # With the host written first, a prefix such as "my.org/x" is not taken for a registry.
        return oras.container.Container(f"{self.hostname}/{name}", registry=self.hostname)

    def do_request(
        self,
        url: str,
        method: str = "GET",
        data: Any = None,
        headers: dict | None = None,
        json: dict | None = None,
        stream: bool = False,
    ) -> requests.Response:
        headers = dict(headers or {})
        headers.update(self.headers)
        try:
            basic = getattr(self.auth, "_basic_auth", None)
            if self.basic_challenge and basic:
                headers["Authorization"] = f"Basic {basic}"
            elif isinstance(self.auth, oras.auth.TokenAuth) and self.auth.token is not None:
                headers.update(self.auth.get_auth_header())
            response = self.session.request(
                method,
                url,
                data=data,
                json=json,
                headers=headers,
                stream=stream,
                verify=self._tls_verify,
            )
            if response.status_code in (401, 403):
                challenge = response.headers.get("Www-Authenticate", "")
                if challenge.lower().startswith("basic") and basic:
                    self.basic_challenge = True
                    # An htpasswd registry wants the password itself, not a token for it.
                    headers["Authorization"] = f"Basic {basic}"
                    changed = True
                else:
                    headers, changed = self.auth.authenticate_request(response, headers)
                if changed:
                    if hasattr(data, "seek"):
                        data.seek(0)
                    response = self.session.request(
                        method,
                        url,
                        data=data,
                        json=json,
                        headers=headers,
                        stream=stream,
                        verify=self._tls_verify,
                    )
        except requests.RequestException as e:
            raise SourceUnavailable(
                f"{self.source}: cannot reach the registry ({method} {url}: {type(e).__name__})",
                source=self.source,
            ) from e
        if response.status_code in (401, 403):
            raise SourceUnavailable(
                f"{self.source}: the registry refused our credentials "
                f"(HTTP {response.status_code} to {method} {url}); set "
                "DSEC_OCI_USERNAME/DSEC_OCI_PASSWORD or docker login",
                source=self.source,
                status=response.status_code,
            )
        return response


class OciLayerSource(LayerSource):
    """Layers and catalogs in an OCI registry (distribution, Harbor, Zot, GHCR, ...)."""

    scheme = "oci"

    def __init__(self, location: str = "", *, cache_dir: Path | None = None) -> None:
        super().__init__(location, cache_dir=cache_dir)
        parts = urllib.parse.urlsplit(f"//{location}")
        if not parts.netloc:
            raise InvalidSpec(
                f"oci layer source needs a registry host: oci://HOST:PORT/prefix, got {self.url!r}"
            )
        query = urllib.parse.parse_qs(parts.query)
        insecure = query.get("insecure", ["0"])[-1].lower() in ("1", "true", "yes")
        self.host = parts.netloc
        self.prefix = parts.path.strip("/")
        for component in filter(None, self.prefix.split("/")):
            if not _COMPONENT.fullmatch(component):
                raise InvalidSpec(
                    f"{self.url}: {component!r} cannot be part of an OCI "
                    "repository name (lowercase letters, digits, . _ -)"
                )
        self.base = f"{'http' if insecure else 'https'}://{self.host}"
        self.client = _Registry(self.host, insecure=insecure, source=self.url)
        # OCI blobs live in a repository, a LazyForm names only digests: remember which
        # repository (and size) each lazy form's blobs came from (filled by lazy_form, push).
        self._blob_repos: dict[str, tuple[str, int]] = {}

    # --- names ----------------------------------------------------------------------------
    def _repo(self, *names: str) -> str:
        return "/".join(p for p in (self.prefix, *names) if p)

    @staticmethod
    def _tag(version: str) -> str:
        return version.replace("+", "_")

    @staticmethod
    def _representable(name: str, version: str | None = None) -> bool:
        return bool(_COMPONENT.fullmatch(name)) and (
            version is None or bool(_TAG.fullmatch(OciLayerSource._tag(version)))
        )

    # --- HTTP -----------------------------------------------------------------------------
    def _request(
        self, method: str, url: str, *, ok: tuple[int, ...] = (200,), **kw: Any
    ) -> requests.Response:
        response = self.client.do_request(url, method, **kw)
        if response.status_code not in ok:
            raise SourceUnavailable(
                f"{self.url}: the registry answered HTTP "
                f"{response.status_code} to {method} {url}: "
                f"{response.text[:300].strip()}",
                source=self.url,
                status=response.status_code,
            )
        return response

    def _manifest(self, repo: str, tag: str) -> dict | None:
        url = f"{self.client.prefix}://{self.client.container(f'{repo}:{tag}').manifest_url()}"
        response = self._request("GET", url, ok=(200, 404), headers={"Accept": MANIFEST_MEDIA_TYPE})
        if response.status_code == 404:
            return None
        try:
            return response.json()
        except ValueError as e:
            raise SourceUnavailable(
                f"{self.url}: manifest {repo}:{tag} is not JSON", source=self.url
            ) from e

    def _paged(self, url: str, key: str) -> Iterator[str]:
        """Items of a paginated list endpoint (``_catalog``, ``tags/list``); none on 404."""
        while url:
            response = self._request("GET", url, ok=(200, 404))
            if response.status_code == 404:
                return
            yield from response.json().get(key) or []
            link = response.links.get("next", {}).get("url")
            url = urllib.parse.urljoin(self.base, link) if link else ""

    def _repositories(self) -> list[str]:
        return list(self._paged(f"{self.base}/v2/_catalog?n=1000", "repositories"))

    def _tags(self, repo: str) -> list[str]:
        url = f"{self.client.prefix}://{self.client.container(repo).tags_url()}"
        return list(self._paged(url, "tags"))

    def _blob_url(self, repo: str, digest: str) -> str:
        return f"{self.client.prefix}://{self.client.container(repo).get_blob_url(digest)}"

    def _blob_size(self, repo: str, digest: str) -> int | None:
        response = self._request("HEAD", self._blob_url(repo, digest), ok=(200, 404))
        if response.status_code == 404:
            return None
        return int(response.headers.get("Content-Length", -1))

    def _read_range(self, repo: str, digest: str, offset: int, length: int) -> bytes:
        response = self._request(
            "GET",
            self._blob_url(repo, digest),
            ok=(200, 206, 416),
            headers={"Range": f"bytes={offset}-{offset + length - 1}"},
        )
        if response.status_code == 416:
            return b""
        if response.status_code == 200:  # a registry that ignores Range sends the whole blob
            return response.content[offset : offset + length]
        return response.content

    def _upload(self, repo: str, digest: str, size: int, data: bytes | Path) -> None:
        """Upload a blob unless the repository has it; the registry checks the digest."""
        if self._blob_size(repo, digest) == size:
            return
        container = self.client.container(repo)
        started = self._request(
            "POST",
            f"{self.client.prefix}://{container.upload_blob_url()}",
            ok=(202,),
            headers={"Content-Length": "0"},
        )
        location = self.client._get_location(started, container)
        if not location:
            raise SourceUnavailable(
                f"{self.url}: the registry gave no upload location", source=self.url
            )
        sep = "&" if "?" in location else "?"
        url = f"{location}{sep}digest={urllib.parse.quote(digest)}"
        headers = {"Content-Type": "application/octet-stream", "Content-Length": str(size)}
        if isinstance(data, Path):
            with open(data, "rb") as f:  # streamed: images can be gigabytes
                response = self.client.do_request(url, "PUT", data=f, headers=headers)
        else:
            response = self.client.do_request(url, "PUT", data=data, headers=headers)
        if response.status_code == 400 and "DIGEST_INVALID" in response.text:
            raise LayerCorrupt(
                f"{self.url}: the registry says the upload does not match {digest}",
                digest=digest,
                source=self.url,
            )
        if response.status_code != 201:
            raise SourceUnavailable(
                f"{self.url}: uploading {digest} to {repo} failed: HTTP "
                f"{response.status_code} {response.text[:300].strip()}",
                source=self.url,
                status=response.status_code,
            )

    def _put_manifest(
        self, repo: str, tag: str, blobs: list[dict], annotations: dict[str, str]
    ) -> None:
        self._upload(repo, EMPTY_DIGEST, len(EMPTY_BLOB), EMPTY_BLOB)
        manifest = {
            "schemaVersion": 2,
            "mediaType": MANIFEST_MEDIA_TYPE,
            "artifactType": blobs[0]["mediaType"],
            "config": {
                "mediaType": EMPTY_MEDIA_TYPE,
                "digest": EMPTY_DIGEST,
                "size": len(EMPTY_BLOB),
                "data": "e30=",
            },
            "layers": blobs,
            "annotations": annotations,
        }
        container = self.client.container(f"{repo}:{tag}")
        try:
            response = self.client.upload_manifest(manifest, container)
        except DsecError:
            raise
        except Exception as e:  # jsonschema's ValidationError: a bug in the manifest above
            raise InvalidSpec(f"{self.url}: bad manifest for {repo}:{tag}: {e}") from e
        if response.status_code != 201:
            raise SourceUnavailable(
                f"{self.url}: storing manifest {repo}:{tag} failed: HTTP "
                f"{response.status_code} {response.text[:300].strip()}",
                source=self.url,
                status=response.status_code,
            )

    # --- layers ---------------------------------------------------------------------------
    @staticmethod
    def _info(manifest: dict | None) -> LayerInfo | None:
        """The layer a manifest describes, or None if it is not a dsec layer artifact."""
        if not manifest:
            return None
        layers = manifest.get("layers") or []
        notes = manifest.get("annotations") or {}
        if len(layers) != 1 or layers[0].get("mediaType") != LAYER_MEDIA_TYPE:
            return None
        try:
            return LayerInfo(
                name=notes[ANNOTATION_PREFIX + "name"],
                version=notes[ANNOTATION_PREFIX + "version"],
                kind=notes[ANNOTATION_PREFIX + "kind"],
                digest=layers[0]["digest"],
                size=int(layers[0]["size"]),
                created=float(notes.get(ANNOTATION_PREFIX + "created", 0)),
                source=notes.get(ANNOTATION_PREFIX + "source", ""),
            )
        except (KeyError, ValueError, TypeError):
            return None

    def _layer(self, name: str, version: str) -> LayerInfo | None:
        info = self._info(self._manifest(self._repo(name), self._tag(version)))
        # Tags fold "+" into "_"; the annotation says which version this really is.
        return info if info and info.name == name and info.version == version else None

    def _versions(self, name: str) -> list[LayerInfo]:
        repo = self._repo(name)
        infos = (self._info(self._manifest(repo, tag)) for tag in self._tags(repo))
        return [i for i in infos if i is not None and i.name == name]

    def resolve(self, ref: LayerRef) -> LayerInfo | None:
        if not self._representable(ref.name, ref.version):
            return None
        if ref.version:
            return self._layer(ref.name, ref.version)
        versions = self._versions(ref.name)
        return max(versions, key=lambda i: i.created) if versions else None

    def list(self) -> list[LayerInfo]:
        start = f"{self.prefix}/" if self.prefix else ""
        out = []
        for repo in self._repositories():
            rest = repo[len(start) :]
            if repo.startswith(start) and rest and "/" not in rest:
                out.extend(self._versions(rest))
        return sorted(out, key=lambda i: (i.name, i.created))

    # --- docker images ---------------------------------------------------------------------
    def _image_repo(self, image: str) -> tuple[str, str]:
        """The repository and tag or digest that hold docker image ``image`` here: its path
        under this source's prefix (a registry host in the reference is left out)."""
        ref = ImageReference.parse(image)
        return self._repo(ref.path), ref.digest or ref.tag or "latest"

    def _image_manifest(self, repo: str, reference: str) -> tuple[str, dict] | None:
        """(digest, manifest) of this platform's image at ``repo:reference``; None if the
        registry has none there, or what it has is no docker image (a dsec layer, say)."""
        accept = ", ".join((*IMAGE_INDEX_TYPES, *IMAGE_MANIFEST_TYPES))
        for _ in range(2):  # an index, then the manifest it names for this platform
            at = "@" if reference.startswith("sha256:") else ":"
            container = self.client.container(f"{repo}{at}{reference}")
            url = f"{self.client.prefix}://{container.manifest_url()}"
            response = self._request("GET", url, ok=(200, 404), headers={"Accept": accept})
            if response.status_code == 404:
                return None
            body = response.content[: MAX_MANIFEST + 1]
            if len(body) > MAX_MANIFEST:
                raise SourceUnavailable(
                    f"{self.url}: manifest {repo}:{reference} is over {MAX_MANIFEST} bytes",
                    source=self.url,
                )
            try:
                doc = json.loads(body)
            except ValueError as e:
                raise SourceUnavailable(
                    f"{self.url}: manifest {repo}:{reference} is not JSON", source=self.url
                ) from e
            media = doc.get("mediaType") or response.headers.get("Content-Type", "")
            if media in IMAGE_INDEX_TYPES or "manifests" in doc:
                here = [
                    m
                    for m in doc.get("manifests") or []
                    if (m.get("platform") or {}).get("os", "linux") == "linux"
                    and (m.get("platform") or {}).get("architecture") == _architecture()
                ]
                if not here:
                    return None
                reference = str(here[0]["digest"])
                continue
            layers = doc.get("layers") or []
            if any(str(d.get("mediaType", "")).startswith("application/vnd.erofs") for d in layers):
                return None  # a dsec layer, not an image
            return _digest_of(body), doc
        return None

    def find_image(self, image: str) -> str | None:
        repo, reference = self._image_repo(image)
        if not all(_COMPONENT.fullmatch(c) for c in repo.split("/")):
            return None
        found = self._image_manifest(repo, reference)
        return None if found is None else found[0]

    def fetch_image(self, image: str, dest: Path | None) -> dict[str, Any]:
        repo, reference = self._image_repo(image)
        found = self._image_manifest(repo, reference)
        if found is None:
            raise UnknownImage(f"{self.url} holds no image {image!r}", name=image)
        _digest, manifest = found
        config_desc = manifest["config"]
        config_size = int(config_desc["size"])
        if config_size > MAX_MANIFEST:
            raise SourceUnavailable(
                f"{self.url}: the config of image {image!r} is over {MAX_MANIFEST} bytes",
                source=self.url,
            )
        config_blob = self._read_range(repo, str(config_desc["digest"]), 0, config_size)
        if _digest_of(config_blob) != config_desc["digest"]:
            raise LayerCorrupt(
                f"{self.url}: the config of image {image!r} does not match its digest",
                digest=str(config_desc["digest"]),
                source=self.url,
            )
        config = json.loads(config_blob)
        if dest is not None:
            blobs = dest / "blobs" / "sha256"
            blobs.mkdir(parents=True, exist_ok=True)
            (blobs / str(config_desc["digest"]).split(":", 1)[1]).write_bytes(config_blob)
            for desc in manifest.get("layers", []):
                blob = str(desc["digest"])
                fetch_verified(
                    functools.partial(self._read_range, repo, blob),
                    digest=blob,
                    size=int(desc["size"]),
                    dest=blobs / blob.split(":", 1)[1],
                    source=self.url,
                )
            raw = json.dumps(manifest).encode()
            (blobs / _digest_of(raw).split(":", 1)[1]).write_bytes(raw)
            entry = {"mediaType": MANIFEST_MEDIA_TYPE, "digest": _digest_of(raw), "size": len(raw)}
            (dest / "index.json").write_text(json.dumps({"schemaVersion": 2, "manifests": [entry]}))
            (dest / "oci-layout").write_text('{"imageLayoutVersion": "1.0.0"}')
        return dict(config.get("config") or {})

    def image_path(self, info: LayerInfo) -> Path:
        if self.cache_dir is None:
            raise InvalidSpec(f"layer source {self.url} needs a cache directory to fetch into")
        dest = self.cache_dir / f"{info.digest.split(':', 1)[-1]}.erofs"
        if dest.exists():  # only fetch_verified puts files here, after checking them
            return dest
        repo = self._repo(info.name)
        size = self._blob_size(repo, info.digest)
        if size is None:
            raise UnknownLayer(
                f"{self.url}: layer {info.ref} names blob {info.digest}, which "
                f"is missing from {repo}",
                name=info.ref,
            )
        if size != info.size:
            raise LayerCorrupt(
                f"{self.url}: blob {info.digest} is {size} bytes, the layer "
                f"record says {info.size}",
                digest=info.digest,
                source=self.url,
            )
        return fetch_verified(
            lambda off, n: self._read_range(repo, info.digest, off, n),
            digest=info.digest,
            size=size,
            dest=dest,
            source=self.url,
        )

    def push(self, info: LayerInfo, image: Path, *, profile: ReadProfile | None = None) -> bool:
        if not self._representable(info.name, info.version):
            raise InvalidSpec(
                f"{self.url}: layer {info.ref} cannot be an OCI repository and "
                "tag (names: lowercase letters, digits, . _ -)",
                name=info.ref,
            )
        repo, tag = self._repo(info.name), self._tag(info.version)
        manifest = self._manifest(repo, tag)
        if manifest is not None:
            existing = self._info(manifest)
            if existing is None or (existing.name, existing.version) != (info.name, info.version):
                raise LayerExists(
                    f"{self.url}: {repo}:{tag} already holds something other than {info.ref}",
                    name=info.ref,
                )
            if existing.digest != info.digest:
                raise LayerExists(
                    f"{self.url}: {info.ref} is already {existing.digest}, not "
                    f"{info.digest}; versions are immutable",
                    name=info.ref,
                )
            return False
        size = Path(image).stat().st_size
        if size != info.size:
            raise LayerCorrupt(
                f"{image} is {size} bytes, the layer record says {info.size}",
                digest=info.digest,
                source=str(image),
            )
        self._upload(repo, info.digest, size, Path(image))
        self._push_lazy(repo, info, Path(image), profile)
        created = info.created or time.time()
        self._put_manifest(
            repo,
            tag,
            [
                {
                    "mediaType": LAYER_MEDIA_TYPE,
                    "digest": info.digest,
                    "size": size,
                    "annotations": {
                        "org.opencontainers.image.title": f"{info.name}-{info.version}.erofs"
                    },
                }
            ],
            {
                ANNOTATION_PREFIX + "name": info.name,
                ANNOTATION_PREFIX + "version": info.version,
                ANNOTATION_PREFIX + "kind": info.kind,
                ANNOTATION_PREFIX + "created": repr(float(created)),
                ANNOTATION_PREFIX + "source": info.source,
                "org.opencontainers.image.created": _rfc3339(created),
            },
        )
        return True

    @staticmethod
    def _lazy_tag(layer_digest: str) -> str:
        return LAZY_TAG_PREFIX + layer_digest.split(":", 1)[-1]

    def _push_lazy(
        self, repo: str, info: LayerInfo, image: Path, profile: ReadProfile | None = None
    ) -> None:
        """Split the image and push its lazy form, unless ``repo`` has it already."""
        tag = self._lazy_tag(info.digest)
        if self._manifest(repo, tag) is not None:
            return
        with split_for_publishing(info, image, self.url, profile, self.compression) as split:
            if split is None:
                return
            form, meta, blob = split
            index = form.to_json().encode()
            index_digest = _digest_of(index)
            hexpart = info.digest.split(":", 1)[-1][:12]
            self._upload(repo, form.meta_digest, form.meta_size, meta)
            self._upload(repo, form.blob_digest, form.blob_size, blob)
            self._upload(repo, index_digest, len(index), index)
            self._put_manifest(
                repo,
                tag,
                [
                    {
                        "mediaType": META_MEDIA_TYPE,
                        "digest": form.meta_digest,
                        "size": form.meta_size,
                        "annotations": {"org.opencontainers.image.title": f"{hexpart}.meta.erofs"},
                    },
                    {
                        "mediaType": BLOB_MEDIA_TYPE,
                        "digest": form.blob_digest,
                        "size": form.blob_size,
                        "annotations": {"org.opencontainers.image.title": f"{hexpart}.blob"},
                    },
                    {
                        "mediaType": CHUNK_INDEX_MEDIA_TYPE,
                        "digest": index_digest,
                        "size": len(index),
                        "annotations": {"org.opencontainers.image.title": f"{hexpart}.lazy.json"},
                    },
                ],
                {
                    ANNOTATION_PREFIX + "digest": info.digest,
                    "org.opencontainers.image.created": _rfc3339(time.time()),
                },
            )
            self._remember(repo, form)

    # --- on-demand loading ----------------------------------------------------------------
    def _remember(self, repo: str, form: LazyForm) -> None:
        self._blob_repos[form.meta_digest] = (repo, form.meta_size)
        self._blob_repos[form.blob_digest] = (repo, form.blob_size)

    def _blob_repo(self, digest: str) -> tuple[str, int]:
        try:
            return self._blob_repos[digest]
        except KeyError:
            raise UnknownLayer(
                f"{self.url}: blob {digest} is not part of a lazy form this "
                "source has looked up (call lazy_form first)",
                digest=digest,
            ) from None

    def lazy_form(self, info: LayerInfo) -> LazyForm | None:
        if not self._representable(info.name, info.version):
            return None
        repo = self._repo(info.name)
        manifest = self._manifest(repo, self._lazy_tag(info.digest))
        if manifest is None:
            return None  # pushed whole only
        if (manifest.get("annotations") or {}).get(ANNOTATION_PREFIX + "digest") != info.digest:
            raise LayerCorrupt(
                f"{self.url}: {repo}:{self._lazy_tag(info.digest)} is not the "
                f"lazy form of {info.digest}",
                digest=info.digest,
                source=self.url,
            )
        by_type: dict[str, dict] = {}
        for b in manifest.get("layers") or []:
            if isinstance(b, dict):
                by_type.setdefault(str(b.get("mediaType")), b)
        wanted = (META_MEDIA_TYPE, BLOB_MEDIA_TYPE, CHUNK_INDEX_MEDIA_TYPE)
        if not all(t in by_type for t in wanted):
            raise LayerCorrupt(
                f"{self.url}: the lazy form of {info.ref} lacks a metadata "
                "image, data blob or chunk index",
                digest=info.digest,
                source=self.url,
            )
        digest = by_type[CHUNK_INDEX_MEDIA_TYPE]["digest"]
        response = self._request("GET", self._blob_url(repo, digest), ok=(200, 404))
        if response.status_code == 404:
            raise UnknownLayer(
                f"{self.url}: the chunk index {digest} of {info.ref} is missing from {repo}",
                name=info.ref,
            )
        if _digest_of(response.content) != digest:
            raise LayerCorrupt(
                f"{self.url}: the chunk index of {info.ref} does not match its digest {digest}",
                digest=digest,
                source=self.url,
            )
        form = LazyForm.from_json(response.content)
        meta, blob = by_type[META_MEDIA_TYPE], by_type[BLOB_MEDIA_TYPE]
        if (
            form.layer_digest != info.digest
            or form.meta_digest != meta.get("digest")
            or form.blob_digest != blob.get("digest")
            or form.meta_size != meta.get("size")
            or form.blob_size != blob.get("size")
        ):
            raise LayerCorrupt(
                f"{self.url}: the lazy form of {info.ref} disagrees with its manifest",
                digest=info.digest,
                source=self.url,
            )
        self._remember(repo, form)
        return form

    def fetch_meta(self, form: LazyForm) -> Path:
        dest = self._meta_dest(form)
        if dest.exists():  # only fetch_verified puts files here, after checking them
            return dest
        repo, _ = self._blob_repo(form.meta_digest)
        return self._fetch_meta_checked(
            form,
            self._blob_size(repo, form.meta_digest),
            lambda off, n: self._read_range(repo, form.meta_digest, off, n),
            f" from {repo}",
        )

    def read_blob(self, digest: str, offset: int, length: int) -> bytes:
        repo, size = self._blob_repo(digest)
        # Ranges are clamped to the blob: distribution answers a range running past the end
        # with a Content-Length it then does not send.
        length = min(length, size - offset)
        if length <= 0 or offset < 0:
            return b""
        response = self._request(
            "GET",
            self._blob_url(repo, digest),
            ok=(200, 206, 404, 416),
            headers={"Range": f"bytes={offset}-{offset + length - 1}"},
        )
        if response.status_code == 404:
            raise UnknownLayer(f"{self.url}: no blob {digest} in {repo}", digest=digest)
        if response.status_code == 416:
            return b""
        if response.status_code == 200:  # a registry that ignores Range sends the whole blob
            return response.content[offset : offset + length]
        return response.content

    # --- catalogs -------------------------------------------------------------------------
    def put_catalog(self, name: str, document: dict[str, Any]) -> None:
        if not _COMPONENT.fullmatch(name):
            raise InvalidSpec(
                f"{self.url}: catalog name {name!r} cannot be an OCI repository "
                "(lowercase letters, digits, . _ -)",
                name=name,
            )
        data = json.dumps(document, indent=2).encode()
        digest = _digest_of(data)
        repo = self._repo(CATALOG_REPO, name)
        self._upload(repo, digest, len(data), data)
        self._put_manifest(
            repo,
            "latest",
            [
                {
                    "mediaType": CATALOG_MEDIA_TYPE,
                    "digest": digest,
                    "size": len(data),
                    "annotations": {"org.opencontainers.image.title": f"{name}.json"},
                }
            ],
            {CATALOG_ANNOTATION: name, "org.opencontainers.image.created": _rfc3339(time.time())},
        )

    def get_catalog(self, name: str) -> dict[str, Any]:
        repo = self._repo(CATALOG_REPO, name)
        manifest = self._manifest(repo, "latest") if _COMPONENT.fullmatch(name) else None
        blobs = [
            b
            for b in (manifest or {}).get("layers") or []
            if b.get("mediaType") == CATALOG_MEDIA_TYPE
        ]
        if not blobs:
            raise UnknownEnvironment(
                f"{self.url}: no catalog {name!r}", name=name, known=self.catalogs()
            )
        digest = blobs[0]["digest"]
        data = self._request("GET", self._blob_url(repo, digest)).content
        if _digest_of(data) != digest:
            raise LayerCorrupt(
                f"{self.url}: catalog {name!r} does not match its digest {digest}",
                digest=digest,
                source=self.url,
            )
        return json.loads(data)

    def catalogs(self) -> builtins.list[str]:
        start = self._repo(CATALOG_REPO) + "/"
        return sorted(
            r[len(start) :]
            for r in self._repositories()
            if r.startswith(start) and "/" not in r[len(start) :]
        )


@hookimpl
def dsec_register_layer_sources(register):
    register(OciLayerSource)
