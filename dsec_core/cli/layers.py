"""``dsec layer`` and ``dsec catalog``: build, list and remove layers; build, check and remove
catalogs.

Stores live under ``$DSEC_HOME`` (``NodeConfig.from_env()``). A ``DsecError`` propagates to the
main CLI, which prints ``Error: ...`` and exits 1.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import click
from rich.console import Console
from rich.progress import BarColumn, Progress, TaskID, TextColumn, TimeElapsedColumn

from ..catalog.build import build_catalog
from ..catalog.distribution import publish_catalog, pull_catalog
from ..catalog.model import Catalog, default_catalog_file, load_catalog
from ..catalog.store import CatalogStore
from ..config import NodeConfig
from ..errors import DsecError, InvalidSpec, LayerCorrupt, UnknownEnvironment
from ..layers.build import build_layer
from ..layers.image import export_image, import_dockerfile, import_image
from ..layers.recipes import build_dir_at
from ..layers.store import LayerStore
from ..plugins import registry
from ..read_profiles import profile_catalog
from ..records import LAYER_KINDS, LayerInfo
from ..sdk import Client
from ..sources.base import LayerSource
from ..sources.transfer import Transfer, pull_layer, push_layer

__all__ = ["catalog", "layer"]


def _stores() -> tuple[NodeConfig, LayerStore, CatalogStore]:
    config = NodeConfig.from_env()
    return config, LayerStore(config.layer_dir), CatalogStore(config.catalog_dir)


def _size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024  # type: ignore[assignment]
    return str(n)


@contextmanager
def _progress_bars() -> Iterator[Callable[[str, float | None], None]]:
    """A ``progress(stage, fraction)`` callback drawing one rich bar per layer being built.

    Stages look like ``"name@version: stage"``; a plain stage belongs to one unnamed bar.
    """
    console = Console(stderr=True)
    bars: dict[str, TaskID] = {}
    with Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        TimeElapsedColumn(),
        console=console,
        transient=False,
        disable=not console.is_terminal,
    ) as progress:

        def update(stage: str, fraction: float | None) -> None:
            owner, sep, what = stage.partition(": ")
            if not sep:
                owner, what = "", stage
            if owner not in bars:
                bars[owner] = progress.add_task(owner or "layer", total=1.0)
            label = f"{owner} {what}".strip()
            if fraction is None:
                progress.update(bars[owner], description=label, total=None)
            else:
                progress.update(bars[owner], description=label, total=1.0, completed=fraction)

        yield update
        for task in bars.values():
            progress.update(task, total=1.0, completed=1.0)


def _layer_line(info: LayerInfo, profiled: str | None = None) -> str:
    created = time.strftime("%Y-%m-%d %H:%M", time.localtime(info.created))
    extra = "" if profiled is None else f"{profiled:>8}  "
    return (
        f"{info.ref:<32} {info.kind:<9} {_size(info.size):>10}  "
        f"{info.digest.removeprefix('sha256:')[:12]}  {created}  {extra}{info.source}"
    )


# --- dsec layer ----------------------------------------------------------------------------


@click.group()
def layer() -> None:
    """Build, list and remove read-only EROFS layers in the local store."""


@layer.command("build")
@click.argument("source")
@click.option("--name", required=True, help="Layer name.")
@click.option(
    "--version", default=None, help="Layer version (default: 12 hex digits of the digest)."
)
@click.option(
    "--kind", required=True, type=click.Choice(LAYER_KINDS), help="What the layer is for."
)
@click.option(
    "--keep-owners/--all-root",
    default=None,
    help="Keep file owners, or make root own everything (default: all-root for "
    "directories, keep for tar and docker sources).",
)
@click.option(
    "--to",
    "to",
    default=None,
    help="Where a directory SOURCE goes inside the layer, such as /workspace/x "
    "(default: the layer's root).",
)
def layer_build(
    source: str,
    name: str,
    version: str | None,
    kind: str,
    keep_owners: bool | None,
    to: str | None,
) -> None:
    """Build a layer from SOURCE: a directory, a .tar/.tar.gz/.tgz file or docker:IMAGE."""
    _, store, _ = _stores()
    all_root = None if keep_owners is None else not keep_owners
    with _progress_bars() as progress:

        def report(stage: str, fraction: float | None) -> None:
            progress(f"{name}: {stage}", fraction)

        if to is not None and to != "/":
            if not Path(source).is_dir():
                raise InvalidSpec(f"--to places a directory; {source} is not one", field="to")
            info = build_dir_at(
                source,
                to,
                name=name,
                version=version,
                kind=kind,
                store=store,
                progress=report,
                all_root=all_root is not False,
            )
        else:
            info = build_layer(
                source,
                name=name,
                version=version,
                kind=kind,
                store=store,
                progress=report,
                all_root=all_root,
            )
    click.echo(f"{info.ref} {info.kind} {_size(info.size)} {info.digest}")


@layer.command("ls")
@click.option("--json", "as_json", is_flag=True, help="Print the layers as JSON.")
def layer_ls(as_json: bool) -> None:
    """List the layers in the local store.

    PROFILED is how much of a layer's data its read profile covers (`dsec catalog profile`),
    or - if it has none.
    """
    _, store, _ = _stores()
    infos = store.list()
    profiles = {}
    for info in infos:
        try:
            profiles[info.digest] = store.load_profile(info)
        except LayerCorrupt:
            profiles[info.digest] = None  # unusable; publishing ignores it the same way
    if as_json:
        rows = []
        for info in infos:
            p = profiles[info.digest]
            rows.append(
                info.to_dict()
                | {
                    "read_profile": None
                    if p is None
                    else {
                        "read_bytes": p.read_bytes,
                        "blob_bytes": p.blob_size,
                        "workload": p.workload,
                    }
                }
            )
        click.echo(json.dumps(rows, indent=2))
        return
    click.echo(
        f"{'LAYER':<32} {'KIND':<9} {'SIZE':>10}  {'DIGEST':<12}  {'CREATED':<16}  "
        f"{'PROFILED':>8}  SOURCE"
    )
    for info in infos:
        p = profiles[info.digest]
        click.echo(_layer_line(info, f"{p.read_bytes / max(1, p.blob_size):.1%}" if p else "-"))


@layer.command("rm")
@click.argument("ref")
@click.option("--force", is_flag=True, help="Even if snapshots are taken over it.")
def layer_rm(ref: str, force: bool) -> None:
    """Remove layer REF (name@version); its image goes when no other ref uses it."""
    _, store, _ = _stores()
    info = store.remove(ref, force=force)
    click.echo(f"removed {info.ref} ({info.digest[:19]})")


# --- dsec catalog --------------------------------------------------------------------------


@click.group()
def catalog() -> None:
    """Build, list and check catalogs of layers, environments and tasks."""


@catalog.command("build")
@click.argument("file", required=False, type=click.Path(dir_okay=False))
def catalog_build(file: str | None) -> None:
    """Build the missing layers of catalog FILE (default: the shipped catalog) and register it."""
    _, layers, catalogs = _stores()
    path = Path(file) if file else default_catalog_file()
    cat = _load(path)
    had = {i.ref for i in layers.list()}
    started = time.monotonic()

    def pull(url: str, name: str) -> None:
        pull_catalog(name, _source(url), layers, catalogs, report=click.echo)

    with _progress_bars() as progress:
        infos = build_catalog(cat, layers, catalogs, progress, pull)
    for info in infos:
        state = "present" if info.ref in had else "built"
        click.echo(
            f"{state:8} {info.ref:32} {info.kind:9} {_size(info.size):>10}  {info.digest[:19]}"
        )
    click.echo(
        f"catalog {cat.name}: {len(cat.environments)} environments, {len(cat.tasks)} tasks "
        f"({time.monotonic() - started:.1f}s)"
    )
    shadowed = catalogs.shadowed(cat)
    if shadowed:
        click.echo(
            f"note: other catalogs define these names too: {', '.join(shadowed)}; a bare "
            f"name is now ambiguous, name it as {cat.name}/NAME or CATALOG/NAME"
        )


def _load(path: Path | str) -> Catalog:
    """Load a catalog file with its imports: registered catalogs from this node, published
    ones fetched from their layer source."""
    _, layers, catalogs = _stores()
    return load_catalog(
        path,
        store=layers,
        registered=catalogs.catalog,
        fetch=lambda url, name: _source(url).get_catalog(name),
    )


@catalog.command("rm")
@click.argument("name")
def catalog_rm(name: str) -> None:
    """Unregister catalog NAME: its environments and tasks are gone from this node; its
    layers stay in the store (remove them with `dsec layer rm`)."""
    _, _, catalogs = _stores()
    cat = catalogs.catalog(name)
    catalogs.remove(name)
    click.echo(
        f"removed catalog {name} ({len(cat.environments)} environments, {len(cat.tasks)} "
        f"tasks); its layers stay: {', '.join(r.ref for r in cat.layers) or 'none'}"
    )


@catalog.command("ls")
@click.option("--json", "as_json", is_flag=True, help="Print environments and tasks as JSON.")
def catalog_ls(as_json: bool) -> None:
    """List the environments and tasks of the built catalogs."""
    _, _, catalogs = _stores()
    envs, tasks = catalogs.environments(), catalogs.tasks()
    if as_json:
        click.echo(
            json.dumps(
                {
                    "environments": [
                        {
                            **e.to_document(),
                            "catalog": e.catalog,
                            "qualified": e.qualified,
                            "layers": e.layer_refs(),
                        }
                        for e in envs
                    ],
                    "tasks": [
                        {**t.to_document(), "catalog": t.catalog, "qualified": t.qualified}
                        for t in tasks
                    ],
                },
                indent=2,
            )
        )
        return
    click.echo(f"{'ENVIRONMENT':<32} {'WORKDIR':<28} LAYERS (top first)")
    for e in envs:
        click.echo(f"{e.qualified:<32} {e.workdir:<28} {', '.join(e.layer_refs())}")
    click.echo()
    click.echo(f"{'TASK':<32} {'ENVIRONMENT':<32} {'REWARD':<10} {'EXPECT':>6}  COMMAND")
    for t in tasks:
        expect = "-" if t.expect is None else f"{t.expect:g}"
        click.echo(
            f"{t.qualified:<32} {t.qualified_environment:<32} {t.reward:<10} {expect:>6}  "
            f"{t.command}"
        )


@catalog.command("validate")
@click.argument("file", type=click.Path(dir_okay=False))
def catalog_validate(file: str) -> None:
    """Check catalog FILE against the schema and for missing layers, without building.

    A layer already built may have lost its source directory: it is not needed any more."""
    cat = _load(file)
    click.echo(
        f"{file}: ok: catalog {cat.name} with {len(cat.layers)} layers, "
        f"{len(cat.environments)} environments, {len(cat.tasks)} tasks"
    )


# --- distribution: layer sources --------------------------------------------------------------


def _transfer_line(verb: str, t: Transfer) -> str:
    """``pushed``/``pulled`` (or ``present`` when nothing moved), ref, size, short digest."""
    order = "  (data in read-profile order)" if t.moved and t.profiled else ""
    return f"{verb if t.moved else 'present':7} {t.ref}  {_size(t.size)}  {t.digest[:19]}{order}"


def _source(url: str) -> LayerSource:
    return registry().open_source(url, NodeConfig.from_env())


@layer.command("push")
@click.argument("refs", nargs=-1, required=True)
@click.option(
    "--to", "url", required=True, help="Layer source URL (posix:/path, s3://..., oci://...)."
)
def layer_push(refs: tuple[str, ...], url: str) -> None:
    """Upload layers from this node's store to a layer source (already there: no-op).

    A layer with a read profile (`dsec catalog profile`) is published with its data blob in
    first-read order.
    """
    _, store, _ = _stores()
    dest = _source(url)
    for ref in refs:
        t = push_layer(ref, dest, store)
        click.echo(_transfer_line("pushed", t))


@layer.command("pull")
@click.argument("refs", nargs=-1, required=True)
@click.option("--from", "url", required=True, help="Layer source URL.")
def layer_pull(refs: tuple[str, ...], url: str) -> None:
    """Fetch layers into this node's store; every byte is checked against the layer's digest."""
    _, store, _ = _stores()
    src = _source(url)
    for ref in refs:
        t = pull_layer(ref, src, store)
        click.echo(_transfer_line("pulled", t))


@catalog.command("publish")
@click.argument("catalog_ref")
@click.option("--to", "url", required=True, help="Layer source URL.")
def catalog_publish(catalog_ref: str, url: str) -> None:
    """Publish a catalog (a built catalog's name, or a catalog file) and the layers it uses."""
    _, store, _ = _stores()
    publish_catalog(_catalog_arg(catalog_ref), _source(url), store, report=click.echo)


def _catalog_arg(catalog_ref: str) -> Catalog:
    """A catalog named on the command line: a catalog file, or a built catalog's name."""
    _, store, catalogs = _stores()
    path = Path(catalog_ref)
    if path.suffix in (".yaml", ".yml", ".json") and path.exists():
        return _load(path)
    return catalogs.catalog(catalog_ref)


@catalog.command("profile")
@click.argument("catalog_ref")
@click.option("--task", "tasks", multiple=True, help="Run only this task (repeatable).")
def catalog_profile(catalog_ref: str, tasks: tuple[str, ...]) -> None:
    """Record what the catalog's tasks read of each layer, so publishing stores it first.

    Runs each task once, one after another, on a private node that loads the layers on
    demand, and saves a read profile with every layer read. `layer push` and `catalog
    publish` then store those layers' data blobs in first-read order: a sandbox doing
    similar work fetches a few consecutive chunks instead of one per scattered file.
    """
    config, _, _ = _stores()
    saved = profile_catalog(_catalog_arg(catalog_ref), config, tasks, report=click.echo)
    click.echo(f"saved {len(saved)} read profile(s); publish to use them")


@catalog.command("pull")
@click.argument("name")
@click.option("--from", "url", required=True, help="Layer source URL.")
def catalog_pull(name: str, url: str) -> None:
    """Fetch a published catalog and all its layers, and register it on this node."""
    _, store, catalogs = _stores()
    pull_catalog(name, _source(url), store, catalogs, report=click.echo)


@catalog.command("remote-ls")
@click.option("--from", "url", required=True, help="Layer source URL.")
def catalog_remote_ls(url: str) -> None:
    """List the catalogs and layers a layer source holds."""
    src = _source(url)
    for name in src.catalogs():
        click.echo(f"catalog  {name}")
    for info in src.list():
        click.echo(f"layer    {_layer_line(info)}")


@layer.command("prefetch")
@click.argument("refs", nargs=-1, required=True)
def layer_prefetch(refs: tuple[str, ...]) -> None:
    """Warm layers on the local node: every chunk of on-demand layers, whole remote images."""
    with Client() as client:
        for row in client.prefetch(list(refs)):
            extra = (
                f" ({row['fetched']} of {row['chunks']} chunks fetched)"
                if row["mode"] == "on-demand"
                else ""
            )
            click.echo(f"{row['layer']}: {row['mode']} from {row['source']}{extra}")


# --- dsec layer export / import (docker and OCI images) -------------------------------------


def _export_stack(
    args: tuple[str, ...], store: LayerStore, catalogs: CatalogStore
) -> tuple[list[str], dict[str, str], str]:
    """What ``dsec layer export`` writes: layer refs (top first), env and workdir, from either
    one environment name, one snapshot layer (with the layers it was taken over) or layer
    refs given top first."""
    if len(args) == 1 and "@" not in args[0]:
        try:
            env = catalogs.environment(args[0])
        except UnknownEnvironment as unknown:
            try:
                store.resolve(args[0])  # a layer name, newest version
            except DsecError:
                raise unknown from None
        else:
            return env.layer_refs(), dict(env.env), env.workdir
    if len(args) == 1:
        info = store.resolve(args[0])
        if info.kind == "snapshot":
            pairs = (item.split("=", 1) for item in info.env if "=" in item)
            return [info.ref, *info.parents], dict(pairs), info.workdir or "/"
    return [store.resolve(ref).ref for ref in args], {}, "/"


@layer.command("export")
@click.argument("what", nargs=-1, required=True)
@click.option("-o", "--output", required=True, type=click.Path(dir_okay=False), help="FILE.tar")
@click.option("--tag", required=True, help="Image name in the archive (NAME[:TAG]).")
@click.option("--env", "env", multiple=True, help="KEY=VALUE for the image (repeatable).")
@click.option("--workdir", default=None, help="Working directory (default: the environment's).")
@click.option("--cmd", default=None, help="Default command, run by /bin/sh -c.")
def layer_export(
    what: tuple[str, ...],
    output: str,
    tag: str,
    env: tuple[str, ...],
    workdir: str | None,
    cmd: str | None,
) -> None:
    """Export an image archive (`docker load -i FILE`) of WHAT: an environment, a snapshot
    layer (stacked on the layers it was taken over), or layer refs given top first."""
    _, store, catalogs = _stores()
    refs, stack_env, stack_workdir = _export_stack(what, store, catalogs)
    for item in env:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise click.BadParameter(f"{item!r} is not KEY=VALUE", param_hint="--env")
        stack_env[key] = value
    with _progress_bars() as progress:
        path = export_image(
            store,
            refs,
            Path(output),
            tag=tag,
            env=stack_env,
            workdir=workdir or stack_workdir,
            cmd=["/bin/sh", "-c", cmd] if cmd else None,
            progress=progress,
        )
    click.echo(f"{path} {tag} {_size(path.stat().st_size)} ({len(refs)} layers: {', '.join(refs)})")


@layer.command("import")
@click.argument("image", required=False)
@click.option(
    "--archive", type=click.Path(dir_okay=False, exists=True), help="A `docker save` archive."
)
@click.option(
    "--dockerfile",
    "context",
    type=click.Path(file_okay=False, exists=True),
    help="A Dockerfile's build context directory, built with docker.",
)
@click.option("--file", "file", default=None, help="The Dockerfile (default: CONTEXT/Dockerfile).")
@click.option("--name", required=True, help="Layer name.")
@click.option(
    "--version", default=None, help="Layer version (default: 12 hex digits of the digest)."
)
def layer_import(
    image: str | None,
    archive: str | None,
    context: str | None,
    file: str | None,
    name: str,
    version: str | None,
) -> None:
    """Make a base layer of a docker image's filesystem: IMAGE (already in the local docker;
    nothing is pulled), --archive FILE or --dockerfile DIR."""
    given = [x for x in (image, archive, context) if x]
    if len(given) != 1:
        raise click.UsageError("give exactly one of IMAGE, --archive FILE or --dockerfile DIR")
    if file and not context:
        raise click.UsageError("--file names the Dockerfile of a --dockerfile build")
    _, store, _ = _stores()
    with _progress_bars() as progress:
        report = lambda stage, f: progress(f"{name}: {stage}", f)  # noqa: E731
        if context:
            info = import_dockerfile(
                store, context, name=name, version=version, dockerfile=file, progress=report
            )
        else:
            info = import_image(
                store,
                Path(archive) if archive else str(image),
                name=name,
                version=version,
                progress=report,
            )
    click.echo(f"{info.ref} {info.kind} {_size(info.size)} {info.digest}")
