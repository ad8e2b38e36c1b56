"""Authoring catalogs without friction: qualified names, imports, recipe fingerprints,
``catalog rm``, ``layer build --to``, and what the default catalog's bases ship (apt and pip
that fail fast without a mirror, toolkits with compiled ``.pyc``, a base for repository work).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

from dsec_core.catalog import (
    Catalog,
    CatalogStore,
    Environment,
    build_catalog,
    load_catalog,
    parse_catalog,
)
from dsec_core.catalog.distribution import publish_catalog
from dsec_core.cli.layers import catalog as catalog_cli
from dsec_core.cli.layers import layer as layer_cli
from dsec_core.config import NodeConfig
from dsec_core.errors import (
    AmbiguousName,
    CatalogInvalid,
    InvalidSpec,
    LayerStale,
    UnknownEnvironment,
    UnknownLayer,
    error_from_wire,
)
from dsec_core.layers.recipes import (
    APT_PLACEHOLDER,
    PIP_PLACEHOLDER,
    LayerRecipe,
    build_recipe,
    mirror_env,
    mirror_files,
    offline_files,
    recipe_fingerprint,
)
from dsec_core.layers.store import LayerStore
from dsec_core.plugins import registry
from dsec_core.records import LayerInfo

needs_root = pytest.mark.skipif(
    os.geteuid() != 0 or not shutil.which("mkfs.erofs"), reason="needs root and mkfs.erofs"
)


@pytest.fixture
def stores(home) -> tuple[LayerStore, CatalogStore]:
    return LayerStore(home / "layers"), CatalogStore(home / "catalogs")


def _write(path: Path, doc: dict) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(doc))
    return path


def base_catalog(root: Path, name: str = "base-cat", env: str = "shell") -> Path:
    """A catalog with a dir-only base layer and one environment, in ``root``."""
    (root / "rootfs/bin").mkdir(parents=True, exist_ok=True)
    (root / "rootfs/bin/marker").write_text(f"{name}\n")
    return _write(
        root / "catalog.yaml",
        {
            "name": name,
            "layers": [
                {
                    "name": f"{name}-base",
                    "version": "1",
                    "kind": "base",
                    "source": {"dir": "rootfs"},
                }
            ],
            "environments": [{"name": env, "base": f"{name}-base@1", "workdir": "/root"}],
        },
    )


def app_doc(imports: list[dict], base: str = "base-cat-base@1", task_env: str = "base-cat/shell"):
    """A catalog that uses an imported catalog's layer and environment."""
    return {
        "name": "app",
        "imports": imports,
        "layers": [
            {
                "name": "app-ws",
                "version": "1",
                "kind": "workspace",
                "source": {"dir": "ws", "to": "/workspace/app"},
            }
        ],
        "environments": [
            {"name": "app", "base": base, "workspaces": ["app-ws@1"], "workdir": "/workspace/app"}
        ],
        "tasks": [
            {"name": "own", "environment": "app", "command": "true", "reward": "exit_code"},
            {"name": "theirs", "environment": task_env, "command": "true", "reward": "exit_code"},
        ],
    }


def app_dir(tmp_path: Path) -> Path:
    root = tmp_path / "app"
    (root / "ws").mkdir(parents=True)
    (root / "ws/main.py").write_text("print('app')\n")
    return root


# --- qualified names -----------------------------------------------------------------------


def _register(store: CatalogStore, name: str, *envs: str) -> None:
    store.save(
        Catalog(name=name, environments=tuple(Environment(name=e, base="b@1") for e in envs))
    )


