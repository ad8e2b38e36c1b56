"""``dsec iam``: projects and API keys, worked on the IAM store directly (the machine's
operator's tool, so it needs no key itself: that is how the first admin key is made), or
through an apiserver's IAM API under a key when given both an address and a key.

The store is ``--iam URL``, else ``DSEC_IAM``, else ``$DSEC_HOME/iam.db``; the API is
``--address`` (``DSEC_ADDRESS``) with ``--api-key`` (``DSEC_API_KEY``), and then the key's role
decides what it may do (``dsec_core.iam.Iam``'s rules, the same on both paths). Either way
the commands take the same arguments and print the same output. A ``DsecError`` propagates
to the main CLI, which prints ``Error: ...`` and exits 1.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import click

from ..errors import InvalidSpec
from ..iam import ROLES, Iam, KeyInfo, Project, ProjectRevocation, Quota
from ..records import parse_size
from ..sdk import Client

__all__ = ["iam"]

UNSET = "none"
QUOTA_HELP = f"; {UNSET!r} for no bound at this level"


def _dump(data: Any) -> None:
    click.echo(json.dumps(data, indent=2))


class ThroughApi:
    """The part of ``Iam`` the commands use, through an apiserver's IAM API under a key: the
    same calls and records, so each command reads the same whichever it works on."""

    def __init__(self, client: Client) -> None:
        self.client = client

    def create_project(self, path: str, quota: Quota | None = None) -> Project:
        return self.client.create_project(path, quota)

    def projects(self, under: str | None = None) -> list[Project]:
        return self.client.projects(under)

    def project(self, path: str) -> Project:
        return self.client.project(path)

    def set_quota(self, path: str, quota: Quota) -> Project:
        return self.client.set_quota(path, quota)

    def revoke_project(self, path: str, *, force: bool = False) -> ProjectRevocation:
        return self.client.revoke_project(path, force=force)

    def create_key(
        self, project: str, role: str, name: str | None = None, *, ttl: float | None = None
    ) -> tuple[KeyInfo, str]:
        minted = self.client.create_key(project, role, name, ttl)
        return minted.key, minted.secret

    def keys(self, project: str | None = None) -> list[KeyInfo]:
        return self.client.keys(project)

    def revoke_key(self, key_id: str) -> KeyInfo:
        return self.client.revoke_key(key_id)

    def whoami(self) -> KeyInfo:
        return self.client.whoami()


@contextmanager
def _open(ctx: click.Context) -> Iterator[Any]:
    """IAM as the commands work on it: ``Iam`` over the store, or ``ThroughApi``."""
    if ctx.obj.get("address") and ctx.obj.get("api_key"):
        with Client(ctx.obj["address"], api_key=ctx.obj["api_key"], autostart=False) as client:
            yield ThroughApi(client)
        return
    with Iam.open(ctx.obj["iam_url"]) as store:
        yield store


def _when(t: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M", time.localtime(t))


def _quota_text(quota: Quota) -> tuple[str, str, str]:
    memory = "-" if quota.memory is None else f"{quota.memory / (1 << 30):g}G"
    return (
        "-" if quota.sandboxes is None else str(quota.sandboxes),
        "-" if quota.cpu is None else f"{quota.cpu:g}",
        memory,
    )


def _read_quota(base: Quota, sandboxes: str | None, cpu: str | None, memory: str | None) -> Quota:
    """``base`` with the options given replacing its fields (``none`` clears one)."""
    fields: dict[str, Any] = base.to_dict()
    for name, text in (("sandboxes", sandboxes), ("cpu", cpu), ("memory", memory)):
        if text is None:
            continue
        if text.strip().lower() == UNSET:
            fields[name] = None
        elif name == "memory":
            fields[name] = parse_size(text, "memory")
        else:
            try:
                fields[name] = int(text) if name == "sandboxes" else float(text)
            except ValueError:
                raise InvalidSpec(f"--{name}: cannot read {text!r}", field=name) from None
    return Quota(**fields)


def _quota_options(f: Any) -> Any:
    f = click.option("--memory", help="Memory of all its sandboxes: 8G, 512M, bytes" + QUOTA_HELP)(
        f
    )
    f = click.option("--cpu", help="CPU cores of all its sandboxes" + QUOTA_HELP)(f)
    f = click.option("--sandboxes", help="Sandboxes running at once" + QUOTA_HELP)(f)
    return f


def _project_line(p: Project) -> str:
    sandboxes, cpu, memory = _quota_text(p.quota)
    return f"{p.path:<40} {sandboxes:>9} {cpu:>7} {memory:>8}  {_when(p.created)}"


def _key_line(k: KeyInfo) -> str:
    expires = "-" if k.expires is None else _when(k.expires)
    return (
        f"{k.key_id:<16}  {k.project:<32} {k.role:<7} {k.name or '-':<20} {_when(k.created)}"
        f"  {expires}"
    )


@click.group()
@click.option(
    "--iam",
    "iam_url",
    envvar="DSEC_IAM",
    default=None,
    help="IAM store: sqlite:///abs/path.db or etcd://host:port[/prefix] "
    "(default: DSEC_IAM, else $DSEC_HOME/iam.db).",
)
@click.option(
    "--address",
    envvar="DSEC_ADDRESS",
    default=None,
    help="An apiserver (http(s)://host:port): work through its IAM API under --api-key "
    "instead of on the store (default: DSEC_ADDRESS).",
)
@click.option(
    "--api-key",
    envvar="DSEC_API_KEY",
    default=None,
    help="The API key to act as through --address (default: DSEC_API_KEY).",
)
@click.pass_context
def iam(ctx: click.Context, iam_url: str | None, address: str | None, api_key: str | None) -> None:
    """Projects (org/team/job, with quotas) and API keys (admin, member, agent, builder).

    Works on the store directly, as the machine's operator: the first admin key is made
    here (`dsec iam key create --project / --role admin`). The root project / always exists;
    its admins manage every org. Given an apiserver's address and an API key (--address and
    --api-key, or DSEC_ADDRESS and DSEC_API_KEY), works through its API as that key instead:
    an admin key manages its subtree, any key mints keys no wider than itself.
    """
    given = {
        name
        for name in ("address", "api_key")
        if ctx.get_parameter_source(name) is click.core.ParameterSource.COMMANDLINE
    }
    if given and not (address and api_key):  # half of it in the environment is the store's
        raise click.UsageError("--address and --api-key go together: give both, or neither")
    ctx.obj = {"iam_url": iam_url, "address": address, "api_key": api_key}


# --- dsec iam project ----------------------------------------------------------------------


@iam.group()
def project() -> None:
    """Create, list, limit and revoke projects."""


@project.command("create")
@click.argument("path")
@_quota_options
@click.option("--json", "as_json", is_flag=True, help="Print the project as JSON.")
@click.pass_context
def project_create(
    ctx: click.Context,
    path: str,
    sandboxes: str | None,
    cpu: str | None,
    memory: str | None,
    as_json: bool,
) -> None:
    """Create project PATH (org, org/team, ...) under its existing parent."""
    quota = _read_quota(Quota(), sandboxes, cpu, memory)
    with _open(ctx) as store:
        made = store.create_project(path, quota)
    if as_json:
        _dump(made.to_dict())
    else:
        click.echo(f"created project {made.path}")


@project.command("ls")
@click.argument("under", required=False)
@click.option("--json", "as_json", is_flag=True, help="Print the projects as JSON.")
@click.pass_context
def project_ls(ctx: click.Context, under: str | None, as_json: bool) -> None:
    """List projects (those in UNDER's subtree if given) with their quotas; - is no bound."""
    with _open(ctx) as store:
        found = store.projects(under)
    if as_json:
        _dump([p.to_dict() for p in found])
        return
    click.echo(f"{'PROJECT':<40} {'SANDBOXES':>9} {'CPU':>7} {'MEMORY':>8}  CREATED")
    for p in found:
        click.echo(_project_line(p))


@project.command("set-quota")
@click.argument("path")
@_quota_options
@click.option("--json", "as_json", is_flag=True, help="Print the project as JSON.")
@click.pass_context
def project_set_quota(
    ctx: click.Context,
    path: str,
    sandboxes: str | None,
    cpu: str | None,
    memory: str | None,
    as_json: bool,
) -> None:
    """Change PATH's quota: the options given replace those fields, the rest stay."""
    with _open(ctx) as store:
        quota = _read_quota(store.project(path).quota, sandboxes, cpu, memory)
        updated = store.set_quota(path, quota)
    if as_json:
        _dump(updated.to_dict())
    else:
        click.echo(_project_line(updated))


@project.command("revoke")
@click.argument("path")
@click.option("--force", is_flag=True, help="Also revoke its subprojects and their keys.")
@click.option("--json", "as_json", is_flag=True, help="Print what was revoked as JSON.")
@click.pass_context
def project_revoke(ctx: click.Context, path: str, force: bool, as_json: bool) -> None:
    """Revoke project PATH; one with subprojects or keys only with --force."""
    with _open(ctx) as store:
        gone = store.revoke_project(path, force=force)
    if as_json:
        _dump(gone.to_dict())
    else:
        click.echo(
            f"revoked {', '.join(gone.projects)}"
            + (f" and {len(gone.keys)} key(s)" if gone.keys else "")
        )


# --- dsec iam key --------------------------------------------------------------------------


@iam.group()
def key() -> None:
    """Create, list and revoke API keys."""


@key.command("create")
@click.option("--project", "project_path", required=True, help="Project path; / is the root.")
@click.option("--role", required=True, type=click.Choice(ROLES), help="What the key may do.")
@click.option("--name", default=None, help="A name, unique in the project.")
@click.option("--ttl", type=float, default=None, help="Seconds until it expires (default: never).")
@click.option("--json", "as_json", is_flag=True, help="Print the key and its secret as JSON.")
@click.pass_context
def key_create(
    ctx: click.Context,
    project_path: str,
    role: str,
    name: str | None,
    ttl: float | None,
    as_json: bool,
) -> None:
    """Create an API key and print its secret: shown this once, only its hash is kept."""
    with _open(ctx) as store:
        info, secret = store.create_key(project_path, role, name, ttl=ttl)
    if as_json:
        _dump({"key": info.to_dict(), "secret": secret})
        return
    click.echo(
        f"key {info.key_id} ({info.role} of {info.project}); its secret, shown only now:",
        err=True,
    )
    click.echo(secret)


@key.command("ls")
@click.option("--project", "project_path", default=None, help="Only this project's subtree.")
@click.option("--json", "as_json", is_flag=True, help="Print the keys as JSON.")
@click.pass_context
def key_ls(ctx: click.Context, project_path: str | None, as_json: bool) -> None:
    """List API keys (never their secrets)."""
    with _open(ctx) as store:
        found = store.keys(project_path)
    if as_json:
        _dump([k.to_dict() for k in found])
        return
    click.echo(f"{'KEY':<16}  {'PROJECT':<32} {'ROLE':<7} {'NAME':<20} {'CREATED':<16}  EXPIRES")
    for k in found:
        click.echo(_key_line(k))


@key.command("revoke")
@click.argument("key_id")
@click.pass_context
def key_revoke(ctx: click.Context, key_id: str) -> None:
    """Revoke API key KEY_ID: it stops working at once (within 2 s in running apiservers)."""
    with _open(ctx) as store:
        info = store.revoke_key(key_id)
    click.echo(f"revoked key {info.key_id} ({info.role} of {info.project})")


@iam.command("whoami")
@click.option("--json", "as_json", is_flag=True, help="Print the key as JSON.")
@click.pass_context
def whoami(ctx: click.Context, as_json: bool) -> None:
    """The API key given (--api-key, through --address): its id, project, role, expiry."""
    with _open(ctx) as store:
        if not isinstance(store, ThroughApi):
            raise InvalidSpec(
                "whoami asks an apiserver about a key: give --address and --api-key "
                "(or DSEC_ADDRESS and DSEC_API_KEY)",
                field="address",
            )
        info = store.whoami()
    if as_json:
        _dump(info.to_dict())
    else:
        click.echo(_key_line(info))
