"""Catalog records (environments, tasks, layer recipes) and loading them with their checks.

A catalog file (YAML or JSON, schema in ``schema.json`` next to this module: the one copy) is
loaded into frozen records and checked twice: against the schema, then for meaning
(duplicates, layers and environments that do not exist). Faults raise ``CatalogInvalid`` with
the JSON path of the culprit, e.g. ``$.environments[1].base``.
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jsonschema
import yaml

from ..backend import split_kernel
from ..errors import CatalogInvalid, DsecError, InvalidSpec, UnknownEnvironment, UnknownLayer
from ..layers.recipes import LayerRecipe
from ..layers.store import LayerStore
from ..records import DEFAULT_BACKEND, JudgeSpec, LayerRef

__all__ = [
    "REWARDS",
    "Catalog",
    "Environment",
    "Task",
    "TaskJudge",
    "catalog_schema",
    "check_environment_layers",
    "default_catalog_file",
    "kernel_text",
    "load_catalog",
    "parse_catalog",
]

REWARDS = ("exit_code", "pass_rate", "judge")


#: A Debian package name, and a Debian version (epoch and revision allowed).
_PACKAGE_RE = re.compile(r"[a-z0-9][a-z0-9.+-]+")
_VERSION_RE = re.compile(r"[0-9][A-Za-z0-9.+~:-]*")


def kernel_text(kernel: str | Mapping[str, Any] | None) -> str | None:
    """A catalog's ``kernel`` (``{package, version}``, ``"package"`` or
    ``"package=version"``) as ``SandboxRuntime.kernel`` text; ``InvalidSpec`` if it is not."""
    if kernel is None:
        return None
    if isinstance(kernel, Mapping):
        package, version = kernel.get("package"), kernel.get("version")
        if set(kernel) - {"package", "version"}:
            raise InvalidSpec(
                f"kernel: unknown field(s) {sorted(set(kernel) - {'package', 'version'})}; "
                "expected package and version",
                field="kernel",
            )
    elif isinstance(kernel, str):
        package, version = split_kernel(kernel)
    else:
        raise InvalidSpec(
            f"kernel must be text or {{package, version}}, got {kernel!r}", field="kernel"
        )
    if not isinstance(package, str) or not _PACKAGE_RE.fullmatch(package):
        raise InvalidSpec(
            f"kernel: {package!r} is not a Debian package name (such as linux-image-cloud-amd64)",
            field="kernel",
        )
    if version is not None and (not isinstance(version, str) or not _VERSION_RE.fullmatch(version)):
        raise InvalidSpec(
            f"kernel: {version!r} is not a Debian version (such as 6.1.192-3)", field="kernel"
        )
    return package if version is None else f"{package}={version}"


@dataclass(frozen=True)
class Environment:
    """What a sandbox is made of: a base layer, workspace and toolkit layers, env and workdir,
    and what runs it: ``backend`` (None: the node's default, ``DEFAULT_BACKEND``, unless the
    create names one) and, for a VM backend, the ``kernel`` it boots: a Debian kernel package,
    ``"package"`` or ``"package=version"`` (a ``{package, version}`` mapping is read as such;
    None: the backend's default)."""

    name: str
    base: str
    workspaces: tuple[str, ...] = ()
    toolkits: tuple[str, ...] = ()
    env: Mapping[str, str] = field(default_factory=dict)
    workdir: str = "/"
    description: str = ""
    catalog: str = ""  # the catalog that defines it
    backend: str | None = None
    kernel: str | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "workspaces", tuple(self.workspaces))
        object.__setattr__(self, "toolkits", tuple(self.toolkits))
        object.__setattr__(self, "env", dict(self.env))
        object.__setattr__(self, "kernel", kernel_text(self.kernel))
        if self.backend is not None and not (
            isinstance(self.backend, str)
            and re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*", self.backend)
        ):
            raise InvalidSpec(
                f"environment {self.name}: backend must be a backend name, got {self.backend!r}",
                field="backend",
            )
        if self.kernel is not None and (self.backend or DEFAULT_BACKEND) == DEFAULT_BACKEND:
            raise InvalidSpec(
                f"environment {self.name}: a kernel is for VM backends (such as microvm); "
                f"{'its' if self.backend else 'the default'} backend, {DEFAULT_BACKEND!r}, "
                "runs on the host's kernel",
                field="kernel",
            )

    def layer_refs(self) -> list[str]:
        """``name@version`` of every layer, top first: toolkits, workspaces, then the base.

        Within each group the catalog's order is kept, the first one being the upper.
        """
        return [*self.toolkits, *self.workspaces, self.base]

    def to_document(self) -> dict[str, Any]:
        doc: dict[str, Any] = {"name": self.name, "base": self.base}
        if self.workspaces:
            doc["workspaces"] = list(self.workspaces)
        if self.toolkits:
            doc["toolkits"] = list(self.toolkits)
        if self.env:
            doc["env"] = dict(self.env)
        if self.workdir != "/":
            doc["workdir"] = self.workdir
        if self.description:
            doc["description"] = self.description
        if self.backend is not None:
            doc["backend"] = self.backend
        if self.kernel is not None:
            doc["kernel"] = self.kernel
        return doc


