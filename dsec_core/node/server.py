"""The node daemon's HTTP API (served on a unix socket): a thin JSON skin over ``Node``.

Errors travel as ``{"error": {"type", "message", "context"}}`` with the error's HTTP status, so
the client raises the same ``DsecError`` subclass the node raised.
"""

from __future__ import annotations

import base64
import logging
import os
import traceback
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from .. import __version__
from ..errors import DsecError, InvalidSpec
from ..records import SandboxSpec
from .node import Node

__all__ = ["make_app"]

log = logging.getLogger("dsec.api")


def _json(data: Any, status: int = 200) -> JSONResponse:
    return JSONResponse(data, status_code=status)


async def _body(request: Request) -> dict[str, Any]:
    try:
        data = await request.json()
    except ValueError as e:
        raise InvalidSpec(f"request body is not JSON: {e}") from e
    if not isinstance(data, dict):
        raise InvalidSpec("request body must be a JSON object")
    return data


def _exec_args(data: dict[str, Any]) -> dict[str, Any]:
    stdin = data.get("stdin")
    return {
        "timeout": data.get("timeout"),
        "stdin": base64.b64decode(stdin) if stdin is not None else None,
        "max_output": int(data.get("max_output") or (1 << 20)),
    }


def _int_param(request: Request, name: str, default: int) -> int:
    try:
        return int(request.query_params.get(name, default))
    except ValueError:
        raise InvalidSpec(f"query parameter {name} must be an integer") from None


def _path_param(request: Request) -> str:
    path = request.query_params.get("path")
    if not path:
        raise InvalidSpec("missing query parameter: path")
    return path


