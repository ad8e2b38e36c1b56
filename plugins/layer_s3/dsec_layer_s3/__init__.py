"""dsec layer source plugin: layers in an S3 bucket, shared by every node that can reach it.

``s3://bucket/optional/prefix?endpoint=http://127.0.0.1:9000&region=us-east-1&profile=name``
holds the ``BlobStoreSource`` layout under the prefix. ``endpoint``, ``region`` and
``profile`` are optional; credentials come from boto3's usual chain (environment, ~/.aws,
instance metadata). botocore errors are translated here: a missing key is ``KeyError`` (the
base class contract), everything else that stops us reaching the data is ``SourceUnavailable``.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

from botocore.config import Config
from botocore.exceptions import (
    BotoCoreError,
    ClientError,
    NoCredentialsError,
    PartialCredentialsError,
)

from dsec_core.errors import InvalidSpec, SourceUnavailable
from dsec_core.hookspecs import hookimpl
from dsec_core.sources.base import BlobStoreSource

#: The dsec plugin API this plugin is written for (docs/plugins/index.md, "Writing a plugin").
DSEC_PLUGIN_API = 2

__all__ = ["S3LayerSource"]

_MISSING = {"NoSuchKey", "404", "NotFound"}
_REFUSED = {
    "AccessDenied",
    "403",
    "Forbidden",
    "InvalidAccessKeyId",
    "SignatureDoesNotMatch",
    "ExpiredToken",
    "InvalidToken",
    "TokenRefreshRequired",
    "AuthorizationHeaderMalformed",
}
_OPTIONS = {"endpoint", "region", "profile"}


class S3LayerSource(BlobStoreSource):
    """Layers in an S3 bucket (any S3-protocol server)."""

    scheme = "s3"
    # Short timeouts and few retries: an unreachable source should fail in seconds, so the node
    # can say so (or move on to its next source) instead of hanging for minutes.
    connect_timeout = 5
    read_timeout = 30
    max_attempts = 2
    # Blobs above this size go up in parts of this size (S3 allows at most 10000 parts).
    multipart_threshold = 16 << 20
    multipart_chunksize = 16 << 20
    list_page_size = 1000  # keys per list_objects_v2 request (1000 is S3's maximum)

    def __init__(self, location: str = "", *, cache_dir: Path | None = None) -> None:
        super().__init__(location, cache_dir=cache_dir)
        parts = urlsplit(f"s3://{location}")
        if not parts.netloc:
            raise InvalidSpec(
                f"s3 layer source needs a bucket: s3://BUCKET/prefix, got {self.url!r}"
            )
        query = {k: v[-1] for k, v in parse_qs(parts.query, keep_blank_values=True).items()}
        unknown = sorted(set(query) - _OPTIONS)
        if unknown:
            raise InvalidSpec(
                f"{self.url}: unknown option(s) {', '.join(unknown)} (known: "
                f"{', '.join(sorted(_OPTIONS))})"
            )
        self.bucket = parts.netloc
        prefix = parts.path.strip("/")
        self.prefix = f"{prefix}/" if prefix else ""
        self.endpoint = query.get("endpoint") or None
        self.region = query.get("region") or None
        self.profile = query.get("profile") or None
        self._client: Any = None
        self._lock = threading.Lock()

    # --- the client -----------------------------------------------------------------------
    @property
    def client(self) -> Any:
        """The boto3 S3 client, made on first use (so opening a source never touches the net)."""
        with self._lock:
            if self._client is None:
                self._client = self._make_client()
            return self._client

    def _make_client(self) -> Any:
        # boto3 takes ~0.4 s to import; every dsec command loads this plugin, few use S3.
        import boto3

        s3_options = {"addressing_style": "path"} if self.endpoint else {}
        config = Config(
            connect_timeout=self.connect_timeout,
            read_timeout=self.read_timeout,
            retries={"max_attempts": self.max_attempts, "mode": "standard"},
            s3=s3_options,
            # S3-compatible servers differ in which flexible checksums they accept;
            # only send them where the protocol requires. Integrity of layers is
            # checked end to end by sha256 anyway.
            request_checksum_calculation="when_required",
            response_checksum_validation="when_required",
        )
        try:
            session = boto3.session.Session(profile_name=self.profile, region_name=self.region)
            return session.client("s3", endpoint_url=self.endpoint, config=config)
        except BotoCoreError as e:  # an unknown profile, a malformed endpoint, ...
            raise SourceUnavailable(
                f"{self.url}: cannot set up an S3 client: {e}", source=self.url
            ) from e

    def _key(self, key: str) -> str:
        return self.prefix + key

    @contextlib.contextmanager
    def _edge(self, key: str | None = None) -> Iterator[None]:
        """Translate botocore errors: a missing key -> KeyError, the rest -> SourceUnavailable."""
        try:
            yield
        except ClientError as e:
            err = e.response.get("Error", {})
            code = str(err.get("Code", ""))
            status = e.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
            if code == "NoSuchBucket":
                raise SourceUnavailable(
                    f"{self.url}: bucket {self.bucket!r} does not exist", source=self.url
                ) from e
            if key is not None and (code in _MISSING or status == 404):
                raise KeyError(key) from e
            if code in _REFUSED or status == 403:
                raise SourceUnavailable(
                    f"{self.url}: the S3 server refused our credentials "
                    f"({code or status}: {err.get('Message', '')})".rstrip(),
                    source=self.url,
                ) from e
            raise SourceUnavailable(
                f"{self.url}: S3 request failed: {code or status}: {err.get('Message', e)}",
                source=self.url,
            ) from e
        except (NoCredentialsError, PartialCredentialsError) as e:
            raise SourceUnavailable(
                f"{self.url}: no S3 credentials found ({e}); set "
                "AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, ~/.aws or "
                "?profile=",
                source=self.url,
            ) from e
        except BotoCoreError as e:  # connection refused, timeouts, DNS, ...
            raise SourceUnavailable(
                f"{self.url}: cannot reach the S3 server: {e}", source=self.url
            ) from e

    # --- primitives -----------------------------------------------------------------------
    def _read(self, key: str, offset: int = 0, length: int | None = None) -> bytes:
        if length is not None and length <= 0:
            return b""
        args: dict[str, Any] = {"Bucket": self.bucket, "Key": self._key(key)}
        if offset or length is not None:
            end = "" if length is None else str(offset + length - 1)
            args["Range"] = f"bytes={offset}-{end}"
        try:
            with self._edge(key):
                resp = self.client.get_object(**args)
                body = resp["Body"]
                try:
                    return body.read()
                finally:
                    body.close()
        except SourceUnavailable as e:
            # A range starting past the end of the object: it is shorter than asked, which
            # the caller sees as a short read (and so a truncated blob).
            cause = e.__cause__
            if isinstance(cause, ClientError) and (
                cause.response.get("Error", {}).get("Code") == "InvalidRange"
                or cause.response.get("ResponseMetadata", {}).get("HTTPStatusCode") == 416
            ):
                return b""
            raise

    def _write(self, key: str, data: bytes | Path) -> None:
        # An S3 PUT (and a completed multipart upload) replaces the object atomically.
        with self._edge():
            if isinstance(data, Path):
                # Lazily, as in _make_client: boto3 is slow to import.
                from boto3.exceptions import S3UploadFailedError
                from boto3.s3.transfer import TransferConfig

                transfer = TransferConfig(
                    multipart_threshold=self.multipart_threshold,
                    multipart_chunksize=self.multipart_chunksize,
                    max_concurrency=4,
                )
                try:
                    self.client.upload_file(str(data), self.bucket, self._key(key), Config=transfer)
                except S3UploadFailedError as e:
                    # boto3 wraps the ClientError (implicitly chained); unwrap it for _edge.
                    if isinstance(e.__context__, ClientError):
                        raise e.__context__ from None
                    raise SourceUnavailable(
                        f"{self.url}: upload of {key} failed: {e}", source=self.url
                    ) from e
            else:
                self.client.put_object(Bucket=self.bucket, Key=self._key(key), Body=data)

    def _size(self, key: str) -> int | None:
        try:
            with self._edge(key):
                return int(
                    self.client.head_object(Bucket=self.bucket, Key=self._key(key))["ContentLength"]
                )
        except KeyError:
            return None

    def _keys(self, prefix: str) -> list[str]:
        out: list[str] = []
        with self._edge():
            pages = self.client.get_paginator("list_objects_v2").paginate(
                Bucket=self.bucket,
                Prefix=self._key(prefix),
                PaginationConfig={"PageSize": self.list_page_size},
            )
            for page in pages:
                out.extend(obj["Key"][len(self.prefix) :] for obj in page.get("Contents", []))
        return sorted(out)


@hookimpl
def dsec_register_layer_sources(register):
    register(S3LayerSource)
