"""The shelf layer source runs dsec's conformance kit (opted into by pyproject.toml)."""

import pytest
from dsec_layer_shelf import ShelfLayerSource

from dsec_core.plugins import open_source
from dsec_core.testing import LayerSourceConformance


class TestShelf(LayerSourceConformance):
    @pytest.fixture
    def dsec_source(self, tmp_path):
        (tmp_path / "shelf").mkdir()
        return ShelfLayerSource(str(tmp_path / "shelf"), cache_dir=tmp_path / "cache")

    def corrupt(self, source, digest, how):
        blob = source.root / source.blob_key(digest)
        data = bytearray(blob.read_bytes())
        if how == "flip":
            data[len(data) // 2] ^= 0xFF
        else:
            del data[len(data) // 2 :]
        blob.write_bytes(bytes(data))

    def unreachable(self, tmp_path):
        return ShelfLayerSource(str(tmp_path / "gone"), cache_dir=tmp_path / "cache")

    def test_push_keeps_the_layout(self, dsec_source, dsec_store, dsec_layer):
        dsec_source.push(dsec_layer, dsec_store.image_path(dsec_layer))
        ref = dsec_source.ref_key(dsec_layer.name, dsec_layer.version)
        assert (dsec_source.root / ref).is_file()


def test_the_entry_point_registers_the_scheme(tmp_path):
    assert isinstance(open_source(f"shelf:{tmp_path}"), ShelfLayerSource)