def test_bare_names_work_when_unique_and_ambiguous_ones_list_the_choices(tmp_path):
    store = CatalogStore(tmp_path / "catalogs")
    _register(store, "alpha", "python", "only-alpha")
    _register(store, "beta", "python")
    assert store.environment("only-alpha").catalog == "alpha"
    assert store.environment("alpha/python").catalog == "alpha"
    assert store.environment("beta/python").catalog == "beta"
    assert store.environment("alpha/only-alpha").qualified == "alpha/only-alpha"
    with pytest.raises(AmbiguousName) as e:
        store.environment("python")
    assert e.value.context["choices"] == ["alpha/python", "beta/python"]
    assert "alpha/python, beta/python" in str(e.value)
    assert e.value.http_status == 409
    # the error crosses HTTP by name, with its choices
    again = error_from_wire(json.loads(json.dumps(e.value.to_wire())))
    assert isinstance(again, AmbiguousName) and again.context["choices"] == e.value.choices
    with pytest.raises(UnknownEnvironment, match="known: only-alpha, python"):
        store.environment("gamma/python")
    with pytest.raises(UnknownEnvironment):
        store.environment("beta/only-alpha")
    # both are listed; neither shadows the other
    assert [e.qualified for e in store.environments()] == [
        "alpha/python",
        "alpha/only-alpha",
        "beta/python",
    ]
    assert store.shadowed(store.catalog("beta")) == ["alpha/python"]
    store.remove("beta")
    assert store.environment("python").catalog == "alpha"
    with pytest.raises(UnknownEnvironment, match="no catalog 'beta' is registered"):
        store.catalog("beta")


def test_ambiguous_task_names_too(tmp_path):
    store = CatalogStore(tmp_path / "catalogs")
    for name in ("one", "two"):
        doc = {
            "name": name,
            "environments": [{"name": "e", "base": "b@1"}],
            "tasks": [{"name": "t", "environment": "e", "command": "true", "reward": "exit_code"}],
        }
        store.save(parse_catalog(doc, check_layers=False))
    with pytest.raises(AmbiguousName, match="one/t, two/t"):
        store.task("t")
    task = store.task("two/t")
    assert task.catalog == "two" and task.qualified_environment == "two/e"
    assert store.environment(task.qualified_environment).catalog == "two"


# --- imports -------------------------------------------------------------------------------


@needs_root
def test_a_catalog_imports_another_by_path_and_uses_its_layers_and_environments(tmp_path, stores):
    layers, catalogs = stores
    base_catalog(tmp_path / "base")
    root = app_dir(tmp_path)
    file = _write(root / "catalog.yaml", app_doc([{"path": "../base/catalog.yaml"}]))
    cat = load_catalog(file, store=layers)
    assert [c.name for c in cat.imported] == ["base-cat"]
    assert cat.environment("base-cat/shell").workdir == "/root"
    assert cat.task("theirs").qualified_environment == "base-cat/shell"
    assert cat.task("own").qualified_environment == "app/app"
    infos = build_catalog(cat, layers, catalogs)
    assert [i.ref for i in infos] == ["app-ws@1"]  # its own layers ...
    assert layers.exists("base-cat-base@1")  # ... and the imported catalog's, built first
    assert [c.name for c in catalogs.catalogs()] == ["app", "base-cat"]  # both registered
    assert catalogs.environment("app").layer_refs() == ["app-ws@1", "base-cat-base@1"]
    assert catalogs.environment(catalogs.task("theirs").qualified_environment).catalog == (
        "base-cat"
    )
    saved = catalogs.catalog("app")
    assert saved.imports[0].path == "../base/catalog.yaml"  # the import is kept by name


def test_import_faults_name_the_import(tmp_path, stores):
    layers, catalogs = stores
    base_catalog(tmp_path / "base")
    root = app_dir(tmp_path)
    # a registered catalog that is not there
    file = _write(root / "catalog.yaml", app_doc([{"catalog": "base-cat"}]))
    with pytest.raises(CatalogInvalid, match=r"\$\.imports\[0\].*not registered.*catalog build"):
        load_catalog(file, store=layers, registered=catalogs.catalog)
    # a bare name of an imported environment: told to qualify it
    file = _write(
        root / "catalog.yaml", app_doc([{"path": "../base/catalog.yaml"}], task_env="shell")
    )
    with pytest.raises(CatalogInvalid, match=r"tasks\[1\]\.environment.*as base-cat/shell"):
        load_catalog(file)
    # a qualified name of a catalog it does not import
    file = _write(root / "catalog.yaml", app_doc([], task_env="base-cat/shell"))
    with pytest.raises(CatalogInvalid, match=r"base-cat-base@1 is neither.*import its catalog"):
        load_catalog(file)
    with pytest.raises(CatalogInvalid, match=r"unknown environment 'base-cat/shell'"):
        parse_catalog(app_doc([], task_env="base-cat/shell"), root=root, check_layers=False)
    # a cycle
    a, b = tmp_path / "cyc/a.yaml", tmp_path / "cyc/b.yaml"
    _write(a, {"name": "a", "imports": [{"path": "b.yaml"}]})
    _write(b, {"name": "b", "imports": [{"path": "a.yaml"}]})
    with pytest.raises(CatalogInvalid, match="import cycle"):
        load_catalog(a)
    # a malformed import and a file that is not there
    file = _write(root / "catalog.yaml", app_doc([{"path": "x.yaml", "catalog": "c"}]))
    with pytest.raises(CatalogInvalid, match=r"\$\.imports\[0\]: an import is"):
        load_catalog(file)
    file = _write(root / "catalog.yaml", app_doc([{"path": "nope.yaml"}]))
    with pytest.raises(CatalogInvalid, match=r"nope\.yaml does not exist"):
        load_catalog(file)


