"""The layer-source conformance kit: every layer-source plugin subclasses
``LayerSourceConformance``.

    class TestMySource(LayerSourceConformance):
        @pytest.fixture
        def dsec_source(self, tmp_path): ...       # a fresh, empty, writable source
        def corrupt(self, source, digest, how): ...  # damage a stored blob ("flip"/"truncate")
        def unreachable(self, tmp_path): ...       # a source whose server is not there

The checks publish real EROFS layers and fetch them back: naming and versions, idempotent
pushes, immutable versions, byte-for-byte verification (damaged or truncated blobs never reach
the cache), catalogs, lazy forms, None or ``UnknownLayer`` for what is not there, and fast,
typed failures (``SourceUnavailable`` naming the source) from every call when the source is
gone.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from ..errors import LayerCorrupt, LayerExists, SourceUnavailable, UnknownEnvironment, UnknownLayer
from ..layers.build import build_layer
from ..layers.store import LayerStore
from ..records import LayerInfo, LayerRef
from ..sources.base import LayerSource
from ..sources.chain import find_layer
from ..sources.local import LocalLayerSource

__all__ = ["LayerSourceConformance"]

UNREACHABLE_WITHIN = 10.0  # seconds a source that is gone may take to say so
NO_SUCH_DIGEST = "sha256:" + "0" * 64


def _build(store: LayerStore, tmp: Path, name: str, version: str, payload: bytes) -> LayerInfo:
    src = tmp / f"src-{name}-{version}-{hashlib.sha256(payload).hexdigest()[:8]}"
    (src / "data").mkdir(parents=True)
    (src / "data" / "payload.bin").write_bytes(payload)
    (src / "data" / "small.txt").write_text(f"{name} {version}\n")
    return build_layer(src, name=name, version=version, kind="workspace", store=store)


class LayerSourceConformance:
    """Behaviour every dsec layer source must show."""

    # --- what a subclass provides ---------------------------------------------------------
    @pytest.fixture
    def dsec_source(self, tmp_path) -> LayerSource:
        raise NotImplementedError("override the `dsec_source` fixture: a fresh, empty source")

    def corrupt(self, source: LayerSource, digest: str, how: str) -> None:
        """Damage the stored blob ``digest``: ``how`` is "flip" (one byte) or "truncate"."""
        raise NotImplementedError

    def unreachable(self, tmp_path: Path) -> LayerSource:
        """A source of this kind whose server (or mount) is not there."""
        raise NotImplementedError

    # --- shared fixtures ------------------------------------------------------------------
    @pytest.fixture
    def dsec_store(self, tmp_path) -> LayerStore:
        return LayerStore(tmp_path / "kit-store")

    @pytest.fixture
    def dsec_layer(self, dsec_store, tmp_path) -> LayerInfo:
        # bigger than one fetch chunk would be slow to push everywhere; 3 MiB exercises ranges
        return _build(dsec_store, tmp_path, "kit-ws", "1", bytes(range(256)) * 12288)

    # --- checks ---------------------------------------------------------------------------
    def test_push_then_resolve_and_list(self, dsec_source, dsec_store, dsec_layer, tmp_path):
        assert dsec_source.push(dsec_layer, dsec_store.image_path(dsec_layer)) is True
        newer = _build(dsec_store, tmp_path, "kit-ws", "2", b"second version")
        time.sleep(0.01)
        dsec_source.push(newer, dsec_store.image_path(newer))
        assert dsec_source.resolve(LayerRef("kit-ws", "1")).digest == dsec_layer.digest
        assert dsec_source.resolve(LayerRef("kit-ws")).version == "2"  # unversioned: newest
        assert dsec_source.resolve(LayerRef("kit-absent", "1")) is None
        assert {i.ref for i in dsec_source.list()} >= {"kit-ws@1", "kit-ws@2"}
        got = dsec_source.resolve(LayerRef("kit-ws", "1"))
        assert (got.kind, got.size) == (dsec_layer.kind, dsec_layer.size)

    def test_pushing_again_is_a_noop_and_versions_are_immutable(
        self, dsec_source, dsec_store, dsec_layer, tmp_path
    ):
        dsec_source.push(dsec_layer, dsec_store.image_path(dsec_layer))
        assert dsec_source.push(dsec_layer, dsec_store.image_path(dsec_layer)) is False
        other_store = LayerStore(tmp_path / "other-store")
        impostor = _build(other_store, tmp_path, "kit-ws", "1", b"not the same content")
        with pytest.raises(LayerExists):
            dsec_source.push(impostor, other_store.image_path(impostor))
        assert dsec_source.resolve(LayerRef("kit-ws", "1")).digest == dsec_layer.digest

    def test_fetch_is_verified_byte_for_byte(self, dsec_source, dsec_store, dsec_layer):
        dsec_source.push(dsec_layer, dsec_store.image_path(dsec_layer))
        info = dsec_source.resolve(LayerRef("kit-ws", "1"))
        path = dsec_source.image_path(info)
        data = Path(path).read_bytes()
        assert "sha256:" + hashlib.sha256(data).hexdigest() == dsec_layer.digest
        assert data == dsec_store.image_path(dsec_layer).read_bytes()

    @pytest.mark.parametrize("how", ["flip", "truncate"])
    def test_damaged_blob_never_reaches_the_cache(self, dsec_source, dsec_store, dsec_layer, how):
        dsec_source.push(dsec_layer, dsec_store.image_path(dsec_layer))
        self.corrupt(dsec_source, dsec_layer.digest, how)
        info = dsec_source.resolve(LayerRef("kit-ws", "1"))
        with pytest.raises(LayerCorrupt):
            dsec_source.image_path(info)
        if dsec_source.cache_dir is not None and dsec_source.cache_dir.exists():
            assert [p for p in dsec_source.cache_dir.rglob("*") if p.is_file()] == []

    def test_catalogs(self, dsec_source):
        doc: dict[str, Any] = {
            "name": "kit-catalog",
            "layers": [],
            "environments": [{"name": "kit-env", "base": "kit-ws@1"}],
        }
        dsec_source.put_catalog("kit-catalog", doc)
        assert "kit-catalog" in dsec_source.catalogs()
        assert dsec_source.get_catalog("kit-catalog") == doc
        doc["environments"][0]["base"] = "kit-ws@2"
        dsec_source.put_catalog("kit-catalog", doc)  # replaced, not duplicated
        assert dsec_source.get_catalog("kit-catalog")["environments"][0]["base"] == "kit-ws@2"
        with pytest.raises(UnknownEnvironment) as e:
            dsec_source.get_catalog("kit-missing")
        assert "kit-catalog" in str(e.value)

    def test_first_source_holding_a_layer_wins(self, dsec_source, dsec_store, dsec_layer, tmp_path):
        local = LocalLayerSource(str(tmp_path / "kit-local"))
        dsec_source.push(dsec_layer, dsec_store.image_path(dsec_layer))
        assert find_layer([local, dsec_source], "kit-ws@1")[0] is dsec_source
        local.push(dsec_layer, dsec_store.image_path(dsec_layer))
        assert find_layer([local, dsec_source], "kit-ws@1")[0] is local

    def test_a_source_away_is_passed_over_for_one_that_has_the_layer(
        self, dsec_store, dsec_layer, tmp_path
    ):
        """Found by the chaos soak: with this source down, a node could not restore the
        snapshot it had just packed into its own store (asked after it)."""
        gone = self.unreachable(tmp_path)
        local = LocalLayerSource(str(tmp_path / "kit-local"))
        with pytest.raises(SourceUnavailable):  # nobody else has it: it may be there
            find_layer([gone, local], "kit-ws@1")
        local.push(dsec_layer, dsec_store.image_path(dsec_layer))
        assert find_layer([gone, local], "kit-ws@1")[0] is local

    def test_lazy_form_is_published_and_readable_by_chunk(
        self, dsec_source, dsec_store, dsec_layer
    ):
        dsec_source.push(dsec_layer, dsec_store.image_path(dsec_layer))
        info = dsec_source.resolve(LayerRef("kit-ws", "1"))
        form = dsec_source.lazy_form(info)
        if form is None:
            pytest.skip(f"{type(dsec_source).__name__} publishes whole images only")
        assert form.layer_digest == dsec_layer.digest
        meta = Path(dsec_source.fetch_meta(form)).read_bytes()
        assert "sha256:" + hashlib.sha256(meta).hexdigest() == form.meta_digest
        index = form.index
        for i in (0, len(index.chunks) - 1):  # first and last (short) chunk
            offset, length = index.stored_range(i)
            data = index.decode(i, dsec_source.read_blob(index.blob_digest, offset, length))
            assert "sha256:" + hashlib.sha256(data).hexdigest() == index.chunks[i]

    def test_what_is_not_there_is_none_or_unknown_layer(self, dsec_source, dsec_store, dsec_layer):
        assert dsec_source.resolve(LayerRef("kit-absent", "1")) is None
        assert dsec_source.resolve(LayerRef("kit-absent")) is None
        assert dsec_source.lazy_form(dsec_layer) is None  # not pushed: None, not an error
        with pytest.raises(UnknownLayer):
            dsec_source.image_path(dsec_layer)
        with pytest.raises(UnknownLayer):
            dsec_source.read_blob(NO_SUCH_DIGEST, 0, 100)
        dsec_source.push(dsec_layer, dsec_store.image_path(dsec_layer))
        with pytest.raises(UnknownLayer):
            dsec_source.read_blob(NO_SUCH_DIGEST, 0, 100)
        form = dsec_source.lazy_form(dsec_source.resolve(LayerRef("kit-ws", "1")))
        if form is not None:
            with pytest.raises(UnknownLayer):
                dsec_source.fetch_meta(replace(form, meta_digest=NO_SUCH_DIGEST))

    def test_a_source_that_is_gone_fails_fast_and_typed(self, tmp_path, dsec_store, dsec_layer):
        # read_blob is not among these: a source may only know where a blob is once
        # lazy_form has found its form (the OCI source does), which a gone source cannot.
        gone = self.unreachable(tmp_path)
        image = dsec_store.image_path(dsec_layer)
        calls: dict[str, Callable[[], object]] = {
            "list": gone.list,
            "resolve": lambda: gone.resolve(LayerRef("kit-ws", "1")),
            "catalogs": gone.catalogs,
            "get_catalog": lambda: gone.get_catalog("kit-catalog"),
            "image_path": lambda: gone.image_path(dsec_layer),
            "lazy_form": lambda: gone.lazy_form(dsec_layer),
        }
        if not gone.read_only:
            calls["push"] = lambda: gone.push(dsec_layer, image)
            calls["put_catalog"] = lambda: gone.put_catalog("kit-catalog", {"name": "kit"})
        for what, call in calls.items():
            started = time.monotonic()
            with pytest.raises(SourceUnavailable) as e:
                call()
            took = time.monotonic() - started
            assert took < UNREACHABLE_WITHIN, f"{what} took {took:.1f}s to give up"
            assert e.value.source, f"{what}: SourceUnavailable must name the source"
        if gone.cache_dir is not None and gone.cache_dir.exists():
            assert [p for p in gone.cache_dir.rglob("*") if p.is_file()] == []