def make_app(node: Node, lifespan=None) -> Starlette:
    async def node_info(request: Request) -> Response:
        return _json({
            "version": __version__, "pid": os.getpid(), "home": os.fspath(node.config.home),
            "sandboxes": len(node.sandboxes),
            "capacity": {"cpu": node.config.cpu_capacity, "memory": node.config.memory_capacity,
                         "sandboxes": node.config.max_sandboxes},
            "backends": sorted(node.registry.backends),
            "layer_sources": [repr(s) for s in node.layer_sources],
        })

    async def create(request: Request) -> Response:
        data = await _body(request)
        spec = SandboxSpec.from_dict(data.get("spec") or {})
        count = int(data.get("count") or 1)
        if count < 1:
            raise InvalidSpec(f"count must be at least 1, got {count}")
        if count == 1:
            return _json({"sandboxes": [(await node.create(spec)).to_dict()]}, 201)
        results = await node.create_many_settled(spec, count)
        return _json({"sandboxes": [r.to_dict() for r in results if not isinstance(r, Exception)],
                      "errors": [r.to_wire() for r in results if isinstance(r, DsecError)]}, 201)

    async def list_sandboxes(request: Request) -> Response:
        return _json({"sandboxes": [s.to_dict() for s in node.list()]})

    async def get_sandbox(request: Request) -> Response:
        return _json(node.get(request.path_params["sid"]).to_dict())

    async def kill(request: Request) -> Response:
        await node.kill(request.path_params["sid"])
        return _json({"killed": request.path_params["sid"]})

    async def usage(request: Request) -> Response:
        return _json(node.usage(request.path_params["sid"]).to_dict())

    async def exec_(request: Request) -> Response:
        data = await _body(request)
        cmd = data.get("cmd")
        if not cmd or not isinstance(cmd, (str, list)):
            raise InvalidSpec("exec needs cmd: a string or a list of strings")
        result = await node.exec(request.path_params["sid"], cmd, cwd=data.get("cwd"),
                                 env=data.get("env"), **_exec_args(data))
        return _json(result.to_dict())

    async def session_open(request: Request) -> Response:
        data = await _body(request)
        ses = await node.session_open(request.path_params["sid"], cwd=data.get("cwd"),
                                      env=data.get("env"))
        return _json({"session": ses}, 201)

    async def session_list(request: Request) -> Response:
        return _json({"sessions": await node.sessions(request.path_params["sid"])})

    async def session_exec(request: Request) -> Response:
        data = await _body(request)
        cmd = data.get("cmd")
        if not isinstance(cmd, str) or not cmd:
            raise InvalidSpec("session exec needs cmd: a shell command string")
        result = await node.session_exec(request.path_params["sid"],
                                         request.path_params["ses"], cmd, **_exec_args(data))
        return _json(result.to_dict())

    async def session_close(request: Request) -> Response:
        await node.session_close(request.path_params["sid"], request.path_params["ses"])
        return _json({"closed": request.path_params["ses"]})

    async def file_get(request: Request) -> Response:
        data = await node.read_file(request.path_params["sid"], _path_param(request),
                                    _int_param(request, "offset", 0),
                                    _int_param(request, "length", -1))
        return Response(data, media_type="application/octet-stream")

    async def file_put(request: Request) -> Response:
        body = await request.body()
        await node.write_file(request.path_params["sid"], _path_param(request), body,
                              mode=int(request.query_params.get("mode", "644"), 8),
                              offset=_int_param(request, "offset", 0),
                              truncate=request.query_params.get("truncate", "1") == "1")
        return _json({"written": len(body)})

    async def file_delete(request: Request) -> Response:
        await node.remove(request.path_params["sid"], _path_param(request),
                          recursive=request.query_params.get("recursive") == "1")
        return _json({"removed": _path_param(request)})

    async def list_dir(request: Request) -> Response:
        entries = await node.list_dir(request.path_params["sid"], _path_param(request))
        return _json({"entries": [e.to_dict() for e in entries]})

    async def stat(request: Request) -> Response:
        return _json((await node.stat(request.path_params["sid"], _path_param(request))).to_dict())

    async def prefetch(request: Request) -> Response:
        data = await _body(request)
        refs = data.get("refs")
        if not isinstance(refs, list) or not refs:
            raise InvalidSpec("prefetch needs refs: a list of name@version")
        return _json({"layers": await node.prefetch(refs)})

    async def layers(request: Request) -> Response:
        return _json({"layers": [i.to_dict() for s in node.layer_sources for i in s.list()]})

    async def on_dsec_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, DsecError)
        return _json({"error": exc.to_wire()}, exc.http_status)

    async def on_other_error(request: Request, exc: Exception) -> Response:
        log.error("internal error on %s %s\n%s", request.method, request.url.path,
                  "".join(traceback.format_exception(exc)))
        return _json({"error": {"type": "DsecError", "message":
                                f"internal error in the node daemon: {type(exc).__name__}: {exc}",
                                "context": {}}}, 500)

    sb = "/v1/sandboxes/{sid}"
    routes = [
        Route("/v1/node", node_info),
        Route("/v1/sandboxes", create, methods=["POST"]),
        Route("/v1/sandboxes", list_sandboxes, methods=["GET"]),
        Route(sb, get_sandbox, methods=["GET"]),
        Route(sb, kill, methods=["DELETE"]),
        Route(sb + "/usage", usage),
        Route(sb + "/exec", exec_, methods=["POST"]),
        Route(sb + "/sessions", session_open, methods=["POST"]),
        Route(sb + "/sessions", session_list, methods=["GET"]),
        Route(sb + "/sessions/{ses}/exec", session_exec, methods=["POST"]),
        Route(sb + "/sessions/{ses}", session_close, methods=["DELETE"]),
        Route(sb + "/file", file_get, methods=["GET"]),
        Route(sb + "/file", file_put, methods=["PUT"]),
        Route(sb + "/file", file_delete, methods=["DELETE"]),
        Route(sb + "/ls", list_dir),
        Route(sb + "/stat", stat),
        Route("/v1/layers", layers),
        Route("/v1/layers/prefetch", prefetch, methods=["POST"]),
    ]
    return Starlette(routes=routes, lifespan=lifespan,
                     exception_handlers={DsecError: on_dsec_error, Exception: on_other_error})