@needs_root
def test_a_catalog_imports_a_registered_catalog_and_one_from_a_layer_source(tmp_path, home):
    runner = CliRunner()
    base = base_catalog(tmp_path / "base")
    result = runner.invoke(catalog_cli, ["build", str(base)])
    assert result.exit_code == 0, result.output
    root = app_dir(tmp_path)
    file = _write(root / "catalog.yaml", app_doc([{"catalog": "base-cat"}]))
    result = runner.invoke(catalog_cli, ["build", str(file)])
    assert result.exit_code == 0, result.output
    assert "built    app-ws@1" in result.output

    # from a layer source: another node publishes it, this one has nothing of it yet
    layers = LayerStore(home / "layers")
    published = tmp_path / "published"
    published.mkdir()
    source = registry().open_source(f"posix:{published}", NodeConfig.from_env())
    publish_catalog(load_catalog(base), source, layers)
    result = runner.invoke(catalog_cli, ["rm", "base-cat"])
    assert result.exit_code == 0 and "its layers stay: base-cat-base@1" in result.output
    layers.remove("base-cat-base@1")
    file = _write(
        root / "catalog.yaml",
        app_doc([{"source": f"posix:{published}", "catalog": "base-cat"}]),
    )
    result = runner.invoke(catalog_cli, ["build", str(file)])
    assert result.exit_code == 0, result.output
    assert "pulled base-cat-base@1" in result.output and "registered catalog base-cat" in (
        result.output
    )
    listed = json.loads(runner.invoke(catalog_cli, ["ls", "--json"]).output)
    assert {e["qualified"] for e in listed["environments"]} == {"app/app", "base-cat/shell"}
    assert {t["qualified"] for t in listed["tasks"]} == {"app/own", "app/theirs"}


# --- recipe fingerprints -------------------------------------------------------------------


@needs_root
def test_a_changed_recipe_without_a_version_bump_is_stale(tmp_path, stores):
    layers, catalogs = stores
    file = base_catalog(tmp_path / "base")
    cat = load_catalog(file)
    (info,) = build_catalog(cat, layers, catalogs)
    assert info.recipe_digest == recipe_fingerprint(cat.layers[0])
    assert (
        json.loads((layers.ref_dir / "base-cat-base/1.json").read_text())["recipe_digest"]
        == info.recipe_digest
    )
    # unchanged (a touched file is not a change): present, as before
    time.sleep(0.01)
    os.utime(tmp_path / "base/rootfs/bin/marker")
    assert build_catalog(load_catalog(file), layers, catalogs) == [info]
    # changed content, same version: an error naming the layer
    (tmp_path / "base/rootfs/bin/marker").write_text("changed\n")
    with pytest.raises(LayerStale, match=r"base-cat-base@1.*bump its version") as e:
        build_catalog(load_catalog(file), layers, catalogs)
    assert e.value.context["ref"] == "base-cat-base@1"
    # the executable bit counts; __pycache__ and the rest of the mode do not
    (tmp_path / "base/rootfs/bin/marker").write_text("base-cat\n")
    assert recipe_fingerprint(load_catalog(file).layers[0]) == info.recipe_digest
    (tmp_path / "base/rootfs/bin/__pycache__").mkdir()
    (tmp_path / "base/rootfs/bin/__pycache__/x.pyc").write_bytes(b"junk")
    assert recipe_fingerprint(load_catalog(file).layers[0]) == info.recipe_digest
    (tmp_path / "base/rootfs/bin/marker").chmod(0o600)  # another umask: the same recipe
    assert recipe_fingerprint(load_catalog(file).layers[0]) == info.recipe_digest
    (tmp_path / "base/rootfs/bin/marker").chmod(0o755)  # executable now: changed
    assert recipe_fingerprint(load_catalog(file).layers[0]) != info.recipe_digest
    # the bump: a new layer, the old one kept
    doc = yaml.safe_load(file.read_text())
    doc["layers"][0]["version"] = "2"
    doc["environments"][0]["base"] = "base-cat-base@2"
    (new,) = build_catalog(load_catalog(_write(file, doc)), layers, catalogs)
    assert new.ref == "base-cat-base@2" and layers.exists("base-cat-base@1")
    # other source fields are inputs as well
    pip_a = LayerRecipe("t", "1", "toolkit", pip=None, dir="rootfs", root=str(tmp_path / "base"))
    pip_b = LayerRecipe("t", "1", "toolkit", dir="rootfs", to="/opt", root=str(tmp_path / "base"))
    assert recipe_fingerprint(pip_a) != recipe_fingerprint(pip_b)


