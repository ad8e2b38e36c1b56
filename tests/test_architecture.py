"""The house rules that keep the code walkable, checked on the source itself: imports follow the
floors (import-linter's contract in pyproject.toml), no private helper crosses a package, and
imports inside functions are the few listed here with their reason."""

from __future__ import annotations

import ast
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from dsec_core.renamed import MODULES as RENAMED_MODULES
from dsec_core.renamed import NAMES as RENAMED_NAMES

REPO = Path(__file__).resolve().parent.parent
PACKAGES = [REPO / "dsec", REPO / "dsec_core", *sorted(REPO.glob("plugins/*/dsec_*"))]

#: Imports that may sit inside a function, and why (everything else goes at the top).
LAZY_IMPORTS = {
    "python_on_whales": "a third of a second to import; only docker layer sources need it",
    "python_on_whales.exceptions": "as python_on_whales",
    "python_on_whales.utils": "as python_on_whales (layers.image runs `docker build --force-rm`)",
    "boto3": "0.4 s to import; every command loads the S3 plugin, few use S3",
    "boto3.exceptions": "as boto3",
    "boto3.s3.transfer": "as boto3",
    "ray": "optional (dsec[cluster]) and 2 s to import; only dsec_core.cluster's calls need it",
    "ray.experimental.internal_kv": "as ray (where each node name ran, for `dsec cluster up`)",
    "dsec_core.node.daemon": "the CLI's `node start --foreground` only; uvicorn and the node "
    "would slow every other command's start-up",
    "dsec_core.demo": "`dsec demo` only; it loads the catalog builder, 0.2 s of every command",
    "dsec_core.api.openapi": "`dsec node openapi` only; the whole API's schema, 0.08 s",
    "dsec_core.catalog.model": "catalog tasks of a rollout only: the catalog brings the layer "
    "store and jsonschema, 0.15 s, which dsec.rollout's other episodes do without",
    "dsec_core.catalog.rewards": "as dsec_core.catalog.model",
    "yaml": "a catalog file read by dsec.rollout: as dsec_core.catalog.model",
    "zstandard": "the node side's (dsec[node]): only zstd chunks of lazy layers use it, and the "
    "slim client reads catalogs, whose model imports the layer store, without it",
    "dsec_core.rl.env": "the environments need gymnasium (dsec[rl]) and numpy, 0.25 s: loaded "
    "when one is first named, so dsec.rollout and `dsec rollout` import dsec_core.rl without them",
    "dsec_harbor.environment": "Harbor (Python >= 3.12) is in Harbor's venv only: dsec's "
    "venv imports dsec_harbor without it, Harbor loads DsecEnvironment on first use",
    "dsec_core.plugins": "the CLI's `dsec plugins` and plugins' commands only: pluggy and the "
    "plugin floors are the node side's (dsec[node]), which a client-only install lacks",
    "dsec_core.cli.mcp_server": "`dsec mcp` only: the mcp package is an extra (dsec[mcp]), "
    "checked for first so that its absence is a message, not an ImportError",
}


def _modules() -> list[tuple[str, Path]]:
    out = []
    for pkg in PACKAGES:
        for path in sorted(pkg.rglob("*.py")):
            if "templates" in path.relative_to(pkg).parts:
                continue  # files the CLI writes out for plugin authors, not our modules
            rel = path.relative_to(pkg.parent).with_suffix("")
            parts = list(rel.parts)
            if parts[-1] == "__init__":
                parts.pop()
            out.append((".".join(parts), path))
    return out