@dataclass(frozen=True)
class TaskJudge:
    """How judge mode runs a task's program (``JudgeSpec``'s fields): ``compile`` once, then
    ``run`` on each NAME.in/NAME.out pair of ``cases`` (a directory under the environment's
    working directory) with ``time_limit`` CPU seconds and ``memory_limit`` each."""

    run: str
    compile: str | None = None
    cases: str = "cases"
    time_limit: float = 2.0
    memory_limit: str = "256M"
    compare: str = "lines"

    def to_document(self) -> dict[str, Any]:
        doc: dict[str, Any] = {"run": self.run}
        if self.compile:
            doc["compile"] = self.compile
        doc.update(
            cases=self.cases,
            time_limit=self.time_limit,
            memory_limit=self.memory_limit,
            compare=self.compare,
        )
        return doc


@dataclass(frozen=True)
class Task:
    """A program to run in an environment and how to turn what it did into a reward.

    ``reward``: ``exit_code`` (1.0 if ``command`` exits 0 in time), ``pass_rate`` (passed/total
    of the JUnit XML file ``report`` inside the sandbox), or ``judge`` (1.0 if judge mode
    accepts every case of ``judge``: see ``TaskJudge``; no ``command`` needed). ``expect`` is
    the reward a correct harness computes for the shipped workspace, for self-checks.
    """

    name: str
    environment: str
    command: str = ""
    reward: str = "exit_code"
    timeout: float = 60.0
    description: str = ""
    expect: float | None = None
    report: str | None = None
    catalog: str = ""
    judge: TaskJudge | None = None

    def judge_spec(self, **overrides: Any) -> JudgeSpec:
        """The ``JudgeSpec`` of a ``judge`` task, for ``Client.judge``; ``overrides`` set
        other fields (``files``: a submission to judge instead of the workspace's)."""
        if self.judge is None:
            raise InvalidSpec(f"task {self.name} is not a judge task", task=self.name)
        j = self.judge
        fields: dict[str, Any] = dict(
            environment=self.environment,
            run=j.run,
            compile=j.compile,
            cases_dir=j.cases,
            time_limit=j.time_limit,
            memory_limit=j.memory_limit,
            compare=j.compare,
            compile_timeout=self.timeout,
        )
        return JudgeSpec(**{**fields, **overrides})

    def to_document(self) -> dict[str, Any]:
        doc: dict[str, Any] = {"name": self.name, "environment": self.environment}
        if self.command:
            doc["command"] = self.command
        doc.update(reward=self.reward, timeout=self.timeout)
        for key in ("description", "expect", "report"):
            if getattr(self, key) not in (None, ""):
                doc[key] = getattr(self, key)
        if self.judge is not None:
            doc["judge"] = self.judge.to_document()
        return doc