@needs_root
def test_layers_built_before_fingerprints_are_never_called_stale(tmp_path, stores):
    layers, catalogs = stores
    file = base_catalog(tmp_path / "base")
    (info,) = build_catalog(load_catalog(file), layers, catalogs)
    ref_file = layers.ref_dir / "base-cat-base/1.json"
    old = json.loads(ref_file.read_text())
    del old["recipe_digest"]  # as an older dsec wrote it
    ref_file.write_text(json.dumps(old))
    assert layers.resolve("base-cat-base@1").recipe_digest == ""
    assert LayerInfo.from_dict(old).recipe_digest == ""
    (tmp_path / "base/rootfs/bin/marker").write_text("changed\n")
    (again,) = build_catalog(load_catalog(file), layers, catalogs)
    assert again.digest == info.digest  # unknown fingerprint: kept, as before


# --- validation and hints -----------------------------------------------------------------


@needs_root
def test_validation_accepts_built_layers_whose_source_is_gone(tmp_path, home):
    runner = CliRunner()
    file = base_catalog(tmp_path / "base")
    result = runner.invoke(catalog_cli, ["validate", str(file)])
    assert result.exit_code == 0, result.output
    shutil.rmtree(tmp_path / "base/rootfs")
    result = runner.invoke(catalog_cli, ["validate", str(file)])
    assert result.exit_code == 1
    assert "does not exist" in str(result.exception) and "is not built" in str(result.exception)
    (tmp_path / "base/rootfs").mkdir()
    (tmp_path / "base/rootfs/marker").write_text("x")
    assert runner.invoke(catalog_cli, ["build", str(file)]).exit_code == 0
    shutil.rmtree(tmp_path / "base/rootfs")
    result = runner.invoke(catalog_cli, ["validate", str(file)])
    assert result.exit_code == 0, result.output
    result = runner.invoke(catalog_cli, ["build", str(file)])  # nothing to build: fine
    assert result.exit_code == 0 and "present  base-cat-base@1" in result.output


def test_missing_layers_say_to_build_them_first(tmp_path, stores):
    layers, _ = stores
    doc = {"name": "c", "environments": [{"name": "e", "base": "nothing@1"}]}
    with pytest.raises(CatalogInvalid, match=r"build it first \(`dsec catalog build`"):
        parse_catalog(doc, store=layers)
    with pytest.raises(UnknownLayer, match=r"build it first \(`dsec catalog build`"):
        layers.resolve("nothing@1")
    with pytest.raises(UnknownEnvironment, match=r"run `dsec catalog build` first"):
        CatalogStore(tmp_path / "empty").environment("python")


# --- the CLI: catalog rm, layer build --to -------------------------------------------------