def _resolve(module: str, path: Path, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    base = package.split(".")
    if node.level > 1:
        base = base[: -(node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _package_of(module: str, is_package: bool) -> str:
    return module if is_package else module.rpartition(".")[0]


def _imports(module: str, path: Path):
    """(imported module, names, line, inside a function) for every import statement."""
    tree = ast.parse(path.read_text(), filename=str(path))
    funcs: list[ast.AST] = [
        n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
    ]
    in_func = {id(n) for f in funcs for n in ast.walk(f) if n is not f}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            yield (
                _resolve(module, path, node),
                [a.name for a in node.names],
                node.lineno,
                id(node) in in_func,
            )
        elif isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, [], node.lineno, id(node) in in_func


def test_floors_contract_holds():
    lint = shutil.which("lint-imports", path=str(Path(sys.executable).parent))
    if lint is None:
        pytest.skip("import-linter is not installed (pip install -e '.[test]')")
    out = subprocess.run([lint], cwd=REPO, capture_output=True, text=True)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-2000:]
    assert "broken" in out.stdout and " 0 broken" in out.stdout


def test_no_private_name_crosses_a_package():
    modules = dict(_modules())
    crossings = []
    for module, path in modules.items():
        here = _package_of(module, path.name == "__init__.py")
        for target, names, line, _ in _imports(module, path):
            if not target.startswith(("dsec", "dsec_core")):
                continue
            target_path = modules.get(target)
            target_pkg = (
                _package_of(target, target_path.name == "__init__.py")
                if target_path
                else target.rpartition(".")[0]
            )
            for name in names:
                private = name.startswith("_") and not name.startswith("__")
                if private and target_pkg != here:
                    crossings.append(f"{path.relative_to(REPO)}:{line}: {name} from {target}")
            if (
                any(p.startswith("_") and not p.startswith("__") for p in target.split("."))
                and target_pkg != here
            ):
                crossings.append(f"{path.relative_to(REPO)}:{line}: module {target}")
    assert crossings == []


def test_imports_inside_functions_are_the_listed_few():
    hidden = []
    for module, path in _modules():
        for target, _names, line, inside in _imports(module, path):
            if inside and target not in LAZY_IMPORTS:
                hidden.append(f"{path.relative_to(REPO)}:{line}: {target}")
    assert hidden == [], "move these to the top of the module (or list them with a reason)"


def test_the_checks_above_can_fail(tmp_path):
    # the scanners see a private import across packages and an import hidden in a function
    src = tmp_path / "m.py"
    src.write_text("from dsec_core.linux.mounts import _check\ndef f():\n    import json\n")
    found = list(_imports("dsec_core.lazy.m", src))
    assert ("dsec_core.linux.mounts", ["_check"], 1, False) in found
    assert ("json", [], 3, True) in found


def test_the_nodes_services_reach_for_no_private_name_of_their_host():
    """A service of ``dsec_core.node`` sees the node through a protocol of ``host.py``: no
    ``host._x`` or ``node._x`` (import-linter keeps it from importing ``node.py`` at all)."""
    reached = []
    for path in sorted((REPO / "dsec_core" / "node").glob("*.py")):
        if path.name == "node.py":
            continue
        for n in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if not isinstance(n, ast.Attribute) or not n.attr.startswith("_"):
                continue
            base = n.value
            name = base.attr if isinstance(base, ast.Attribute) else getattr(base, "id", "")
            if name in ("host", "node") and not n.attr.startswith("__"):
                reached.append(f"{path.relative_to(REPO)}:{n.lineno}: {name}.{n.attr}")
    assert reached == []


PLUGINS_CONTRACT = "plugins import only core's plugin-facing floors"
BUILDERS_CONTRACT = "builders are clients of nodes, not parts of one"
INTEGRATIONS_CONTRACT = "integrations are clients of nodes"


def _contracts() -> tuple[list[str], dict[str, dict]]:
    config = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["importlinter"]
    return config["root_packages"], {c["name"]: c for c in config["contracts"]}


#: The plugin authors' guide, whose "What a plugin may import" table lists core's plugin-facing
#: modules.
PLUGIN_GUIDE = REPO / "docs" / "plugins" / "index.md"


def _plugin_facing_in_docs() -> list[str]:
    text = PLUGIN_GUIDE.read_text()
    start = text.index("\n## What a plugin may import")
    end = text.index("\n## ", start + 1)
    return re.findall(r"^\| `(dsec_core\.[a-z_]+)` \|", text[start:end], re.M)


def is_integration(package: Path) -> bool:
    """A plugin folder whose project registers nothing in dsec's entry-point group is a
    client-side integration (plugins/harbor: a Harbor provider run in the trainer's process),
    never loaded by a node."""
    project = tomllib.loads((package.parent / "pyproject.toml").read_text())["project"]
    return "dsec" not in project.get("entry-points", {})


def test_plugins_and_builders_are_under_their_contracts():
    roots, contracts = _contracts()
    found = [p.parent for p in REPO.glob("plugins/*/dsec_*/__init__.py")]
    plugins = sorted(p.name for p in found if not is_integration(p))
    integrations = sorted(p.name for p in found if is_integration(p))
    builders = sorted(p.parent.name for p in REPO.glob("builders/*/dsec_*/__init__.py"))
    assert set(plugins + integrations + builders) <= set(roots)
    assert sorted(contracts[PLUGINS_CONTRACT]["source_modules"]) == plugins
    assert sorted(contracts[INTEGRATIONS_CONTRACT]["source_modules"]) == integrations
    assert sorted(contracts[BUILDERS_CONTRACT]["source_modules"]) == builders


def test_every_core_package_is_plugin_facing_or_forbidden_to_plugins():
    """A new core package is put on one side: the plugin guide's table of plugin-facing modules
    (docs/plugins/index.md), or the
    plugins' forbidden list; never both. The stubs of renamed modules are on neither: they only
    re-export their new module, for one release."""
    _, contracts = _contracts()
    forbidden = set(contracts[PLUGINS_CONTRACT]["forbidden_modules"])
    facing = set(_plugin_facing_in_docs())
    core = {
        f"dsec_core.{p.stem}"
        for p in (REPO / "dsec_core").iterdir()
        if (p.suffix == ".py" and p.stem != "__init__") or (p / "__init__.py").is_file()
    } - set(RENAMED_MODULES)
    assert facing, f"the table of plugin-facing modules was not found in {PLUGIN_GUIDE}"
    assert facing & forbidden == set()
    assert sorted(core - facing - forbidden) == []
    assert sorted((facing | forbidden) - core - {"dsec", "dsec_builder"}) == []


def _python_files() -> list[Path]:
    """Every Python file of the repository: core, plugins, builders, tests, benches, examples."""
    skip = {".venv", ".venv-harbor", ".git", "templates", "__pycache__"}
    return [
        p
        for p in sorted(REPO.rglob("*.py"))
        if not skip & set(p.relative_to(REPO).parts) and p.name != "test_renamed.py"
    ]


def test_nothing_uses_a_renamed_module_or_name():
    """The old names of ``dsec_core.renamed`` are for old callers only: dsec, its plugins,
    builders, tests, benches and examples import the new ones (a stub imports its new module,
    which is all it does)."""
    modules = dict(_modules())
    stubs = {modules[m] for m in RENAMED_MODULES}
    used = []
    for path in _python_files():
        if path in stubs:
            continue
        module = next((m for m, p in modules.items() if p == path), path.stem)
        for target, names, line, _ in _imports(module, path):
            old = [target] if target in RENAMED_MODULES else []
            old += [f"{target}.{n}" for n in names if f"{target}.{n}" in RENAMED_MODULES]
            old += [f"{target}.{n}" for n in names if f"{target}.{n}" in RENAMED_NAMES]
            used += [f"{path.relative_to(REPO)}:{line}: {o}" for o in old]
    assert used == []
