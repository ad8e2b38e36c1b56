"""The shelf layer source runs dsec's conformance kit (which dsec loads into every pytest run)."""

import pytest
from dsec_layer_shelf import ShelfLayerSource

from dsec_core.layers.sources import open_source
from dsec_core.testing.sources import LayerSourceConformance


class TestShelf(LayerSourceConformance):
    @pytest.fixture
    def source(self, tmp_path):
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

    def test_push_keeps_the_layout(self, source, store, layer):
        source.push(layer, store.image_path(layer))
        assert (source.root / source.ref_key(layer.name, layer.version)).is_file()


def test_the_entry_point_registers_the_scheme(tmp_path):
    assert isinstance(open_source(f"shelf:{tmp_path}"), ShelfLayerSource)