@dataclass(frozen=True)
class Catalog:
    """A loaded catalog. ``path`` is the file it came from; ``root`` its directory."""

    name: str
    layers: tuple[LayerRecipe, ...] = ()
    environments: tuple[Environment, ...] = ()
    tasks: tuple[Task, ...] = ()
    description: str = ""
    path: str = ""
    root: str = "."

    def __post_init__(self) -> None:
        for name in ("layers", "environments", "tasks"):
            object.__setattr__(self, name, tuple(getattr(self, name)))

    def environment(self, name: str) -> Environment:
        for env in self.environments:
            if env.name == name:
                return env
        raise UnknownEnvironment(
            f"no environment {name!r} in catalog {self.name}",
            name=name,
            known=[e.name for e in self.environments],
        )

    def task(self, name: str) -> Task:
        for task in self.tasks:
            if task.name == name:
                return task
        raise UnknownEnvironment(
            f"no task {name!r} in catalog {self.name}",
            name=name,
            known=[t.name for t in self.tasks],
        )

    def to_document(self) -> dict[str, Any]:
        """The catalog as a document that validates against the schema."""
        doc: dict[str, Any] = {"name": self.name}
        if self.description:
            doc["description"] = self.description
        doc["layers"] = [_recipe_document(r) for r in self.layers]
        doc["environments"] = [e.to_document() for e in self.environments]
        doc["tasks"] = [t.to_document() for t in self.tasks]
        return doc


def _recipe_document(recipe: LayerRecipe) -> dict[str, Any]:
    source: dict[str, Any] = {}
    if recipe.debootstrap:
        d = recipe.debootstrap
        source["debootstrap"] = {
            "suite": d.suite,
            "variant": d.variant,
            "include": list(d.include),
            "components": list(d.components),
        }
        if d.mirror:
            source["debootstrap"]["mirror"] = d.mirror
    for key in ("tar", "docker", "dir"):
        if getattr(recipe, key) is not None:
            source[key] = getattr(recipe, key)
    if recipe.dir is not None and recipe.to != "/":
        source["to"] = recipe.to
    if recipe.pip:
        source["pip"] = {"packages": list(recipe.pip.packages), "python": recipe.pip.python}
    doc = {"name": recipe.name, "version": recipe.version, "kind": recipe.kind, "source": source}
    if recipe.description:
        doc["description"] = recipe.description
    return doc


# --- loading and checking ------------------------------------------------------------------

SCHEMA_FILE = Path(__file__).with_name("schema.json")


@functools.lru_cache(maxsize=1)
def catalog_schema() -> dict[str, Any]:
    """The catalog JSON Schema (draft 2020-12)."""
    return json.loads(SCHEMA_FILE.read_text())


def _json_path(parts: Iterable[Any]) -> str:
    out = "$"
    for part in parts:
        if isinstance(part, int):
            out += f"[{part}]"
        elif re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", str(part)):
            out += f".{part}"
        else:
            out += f"[{json.dumps(str(part))}]"
    return out


def _invalid(where: str, path: Sequence[Any], message: str) -> CatalogInvalid:
    json_path = _json_path(path)
    return CatalogInvalid(f"{where}: {json_path}: {message}", path=json_path, file=where)


def _schema_fault(error: jsonschema.ValidationError) -> tuple[list[Any], str]:
    """Point at the field itself where jsonschema points at the object holding it, and say
    what was expected where the schema has an ``x-message`` for it."""
    path = list(error.absolute_path)
    if error.validator == "required":
        m = re.match(r"^'(.+)' is a required property$", error.message)
        if m:
            return [*path, m.group(1)], "required field is missing"
    schema = error.schema if isinstance(error.schema, Mapping) else {}
    if error.validator == "additionalProperties" and isinstance(error.instance, dict):
        allowed = set(schema.get("properties", {}))
        extra = sorted(k for k in error.instance if k not in allowed)
        if extra:
            return [*path, extra[0]], (
                f"unknown field {extra[0]!r}; expected one of {', '.join(sorted(allowed))}"
            )
    if error.validator == "dependentRequired" and isinstance(error.instance, dict):
        for key, needs in dict(error.validator_value).items():  # type: ignore[arg-type]
            if key in error.instance and any(n not in error.instance for n in needs):
                return [*path, key], f"{key!r} needs {', '.join(map(repr, needs))} too"
    hint = schema.get("x-message")
    if hint and error.validator == "pattern":
        return path, f"{error.instance!r}: {hint}"
    if hint and error.validator in ("anyOf", "oneOf", "not"):
        return path, hint
    return path, error.message