@needs_root
def test_catalog_rm(tmp_path, home):
    runner = CliRunner()
    file = base_catalog(tmp_path / "base")
    assert runner.invoke(catalog_cli, ["build", str(file)]).exit_code == 0
    result = runner.invoke(catalog_cli, ["rm", "base-cat"])
    assert result.exit_code == 0, result.output
    assert "removed catalog base-cat (1 environments, 0 tasks)" in result.output
    assert json.loads(runner.invoke(catalog_cli, ["ls", "--json"]).output)["environments"] == []
    assert LayerStore(home / "layers").exists("base-cat-base@1")  # layers stay
    result = runner.invoke(catalog_cli, ["rm", "base-cat"])
    assert result.exit_code == 1 and isinstance(result.exception, UnknownEnvironment)
    assert "no catalog 'base-cat' is registered" in str(result.exception)


@needs_root
def test_catalog_build_notes_names_another_catalog_defines_too(tmp_path, home):
    runner = CliRunner()
    one = base_catalog(tmp_path / "one", name="one", env="shell")
    two = base_catalog(tmp_path / "two", name="two", env="shell")
    assert "note:" not in runner.invoke(catalog_cli, ["build", str(one)]).output
    result = runner.invoke(catalog_cli, ["build", str(two)])
    assert result.exit_code == 0, result.output
    assert "note: other catalogs define these names too: one/shell" in result.output
    listing = runner.invoke(catalog_cli, ["ls"]).output
    assert "one/shell" in listing and "two/shell" in listing


@needs_root
def test_layer_build_to_places_a_directory_inside_the_layer(tmp_path, home):
    src = tmp_path / "src"
    (src / "pkg").mkdir(parents=True)
    (src / "pkg/a.py").write_text("A = 1\n")
    (src / "run.sh").write_text("#!/bin/sh\n")
    (src / "run.sh").chmod(0o755)
    runner = CliRunner()
    args = ["build", str(src), "--name", "ws", "--version", "1", "--kind", "workspace"]
    result = runner.invoke(layer_cli, [*args, "--to", "/workspace/x"])
    assert result.exit_code == 0, result.output
    store = LayerStore(home / "layers")
    info = store.resolve("ws@1")
    assert info.source.endswith(" -> /workspace/x")
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    subprocess.run(
        ["mount", "-t", "erofs", "-o", "ro", str(store.image_path(info)), str(mnt)], check=True
    )
    try:
        assert sorted(p.name for p in mnt.iterdir()) == ["workspace"]
        assert (mnt / "workspace/x/pkg/a.py").read_text() == "A = 1\n"
        assert os.access(mnt / "workspace/x/run.sh", os.X_OK)
        assert (mnt / "workspace").stat().st_mode & 0o777 == 0o755
        assert (mnt / "workspace/x/pkg/a.py").stat().st_uid == 0
        assert not list(mnt.rglob("*.pyc"))  # a workspace stays source: it is for editing
    finally:
        subprocess.run(["umount", str(mnt)], check=True)
    # bad input: a relative path, a file source
    result = runner.invoke(layer_cli, [*args[:-4], "--name", "w2", "--kind", "workspace",
                                       "--to", "rel"])  # fmt: skip
    assert result.exit_code == 1 and isinstance(result.exception, InvalidSpec)
    (tmp_path / "f.tar").write_bytes(b"")
    result = runner.invoke(
        layer_cli,
        ["build", str(tmp_path / "f.tar"), "--name", "w3", "--kind", "workspace", "--to", "/x"],
    )
    assert result.exit_code == 1 and "is not one" in str(result.exception)
    assert [i.ref for i in store.list()] == ["ws@1"]
    assert list(store.tmp_dir.iterdir()) == []


# --- package mirrors ------------------------------------------------------------------------


