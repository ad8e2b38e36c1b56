"""An E2B-compatible API over dsec: the stock ``e2b`` SDK runs against it unchanged.

Point the SDK at the server that mounts this app (the apiserver, or any ASGI server)::

    E2B_API_URL=http://127.0.0.1:8700 E2B_SANDBOX_URL=http://127.0.0.1:8700 \\
    E2B_API_KEY=<a dsec API key> python agent.py

Both URLs are the same server: the control plane (``/v2/sandboxes``, ``/sandboxes/{id}/...``;
JSON over HTTP) and envd (``/health``, ``/files``, the Connect-RPC services
``process.Process`` and ``filesystem.Filesystem``, JSON codec) live side by side; with
``E2B_SANDBOX_URL`` set the SDK names the sandbox in an ``E2b-Sandbox-Id`` header.

``make_app(connect)`` builds the app; ``connect(api_key)`` returns (or awaits to) a
``dsec.AsyncClient`` acting for that caller, which the app closes when the request is done.
A request without a key is the SDK's ``AuthenticationException`` (401); what ``connect`` or
the node raises maps to E2B's answers (404 unknown, 429 admission or quota, 400 bad input,
409 paused, 5xx the rest).

Templates are built through E2B's template API (``Template.build``: ``template_routes``, with
the build in ``template_build`` and the records in ``templates``; served when the app is given
a store, as the apiserver gives its IAM store), else they are dsec environments:
``DSEC_E2B_TEMPLATES="base=python,web=node20"`` maps names, ``base`` (E2B's default) is
``python`` unless mapped otherwise, and any other name is taken as an environment's own name.
``timeout`` is the sandbox's ttl, ``metadata`` its labels ``e2b.meta.<key>``, ``envs`` its
environment.

Commands are the node's interactive processes (``process_start``): ``stdin=True`` with
``send_stdin``/``stream_input``/``close_stdin``, PTYs (``sandbox.pty``: a pseudo-terminal of
the sandbox's own, resized by ``resize``) and ``commands.connect`` (output from then on) work
as under envd.

``allow_internet_access=True`` is dsec's ``network="internet"``: out through the node's NAT,
with private ranges, cloud metadata and the node's own addresses refused (false or absent:
loopback only, dsec's default). Metadata filters match keys and values exactly, whatever they
hold (the SDK's double quoting is undone). ``files.rename`` makes the destination's missing
directories, as envd does. ``files.watch_dir`` (recursive too; sync polling and the async
stream) runs the sandbox's agent binary as an inotify watcher (``watch.py``); its events are
envd's, without ``include_entry`` (the SDK refuses it for envd 0.6.1).

Not supported, each with the error the SDK raises for it: file metadata: the SDK's own
``TemplateException`` (envd 0.6.1 is announced); gzip uploads: ``InvalidArgumentException``;
``network``, ``mcp``, ``volume_mounts`` and ``lifecycle`` (auto pause/resume) on create:
``SandboxException`` with status 400; snapshots,
forks, metrics, volumes and secrets: no route, so the SDK's error for a 404
or 405. Commands run as root whatever ``user`` says; relative paths start at ``/root``;
``commands.list`` shows each command's argv as it runs now, without its ``envs``; process
tags are not kept (a tag selector is not found). A command runs on when the SDK lets go of its
stream (``disconnect()``, a dropped handle, the program ending), as under envd, until it ends,
its ``timeout`` kills it, ``kill`` does, or the sandbox dies (or the node daemon stops, which
holds it); what it started in the background (``cmd &``) runs on too.
``download_url``/``upload_url`` signatures are not checked (a request needs the
``X-Access-Token`` header).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from starlette.applications import Starlette
from starlette.responses import Response
from starlette.routing import BaseRoute

from ..errors import DsecError
from .callers import ENVD_PORT, Connect
from .envd import envd_refusal, envd_routes
from .lifecycle import (
    DEFAULT_TEMPLATES,
    ENVD_VERSION,
    Templates,
    lifecycle_refusal,
    lifecycle_routes,
)
from .template_routes import BuiltTemplates, template_refusal, template_routes
from .templates import FileStore, TemplateStore

__all__ = [
    "DEFAULT_TEMPLATES",
    "ENVD_PORT",
    "ENVD_VERSION",
    "Connect",
    "Templates",
    "e2b_refusal",
    "e2b_routes",
    "make_app",
]


def e2b_routes(
    connect: Connect,
    templates: Templates | None = None,
    store: Any = None,
    files: FileStore | None = None,
) -> list[BaseRoute]:
    """The E2B API's routes, for another app's route table (the apiserver serves them beside
    its own ``/v1`` ones on one listener): ``connect`` turns each request's API key into a dsec
    client; ``templates`` (default: ``DSEC_E2B_TEMPLATES`` over ``DEFAULT_TEMPLATES``) maps
    template names to environments. With ``store`` (an ``IamStore``: the apiserver's IAM
    store) the template API is served too, its uploads kept in ``files`` (default:
    ``DSEC_E2B_FILES``), and sandboxes are created from built templates first."""
    templates = templates if templates is not None else Templates.from_env()
    extra: list[BaseRoute] = []
    if store is not None:
        tstore = TemplateStore(store)
        templates = replace(templates, built=BuiltTemplates(tstore))
        extra = list(template_routes(connect, tstore, files or FileStore(), templates))
    return [*lifecycle_routes(connect, templates), *extra, *envd_routes(connect)]


def e2b_refusal(path: str, e: DsecError) -> Response | None:
    """The E2B API's answer to a request refused before any route ran (no key, or one IAM
    does not know: the apiserver checks keys before reading anything), in the shape the SDK
    expects on ``path``; None for a path that is not the E2B API's."""
    return lifecycle_refusal(path, e) or template_refusal(path, e) or envd_refusal(path, e)


def make_app(connect: Connect, templates: Templates | None = None) -> Starlette:
    """The E2B API as an ASGI app of its own (``e2b_routes``)."""
    return Starlette(routes=e2b_routes(connect, templates))
