"""Fixtures of the builder's tests: a real node (the kit's) holding the default catalog's
``python`` environment, whose layers come from the machine's built default catalog."""

from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from dsec_builder import BuildContext

from dsec_core.catalog.model import Catalog
from dsec_core.catalog.store import CatalogStore
from dsec_core.config import NodeConfig
from dsec_core.errors import DsecError
from dsec_core.layers.store import LayerStore
from dsec_core.sdk import Client
from dsec_core.testing import KitNode, running_kit_node

#: Where `run.sh test` builds the default catalog (debootstrap base) once per machine.
BUILT_HOME = Path(os.environ.get("DSEC_TEST_HOME", "/var/lib/dsec-test"))


def _copy_layer(src: LayerStore, dst: LayerStore, ref: str) -> None:
    info = src.resolve(ref)
    with dst.scratch("copy-") as tmp:
        image = Path(tmp) / "image.erofs"
        try:
            os.link(src.image_path(info), image)
        except OSError:  # another filesystem
            shutil.copyfile(src.image_path(info), image)
        dst.add(image, name=info.name, version=info.version, kind=info.kind, source=info.source)


def _install_python_env(node: KitNode) -> None:
    """Give ``node`` the default catalog's ``python`` environment (base + toolkit), from the
    machine's built default catalog; skips the test where that is not built."""
    if os.geteuid() != 0:
        pytest.skip("a dsec node needs root")
    built = NodeConfig(home=BUILT_HOME)
    try:
        env = CatalogStore(built.catalog_dir).environment("python")
    except (DsecError, OSError):
        pytest.skip(f"the default catalog is not built in {BUILT_HOME} (dsec catalog build)")
    src, dst = LayerStore(built.layer_dir), LayerStore(node.config.layer_dir)
    for ref in env.layer_refs():
        _copy_layer(src, dst, ref)
    CatalogStore(node.config.catalog_dir).save(Catalog(name="default", environments=(env,)))


@pytest.fixture(scope="session")
def python_node() -> Iterator[KitNode]:
    """A kit node with the default catalog's ``python`` environment."""
    if os.geteuid() != 0:
        pytest.skip("a dsec node needs root")
    with running_kit_node("dsec-builder-") as node:
        _install_python_env(node)
        yield node


@pytest.fixture
def install_python_env() -> Callable[[KitNode], None]:
    """``install_python_env(node)``: the default catalog's ``python`` environment on a node
    a test started itself."""
    return _install_python_env


@pytest.fixture
def ctx(python_node: KitNode) -> Iterator[BuildContext]:
    """The builder's context on the node: one client for the builder, another for QA."""
    builder = python_node.client()
    runtime = Client(os.fspath(python_node.config.socket_path))
    context = BuildContext(python_node.home, builder, runtime)
    try:
        yield context
    finally:
        # every build a test left open: its session killed
        for record in context.store.list():
            with contextlib.suppress(DsecError):
                builder.kill(record.sandbox_id)
        context.close()