def test_offline_configuration_and_granted_mirrors():
    files = offline_files("bookworm", ("main",))
    assert f"deb {APT_PLACEHOLDER} bookworm main" in files["/etc/apt/sources.list"]
    assert 'APT::Update::Error-Mode "any";' in files["/etc/apt/apt.conf.d/99dsec-offline"]
    assert f"index-url = {PIP_PLACEHOLDER}" in files["/etc/pip.conf"]
    for text in files.values():
        assert "build policy grants" in text  # each says why, and what lifts it
    for url in (APT_PLACEHOLDER, PIP_PLACEHOLDER):
        assert url.split("/")[2].endswith(".invalid")  # RFC 2606: never resolves
    env = mirror_env(pip_index="http://127.0.0.1:8123/simple/", apt_mirror="http://10.0.0.1/debian")
    assert env["PIP_INDEX_URL"] == "http://127.0.0.1:8123/simple/"
    assert env["PIP_TRUSTED_HOST"] == "127.0.0.1" and env["DSEC_APT_MIRROR"].endswith("/debian")
    assert "PIP_TRUSTED_HOST" not in mirror_env(pip_index="https://pypi.example/simple/")
    assert mirror_env() == {}
    assert mirror_files("http://10.0.0.1/debian")["/etc/apt/sources.list"].endswith(
        "deb http://10.0.0.1/debian bookworm main\n"
    )
    with pytest.raises(InvalidSpec, match="pip_index"):
        mirror_env(pip_index="file:///wheels")


# --- compiled toolkits ----------------------------------------------------------------------


@needs_root
def test_toolkit_layers_ship_reproducible_pyc(tmp_path, stores):
    layers, _ = stores
    src = tmp_path / "kit"
    (src / "usr/local/lib/python3.11/dist-packages/kit").mkdir(parents=True)
    module = src / "usr/local/lib/python3.11/dist-packages/kit/__init__.py"
    # a set constant: its order depends on the hash seed unless the build fixes it
    module.write_text(
        "WORDS = {'alpha', 'beta', 'gamma', 'delta'}\ndef f(x):\n    return x in WORDS\n"
    )
    recipe = LayerRecipe("kit", "1", "toolkit", dir="kit", root=str(tmp_path))
    info = build_recipe(recipe, layers)
    other = LayerStore(tmp_path / "other")
    assert build_recipe(recipe, other).digest == info.digest  # reproducible
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    subprocess.run(
        ["mount", "-t", "erofs", "-o", "ro", str(layers.image_path(info)), str(mnt)], check=True
    )
    try:
        pyc = module.parent.relative_to(src) / "__pycache__/__init__.cpython-311.pyc"
        data = (mnt / pyc).read_bytes()
        assert int.from_bytes(data[4:8], "little") == 0b01  # hash-based, unchecked
        # the path in the code object is the sandbox's, not the build's scratch directory
        assert b"/usr/local/lib/python3.11/dist-packages/kit/__init__.py" in data
        assert str(tmp_path).encode() not in data and b"scratch" not in data
    finally:
        subprocess.run(["umount", str(mnt)], check=True)


# --- sandboxes from the default catalog's bases (a node; the built default catalog) ---------


@pytest.fixture
def dsec_backend_name() -> str:
    return "container"


def _default_layer(dsec_node, ref: str) -> str:
    """``ref`` of the default catalog, built by run.sh test in DSEC_TEST_HOME, copied into
    the kit node's store (skips if it is not built)."""
    home = Path(os.environ.get("DSEC_TEST_HOME", "/var/lib/dsec-test"))
    built = LayerStore(NodeConfig(home=home).layer_dir)
    try:
        info = built.resolve(ref)
    except (UnknownLayer, OSError):
        pytest.skip(f"{ref} is not built (run.sh test builds the default catalog)")
    store = LayerStore(dsec_node.config.layer_dir)
    if not store.exists(ref):
        with store.scratch("authoring-test-") as tmp:
            copy = tmp / "image.erofs"
            shutil.copyfile(built.image_path(info), copy)
            store.add(copy, name=info.name, version=info.version, kind=info.kind)
    return ref