def _validate_schema(doc: Any, where: str) -> None:
    validator = jsonschema.Draft202012Validator(catalog_schema())
    errors = list(validator.iter_errors(doc))
    if not errors:
        return
    best = jsonschema.exceptions.best_match(errors)
    path, message = _schema_fault(best)
    if len(errors) > 1:
        message += f" (and {len(errors) - 1} more problem{'s' if len(errors) > 2 else ''})"
    raise _invalid(where, path, message)


def _recipes(
    doc: Mapping[str, Any], root: Path, where: str, check_sources: bool
) -> list[LayerRecipe]:
    recipes: list[LayerRecipe] = []
    seen: dict[str, int] = {}
    for i, item in enumerate(doc.get("layers", [])):
        try:
            recipe = LayerRecipe.from_source(
                item["name"],
                str(item["version"]),
                item["kind"],
                item["source"],
                root,
                item.get("description", ""),
            )
        except DsecError as e:
            raise _invalid(where, ["layers", i, "source"], str(e)) from e
        if recipe.ref in seen:
            raise _invalid(
                where,
                ["layers", i, "version"],
                f"duplicate layer {recipe.ref} (also $.layers[{seen[recipe.ref]}])",
            )
        seen[recipe.ref] = i
        for key, path in (("dir", recipe.dir_path), ("tar", recipe.tar_path)):
            if check_sources and path is not None and not path.exists():
                raise _invalid(
                    where,
                    ["layers", i, "source", key],
                    f"{path} does not exist (relative paths start at {root})",
                )
        recipes.append(recipe)
    return recipes


def _unique(items: Sequence[Any], section: str, where: str) -> None:
    seen: dict[str, int] = {}
    for i, item in enumerate(items):
        if item.name in seen:
            raise _invalid(
                where,
                [section, i, "name"],
                f"duplicate name {item.name!r} (also $.{section}[{seen[item.name]}])",
            )
        seen[item.name] = i


def check_environment_layers(
    environments: Sequence[Environment],
    recipes: Sequence[LayerRecipe],
    store: LayerStore | None,
    where: str,
) -> None:
    kinds = {r.ref: r.kind for r in recipes}
    for i, env in enumerate(environments):
        slots: list[tuple[str, int | None, str, str]] = [("base", None, env.base, "base")]
        slots += [("workspaces", j, ref, "workspace") for j, ref in enumerate(env.workspaces)]
        slots += [("toolkits", j, ref, "toolkit") for j, ref in enumerate(env.toolkits)]
        for key, j, ref, want in slots:
            path = ["environments", i, key] + ([] if j is None else [j])
            kind = kinds.get(ref)
            if kind is None and store is not None:
                try:
                    kind = store.resolve(LayerRef.parse(ref)).kind
                except UnknownLayer:
                    pass
            if kind is None:
                known = sorted(set(kinds) | ({i.ref for i in store.list()} if store else set()))
                raise _invalid(
                    where,
                    path,
                    f"layer {ref} is neither a layer of this catalog nor in the store"
                    f" (known: {', '.join(known) or 'none'})",
                )
            if kind != want:
                raise _invalid(where, path, f"layer {ref} is a {kind} layer, not a {want} layer")


