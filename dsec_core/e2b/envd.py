"""envd's paths, as the SDK calls them on ``E2B_SANDBOX_URL``: ``GET /health``, ``GET``/``POST
/files``, and the Connect services ``process.Process`` and ``filesystem.Filesystem``. The
sandbox is the ``E2b-Sandbox-Id`` header; the caller, the ``X-Access-Token`` header."""

from __future__ import annotations

from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from ..errors import DsecError, RequestTimeout, RequestTooLarge, UnknownSandbox
from .callers import Connect, caller_client, envd_key, sandbox_of
from .connect import (
    CODE_STATUS,
    STREAM_CONTENT_TYPE,
    RpcError,
    end_stream,
    read_message,
    rpc_error,
    timeout_seconds,
    unary_error,
)
from .filesystem import FILESYSTEM_UNARY, absolute, read_file, write_files
from .process import (
    close_stdin,
    connect_events,
    keepalive_interval,
    list_processes,
    send_input,
    send_signal,
    start_events,
    stream_input,
    update,
)
from .watch import Watchers, watch_dir_events

__all__ = ["envd_refusal", "envd_routes"]

_PROCESS_UNARY = {
    "SendSignal": send_signal,
    "List": list_processes,
    "SendInput": send_input,
    "CloseStdin": close_stdin,
    "Update": update,
}
#: Calls envd has that dsec does not, each with why (the SDK raises them as
#: ``SandboxException: Code.UNIMPLEMENTED: ...``).
_UNSUPPORTED: dict[tuple[str, str], str] = {}
#: Server streams that follow something already there (a running command, a directory):
#: each ``(connect, key, sid, message, keepalive)`` -> its envelopes.
_FOLLOWED = {
    ("process.Process", "Connect"): connect_events,
    ("filesystem.Filesystem", "WatchDir"): watch_dir_events,
}
_SERVICES = ("process.Process", "filesystem.Filesystem")
_STREAMS = {("process.Process", "Start"), ("process.Process", "Connect")}
_STREAMS |= {("filesystem.Filesystem", "WatchDir"), ("process.Process", "StreamInput")}


def _http_error(e: DsecError | RpcError, sid: str = "") -> JSONResponse:
    """envd's HTTP error: a gone sandbox is the 502 E2B's proxy answers (the SDK raises
    ``SandboxNotRunningException``), an upload over ``MAX_UPLOAD`` is 413, one that stalls
    408 (closing the connection), the rest by their Connect code's status."""
    if isinstance(e, (RequestTooLarge, RequestTimeout)):
        close = {"connection": "close"} if isinstance(e, RequestTimeout) else None
        return JSONResponse(
            {"code": e.http_status, "message": e.message}, status_code=e.http_status, headers=close
        )
    err = e if isinstance(e, RpcError) else rpc_error(e, sid)
    status = 502 if err.code == "unavailable" else CODE_STATUS[err.code]
    return JSONResponse({"code": status, "message": err.message}, status_code=status)


def envd_routes(connect: Connect) -> list[Route]:
    watchers = Watchers(connect)
    watcher_calls = {
        "CreateWatcher": watchers.create,
        "GetWatcherEvents": watchers.events,
        "RemoveWatcher": watchers.remove,
    }

    async def health(request: Request) -> Response:
        """204 while the sandbox runs; 502 "... was not found" once it is gone, which is how
        the SDK's ``is_running`` and its error probes tell."""
        try:
            sid = sandbox_of(request)
            async with caller_client(connect, envd_key(request)) as client:
                info = (await client.get(sid)).info
                if info.state not in ("running",):
                    raise UnknownSandbox(f"sandbox {sid} is {info.state}", name=sid)
            return Response(status_code=204)
        except DsecError as e:
            return _http_error(e, request.headers.get("e2b-sandbox-id", ""))

    async def files(request: Request) -> Response:
        sid = ""
        try:
            sid = sandbox_of(request)
            async with caller_client(connect, envd_key(request)) as client:
                if request.method == "GET":
                    return await read_file(client, sid, absolute(request.query_params.get("path")))
                return await write_files(client, sid, request)
        except (DsecError, RpcError) as e:
            return _http_error(e, sid)

    async def rpc(request: Request) -> Response:
        name = (request.url.path.split("/")[-2], request.path_params["method"])
        stream = name in _STREAMS
        try:
            sid = sandbox_of(request)
            key = envd_key(request)
            if name == ("process.Process", "StreamInput"):  # a client stream: read as it comes
                return Response(
                    await stream_input(connect, key, sid, request), media_type=STREAM_CONTENT_TYPE
                )
            message = await read_message(request, stream=stream)
            timeout = timeout_seconds(request)
        except (DsecError, RpcError) as e:
            err = e if isinstance(e, RpcError) else rpc_error(e)
            return _stream_error(err) if stream else unary_error(err)
        if name in _UNSUPPORTED:
            err = RpcError("unimplemented", f"{name[0]}/{name[1]}: {_UNSUPPORTED[name]} by dsec")
            return _stream_error(err) if stream else unary_error(err)
        keepalive = keepalive_interval(request.headers.get("keepalive-ping-interval"))
        if name == ("process.Process", "Start"):
            events = start_events(connect, key, sid, message, timeout, keepalive)
            return StreamingResponse(events, media_type=STREAM_CONTENT_TYPE)
        if name in _FOLLOWED:
            events = _FOLLOWED[name](connect, key, sid, message, keepalive)
            return StreamingResponse(events, media_type=STREAM_CONTENT_TYPE)
        if name[0] == "filesystem.Filesystem" and name[1] in watcher_calls:
            try:
                return JSONResponse(await watcher_calls[name[1]](key, sid, message))
            except RpcError as e:
                return unary_error(e)
        call: Any = None
        if name[0] == "process.Process":
            call = _PROCESS_UNARY.get(name[1])
        elif name[0] == "filesystem.Filesystem":
            call = FILESYSTEM_UNARY.get(name[1])
        if call is None:
            return unary_error(RpcError("unimplemented", f"no method {name[0]}/{name[1]}"))
        try:
            async with caller_client(connect, key) as client:
                return JSONResponse(await call(client, sid, message))
        except RpcError as e:
            return unary_error(e)
        except DsecError as e:
            return unary_error(rpc_error(e, sid))

    return [
        Route("/health", health, methods=["GET"]),
        Route("/files", files, methods=["GET", "POST"]),
        *(Route(f"/{s}/{{method:str}}", rpc, methods=["POST"]) for s in _SERVICES),
    ]


def _stream_error(err: RpcError) -> Response:
    return Response(end_stream(err), media_type=STREAM_CONTENT_TYPE)


def envd_refusal(path: str, e: DsecError) -> Response | None:
    """envd's answer to a request refused before its route ran (a missing or wrong key: the
    apiserver checks keys first), as the SDK expects it on ``path``; None if ``path`` is not
    envd's."""
    if path in ("/health", "/files"):
        return _http_error(e)
    service, _, method = path.strip("/").partition("/")
    if service not in _SERVICES or not method:
        return None
    err = rpc_error(e)
    return _stream_error(err) if (service, method) in _STREAMS else unary_error(err)
