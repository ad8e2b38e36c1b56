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
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import jsonschema
import yaml

from ..backend import split_kernel
from ..errors import (
    AmbiguousName,
    CatalogInvalid,
    DsecError,
    InvalidSpec,
    UnknownEnvironment,
    UnknownLayer,
)
from ..layers.recipes import LayerRecipe
from ..layers.store import LayerStore
from ..records import DEFAULT_BACKEND, JudgeSpec, LayerRef, SandboxSpec

__all__ = [
    "REWARDS",
    "Catalog",
    "CatalogImport",
    "Environment",
    "Task",
    "TaskJudge",
    "WarmEntry",
    "catalog_schema",
    "check_environment_layers",
    "default_catalog_file",
    "kernel_text",
    "load_catalog",
    "parse_catalog",
    "pick_named",
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

    @property
    def qualified(self) -> str:
        """``<catalog>/<name>``: the name no other catalog's environment can shadow."""
        return f"{self.catalog}/{self.name}" if self.catalog else self.name

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

    @property
    def qualified(self) -> str:
        """``<catalog>/<name>``."""
        return f"{self.catalog}/{self.name}" if self.catalog else self.name

    @property
    def qualified_environment(self) -> str:
        """The task's environment as ``<catalog>/<name>`` (a bare name is of the task's own
        catalog): what a create names so no other catalog's environment can shadow it."""
        if "/" in self.environment or not self.catalog:
            return self.environment
        return f"{self.catalog}/{self.environment}"

    def judge_spec(self, **overrides: Any) -> JudgeSpec:
        """The ``JudgeSpec`` of a ``judge`` task, for ``Client.judge``; ``overrides`` set
        other fields (``files``: a submission to judge instead of the workspace's)."""
        if self.judge is None:
            raise InvalidSpec(f"task {self.name} is not a judge task", task=self.name)
        j = self.judge
        fields: dict[str, Any] = dict(
            environment=self.qualified_environment,
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
class WarmEntry:
    """``count`` sandboxes of ``environment`` that each node with the catalog keeps warm
    (``dsec_core.node.warm``), of the shape the other fields give (a create's defaults for
    those not given): a create of the same environment and shape claims one."""

    environment: str
    count: int
    backend: str | None = None
    cpu: float = 1.0
    memory: int | str = "512M"
    pids: int = 512
    disk: int | str = "10G"
    network: str = "none"
    qos: str = "ls"
    runtime: str | None = None

    def spec(self, catalog: str = "") -> SandboxSpec:
        """The shape as a spec; its environment qualified with ``catalog`` when bare."""
        env = self.environment
        if catalog and "/" not in env:
            env = f"{catalog}/{env}"
        return SandboxSpec(
            environment=env,
            backend=self.backend,
            cpu=self.cpu,
            memory=self.memory,
            pids=self.pids,
            disk=self.disk,
            network=self.network,
            qos=self.qos,
            runtime=self.runtime,
            ttl=None,
        )

    def to_document(self) -> dict[str, Any]:
        doc: dict[str, Any] = {"environment": self.environment, "count": self.count}
        for name, default in (
            ("backend", None),
            ("cpu", 1.0),
            ("memory", "512M"),
            ("pids", 512),
            ("disk", "10G"),
            ("network", "none"),
            ("qos", "ls"),
            ("runtime", None),
        ):
            if getattr(self, name) != default:
                doc[name] = getattr(self, name)
        return doc


@dataclass(frozen=True)
class CatalogImport:
    """Another catalog a catalog uses: one registered on the node (``catalog``), a catalog
    file (``path``, relative to the importing file) or one published to a layer source
    (``source`` URL and ``catalog`` name). Its layers are then named by ``name@version`` and
    its environments by ``<catalog>/<name>``."""

    catalog: str | None = None
    path: str | None = None
    source: str | None = None

    def to_document(self) -> dict[str, str]:
        return {
            k: v
            for k, v in (("catalog", self.catalog), ("path", self.path), ("source", self.source))
            if v is not None
        }

    def describe(self) -> str:
        if self.path is not None:
            return f"file {self.path}"
        if self.source is not None:
            return f"catalog {self.catalog} from {self.source}"
        return f"catalog {self.catalog}"


_Named = TypeVar("_Named", "Environment", "Task")


def pick_named(items: Sequence[_Named], name: str, what: str, where: str = "") -> _Named:
    """The one of ``items`` (environments or tasks, each with ``name`` and ``catalog``) that
    ``name`` means: ``<catalog>/<name>``, or a bare name exactly one of them has. Several:
    ``AmbiguousName`` with the qualified ``choices``; none: ``UnknownEnvironment`` naming
    the known ones (``where``: in what, for the message)."""
    catalog, slash, bare = name.rpartition("/")
    if slash:
        found = [i for i in items if i.name == bare and i.catalog == catalog]
    else:
        found = [i for i in items if i.name == name]
    if len(found) == 1:
        return found[0]
    if found:
        choices = sorted(f"{i.catalog}/{i.name}" for i in found)
        raise AmbiguousName(
            f"{what} {name!r} is defined by {len(found)} catalogs: name one of "
            f"{', '.join(choices)}",
            name=name,
            choices=choices,
        )
    known = sorted({i.name for i in items})
    hint = "" if items else "; run `dsec catalog build` first"
    raise UnknownEnvironment(
        f"unknown {what} {name!r}{where} (known: {', '.join(known) or 'none'}){hint}",
        name=name,
        known=known,
    )


@dataclass(frozen=True)
class Catalog:
    """A loaded catalog. ``path`` is the file it came from; ``root`` its directory.
    ``imports`` are the catalogs it names; ``imported`` those catalogs as loaded (only when
    loaded from a file with its imports resolved: a saved catalog keeps the names alone)."""

    name: str
    layers: tuple[LayerRecipe, ...] = ()
    environments: tuple[Environment, ...] = ()
    tasks: tuple[Task, ...] = ()
    description: str = ""
    path: str = ""
    root: str = "."
    imports: tuple[CatalogImport, ...] = ()
    imported: tuple[Catalog, ...] = field(default=(), compare=False, repr=False)
    warm: tuple[WarmEntry, ...] = ()

    def __post_init__(self) -> None:
        for name in ("layers", "environments", "tasks", "imports", "imported", "warm"):
            object.__setattr__(self, name, tuple(getattr(self, name)))

    def visible_environments(self) -> list[Environment]:
        """Its own environments, then those of the catalogs it imports (transitively)."""
        out = list(self.environments)
        for other in self.imported:
            out += [e for e in other.visible_environments() if e not in out]
        return out

    def visible_layers(self) -> list[LayerRecipe]:
        """Its own layer recipes, then those of the catalogs it imports (transitively)."""
        out = list(self.layers)
        for other in self.imported:
            out += [r for r in other.visible_layers() if r.ref not in {o.ref for o in out}]
        return out

    def environment(self, name: str) -> Environment:
        """An environment by bare name (its own first: a catalog's document means its own)
        or ``<catalog>/<name>`` (its own or an imported catalog's)."""
        own = [e for e in self.environments if e.name == name]
        if own:
            return own[0]
        return pick_named(
            self.visible_environments(), name, "environment", f" in catalog {self.name}"
        )

    def task(self, name: str) -> Task:
        for task in self.tasks:
            if task.name == name or task.qualified == name:
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
        if self.imports:
            doc["imports"] = [i.to_document() for i in self.imports]
        doc["layers"] = [_recipe_document(r) for r in self.layers]
        doc["environments"] = [e.to_document() for e in self.environments]
        doc["tasks"] = [t.to_document() for t in self.tasks]
        if self.warm:
            doc["warm"] = [w.to_document() for w in self.warm]
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
    doc: Mapping[str, Any],
    root: Path,
    where: str,
    check_sources: bool,
    store: LayerStore | None = None,
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
                if store is not None and store.exists(recipe.ref):
                    continue  # built already: its source is no longer needed
                raise _invalid(
                    where,
                    ["layers", i, "source", key],
                    f"{path} does not exist (relative paths start at {root}) and "
                    f"{recipe.ref} is not built",
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
                    f"layer {ref} is neither a layer of this catalog (or one it imports) nor "
                    f"in the store (known: {', '.join(known) or 'none'}); add its recipe or "
                    "import its catalog, or build it first (`dsec catalog build` for a "
                    "catalog's layers, `dsec layer build` for a directory or image)",
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
    imported: Sequence[Catalog] = (),
) -> Catalog:
    """Check a catalog document (schema, then meaning) and make the records.

    ``imported``: the catalogs its ``imports`` name, loaded (``load_catalog`` resolves them):
    environments may use their layers, tasks their environments as ``<catalog>/<name>``.
    Without them (a saved catalog) a task's qualified environment is left to the node.

    Relative recipe paths start at ``root``; ``check_sources`` checks that they exist.
    Environments may name layers of this catalog or, if ``store`` is given, layers already in
    it; ``check_layers=False`` skips that (a saved catalog was checked when it was saved, and
    the node resolves layers against all its sources at create time). ``where`` names the
    document in error messages.
    """
    _validate_schema(doc, where)
    root = Path(root)
    name = doc["name"]
    recipes = _recipes(doc, root, where, check_sources, store)
    imports = [CatalogImport(**item) for item in doc.get("imports", [])]
    shell = Catalog(name=name, layers=tuple(recipes), imported=tuple(imported))
    environments = [
        _environment(doc, i, name, where) for i in range(len(doc.get("environments", [])))
    ]
    _unique(environments, "environments", where)
    if check_layers:
        check_environment_layers(environments, shell.visible_layers(), store, where)
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
    warm = [_warm_entry(doc, i, where) for i in range(len(doc.get("warm", [])))]
    env_names = [e.name for e in environments]
    others = Catalog(name=name, imported=tuple(imported)).visible_environments()
    for i, task in enumerate(tasks):
        unresolved = bool(imports) and not imported
        _check_task_environment(task, i, name, env_names, others, unresolved, where)
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
        imports=tuple(imports),
        imported=tuple(imported),
        warm=tuple(warm),
    )


def _warm_entry(doc: Mapping[str, Any], i: int, where: str) -> WarmEntry:
    """``$.warm[i]``, checked as a create's spec would be (sizes, CPU class)."""
    entry = WarmEntry(**doc["warm"][i])
    try:
        entry.spec()
    except InvalidSpec as err:
        key = err.context.get("field", "")
        raise _invalid(where, ["warm", i, *([key] if key else [])], str(err)) from err
    return entry


def _check_task_environment(
    task: Task,
    i: int,
    catalog: str,
    own: Sequence[str],
    imported: Sequence[Environment],
    unresolved: bool,
    where: str,
) -> None:
    """A task names its own catalog's environment bare, or any as ``<catalog>/<name>``: of
    its own catalog or of an imported one (``unresolved``: the imports are not loaded, as in
    a saved catalog; the node checks those at create time)."""
    prefix, slash, bare = task.environment.rpartition("/")
    if prefix in ("", catalog) and bare in own:
        return
    if slash and prefix != catalog:
        if unresolved or any(e.name == bare and e.catalog == prefix for e in imported):
            return
    choices = sorted(e.qualified for e in imported if e.name == bare)
    hint = f"; name an imported one as {' or '.join(choices)}" if choices and not slash else ""
    known = [*own, *(e.qualified for e in imported)]
    raise _invalid(
        where,
        ["tasks", i, "environment"],
        f"unknown environment {task.environment!r} (known: {', '.join(known) or 'none'}){hint}",
    )


#: Looks a catalog registered on the node up by name (``CatalogStore.catalog``).
Registered = Callable[[str], Catalog]
#: Fetches the document of catalog ``name`` published to the layer source at ``url``.
FetchCatalog = Callable[[str, str], Mapping[str, Any]]


def load_catalog(
    path: Path | str,
    *,
    store: LayerStore | None = None,
    registered: Registered | None = None,
    fetch: FetchCatalog | None = None,
) -> Catalog:
    """Read and check a catalog file (YAML or JSON) with the catalogs it imports; see
    ``parse_catalog``. ``{path}`` imports load here (a cycle is an error); ``{catalog}``
    imports need ``registered``, ``{source, catalog}`` imports ``fetch``."""
    return _load(Path(path), store, registered, fetch, ())


def _read_document(path: Path) -> Any:
    where = str(path)
    try:
        text = path.read_text()
    except OSError as e:
        raise CatalogInvalid(f"{where}: cannot read: {e.strerror}", path="$", file=where) from e
    try:
        return json.loads(text) if path.suffix == ".json" else yaml.safe_load(text)
    except (yaml.YAMLError, json.JSONDecodeError) as e:
        raise CatalogInvalid(
            f"{where}: not valid {'JSON' if path.suffix == '.json' else 'YAML'}: {e}",
            path="$",
            file=where,
        ) from e


def _load(
    path: Path,
    store: LayerStore | None,
    registered: Registered | None,
    fetch: FetchCatalog | None,
    chain: tuple[Path, ...],
) -> Catalog:
    where = str(path)
    doc = _read_document(path)
    root = path.resolve().parent
    imported: list[Catalog] = []
    if isinstance(doc, dict) and doc.get("imports"):
        _validate_schema(doc, where)  # the imports must make sense before they are followed
        for i, item in enumerate(doc["imports"]):
            other = _import(
                CatalogImport(**item),
                i,
                root,
                where,
                store,
                registered,
                fetch,
                (*chain, path.resolve()),
            )
            names = [doc["name"], *(c.name for c in imported)]
            if other.name in names:
                raise _invalid(
                    where,
                    ["imports", i],
                    f"imports catalog {other.name!r} twice (or its own name): catalog names "
                    "qualify environments, so they must differ",
                )
            imported.append(other)
    catalog = parse_catalog(doc, where=where, root=root, store=store, imported=imported)
    return Catalog(**{**catalog_fields(catalog), "path": str(path.resolve())})


def _import(
    spec: CatalogImport,
    i: int,
    root: Path,
    where: str,
    store: LayerStore | None,
    registered: Registered | None,
    fetch: FetchCatalog | None,
    chain: tuple[Path, ...],
) -> Catalog:
    """Load one import of the catalog at ``where`` (``chain``: the files importing it)."""
    at = ["imports", i]
    if spec.path is not None:
        file = (root / spec.path).resolve()
        if file in chain:
            cycle = " -> ".join(str(p) for p in (*chain[chain.index(file) :], file))
            raise _invalid(where, at, f"import cycle: {cycle}")
        if not file.is_file():
            raise _invalid(where, at, f"imported catalog file {file} does not exist")
        return _load(file, store, registered, fetch, chain)
    name = str(spec.catalog)
    if spec.source is not None:
        if fetch is None:
            raise _invalid(where, at, f"cannot import from {spec.source} here (no layer sources)")
        try:
            doc = fetch(spec.source, name)
            return parse_catalog(
                doc,
                where=f"{spec.source} catalog {name}",
                check_sources=False,
                check_layers=False,
            )
        except DsecError as e:
            raise _invalid(where, at, f"importing catalog {name} from {spec.source}: {e}") from e
    try:
        if registered is None:
            raise UnknownEnvironment(f"no registered catalogs to look {name!r} up in", name=name)
        return registered(name)
    except UnknownEnvironment as e:
        raise _invalid(
            where,
            at,
            f"imports catalog {name!r}, which is not registered on this node; register it "
            "first (`dsec catalog build FILE`, or `dsec catalog pull NAME --from SOURCE`), or "
            "import it by path or source",
        ) from e


def catalog_fields(catalog: Catalog) -> dict[str, Any]:
    return {k: getattr(catalog, k) for k in catalog.__dataclass_fields__}