def _environment(doc: Mapping[str, Any], i: int, catalog: str, where: str) -> Environment:
    e = doc["environments"][i]
    try:
        return Environment(
            name=e["name"],
            base=e["base"],
            workspaces=e.get("workspaces", ()),
            toolkits=e.get("toolkits", ()),
            env=e.get("env", {}),
            workdir=e.get("workdir", "/"),
            description=e.get("description", ""),
            catalog=catalog,
            backend=e.get("backend"),
            kernel=e.get("kernel"),
        )
    except InvalidSpec as err:  # what the schema cannot say (it says most of it first)
        key = err.context.get("field", "")
        raise _invalid(where, ["environments", i, *([key] if key else [])], str(err)) from err


def default_catalog_file() -> Path:
    """The catalog shipped with dsec (inside the package, so an installed wheel has it)."""
    return Path(__file__).resolve().with_name("default") / "default.yaml"


def parse_catalog(
    doc: Any,
    *,
    where: str = "<catalog>",
    root: Path | str = ".",
    store: LayerStore | None = None,
    check_sources: bool = True,
    check_layers: bool = True,
) -> Catalog:
    """Check a catalog document (schema, then meaning) and make the records.

    Relative recipe paths start at ``root``; ``check_sources`` checks that they exist.
    Environments may name layers of this catalog or, if ``store`` is given, layers already in
    it; ``check_layers=False`` skips that (a saved catalog was checked when it was saved, and
    the node resolves layers against all its sources at create time). ``where`` names the
    document in error messages.
    """
    _validate_schema(doc, where)
    root = Path(root)
    name = doc["name"]
    recipes = _recipes(doc, root, where, check_sources)
    environments = [
        _environment(doc, i, name, where) for i in range(len(doc.get("environments", [])))
    ]
    _unique(environments, "environments", where)
    if check_layers:
        check_environment_layers(environments, recipes, store, where)
    tasks = [
        Task(
            name=t["name"],
            environment=t["environment"],
            command=t.get("command", ""),
            reward=t["reward"],
            timeout=float(t.get("timeout", 60.0)),
            description=t.get("description", ""),
            expect=t.get("expect"),
            report=t.get("report"),
            catalog=name,
            judge=TaskJudge(**t["judge"]) if "judge" in t else None,
        )
        for t in doc.get("tasks", [])
    ]
    _unique(tasks, "tasks", where)
    env_names = [e.name for e in environments]
    for i, task in enumerate(tasks):
        if task.environment not in env_names:
            raise _invalid(
                where,
                ["tasks", i, "environment"],
                f"unknown environment {task.environment!r} (known: "
                f"{', '.join(env_names) or 'none'})",
            )
        if task.reward in ("exit_code", "judge") and task.expect not in (None, 0, 1):
            raise _invalid(
                where,
                ["tasks", i, "expect"],
                f"an {task.reward} reward is 0.0 or 1.0, never {task.expect}",
            )
    return Catalog(
        name=name,
        layers=tuple(recipes),
        environments=tuple(environments),
        tasks=tuple(tasks),
        description=doc.get("description", ""),
        root=str(root),
    )


def load_catalog(path: Path | str, *, store: LayerStore | None = None) -> Catalog:
    """Read and check a catalog file (YAML or JSON); see ``parse_catalog``."""
    path = Path(path)
    where = str(path)
    try:
        text = path.read_text()
    except OSError as e:
        raise CatalogInvalid(f"{where}: cannot read: {e.strerror}", path="$", file=where) from e
    try:
        doc = json.loads(text) if path.suffix == ".json" else yaml.safe_load(text)
    except (yaml.YAMLError, json.JSONDecodeError) as e:
        raise CatalogInvalid(
            f"{where}: not valid {'JSON' if path.suffix == '.json' else 'YAML'}: {e}",
            path="$",
            file=where,
        ) from e
    root = path.resolve().parent
    catalog = parse_catalog(doc, where=where, root=root, store=store)
    return Catalog(**{**catalog_fields(catalog), "path": str(path.resolve())})


def catalog_fields(catalog: Catalog) -> dict[str, Any]:
    return {k: getattr(catalog, k) for k in catalog.__dataclass_fields__}