@needs_root
def test_a_node_takes_qualified_names_and_refuses_ambiguous_ones(
    dsec_node, dsec_client, dsec_sandboxes
):
    store = CatalogStore(dsec_node.config.catalog_dir)
    for name in ("authoring-a", "authoring-b"):
        store.save(
            Catalog(
                name=name,
                environments=(
                    Environment(
                        name="authoring-shared", base=dsec_node.layer.ref, env={"WHICH": name}
                    ),
                ),
            )
        )
    try:
        with pytest.raises(AmbiguousName) as e:
            dsec_sandboxes.create(environment="authoring-shared", layers=())
        assert e.value.context["choices"] == [
            "authoring-a/authoring-shared",
            "authoring-b/authoring-shared",
        ]
        sb = dsec_sandboxes.create(environment="authoring-b/authoring-shared", layers=())
        assert sb.exec("echo $WHICH").stdout == b"authoring-b\n"
        assert sb.info.environment == "authoring-b/authoring-shared"
        r = dsec_client.fncall("authoring-a/authoring-shared", "echo $WHICH", timeout=60)
        assert r.ok and r.stdout == b"authoring-a\n", r
        with pytest.raises(AmbiguousName):
            dsec_client.fncall("authoring-shared", "true", timeout=60)
        store.remove("authoring-a")  # unique again: the bare name works
        sb = dsec_sandboxes.create(environment="authoring-shared", layers=())
        assert sb.exec("echo $WHICH").stdout == b"authoring-b\n"
    finally:
        for name in ("authoring-a", "authoring-b"):
            with contextlib.suppress(UnknownEnvironment):
                store.remove(name)


def _upper_files(dsec_node, sid: str) -> list[str]:
    upper = dsec_node.config.sandbox_dir / sid / "upper"
    assert upper.is_dir()
    return sorted(str(p.relative_to(upper)) for p in upper.rglob("*"))


@pytest.mark.slow
@needs_root
def test_debian_dev_has_the_tools_and_fails_fast_without_a_mirror(dsec_node, dsec_sandboxes):
    base = _default_layer(dsec_node, "debian-dev@12")
    toolkit = _default_layer(dsec_node, "dsec-toolkit@2")
    sb = dsec_sandboxes.create(layers=(toolkit, base), memory="512M", network="none")
    r = sb.exec(
        "set -e; git --version; gcc --version | head -1; make --version | head -1; "
        "python3 -m pip --version; ps -e -o comm= | head -3; "
        "cd /tmp && git init -q repo && cd repo && printf 'int main(void){return 0;}\\n' > m.c "
        "&& printf 'm: m.c\\n\\tgcc -o m m.c\\n' > Makefile && make -s && ./m && echo built; "
        "python3 -m venv /tmp/venv && /tmp/venv/bin/python -c 'import sys; print(sys.prefix)'",
        timeout=120,
    )
    out = r.stdout.decode()
    assert r.exit_code == 0, (out, r.stderr.decode())
    assert "git version" in out and "gcc" in out and "GNU Make" in out and "pip " in out
    assert "built" in out and "/tmp/venv" in out
    # apt: non-zero, at once, saying which source failed
    started = time.monotonic()
    r = sb.exec("apt-get update", timeout=60)
    took = time.monotonic() - started
    text = (r.stdout + r.stderr).decode()
    assert r.exit_code != 0 and took < 10, (took, text)
    assert "dsec-no-network.invalid" in text, text
    # pip (in a venv: the system python is Debian's, PEP 668 refuses it anyway)
    started = time.monotonic()
    r = sb.exec("/tmp/venv/bin/pip install six", timeout=60)
    took = time.monotonic() - started
    text = (r.stdout + r.stderr).decode()
    assert r.exit_code != 0 and took < 15, (took, text)
    assert "pip-index.dsec-no-network.invalid" in text and "six" in text, text
    assert (sb.read_file("/etc/pip.conf").decode()).count("build policy grants") == 1


@pytest.mark.slow
@needs_root
def test_a_fresh_sandbox_running_pytest_writes_no_pyc(dsec_node, dsec_sandboxes):
    base = _default_layer(dsec_node, "debian-python@12-2")
    toolkit = _default_layer(dsec_node, "dsec-toolkit@2")
    sb = dsec_sandboxes.create(layers=(toolkit, base), memory="512M")
    sb.write_file("/root/t/test_one.py", b"def test_one():\n    assert 1 + 1 == 2\n")
    r = sb.exec("cd /root/t && pytest -q -p no:cacheprovider test_one.py", timeout=120)
    assert r.exit_code == 0 and b"1 passed" in r.stdout, r
    written = [p for p in _upper_files(dsec_node, sb.id) if p.endswith(".pyc")]
    # only pytest's own rewrite of the test file itself: nothing of pytest, nor the stdlib
    assert all("/root/t/__pycache__/" in f"/{p}" for p in written), written
