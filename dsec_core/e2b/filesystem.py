"""envd's file side over dsec's file calls: ``GET``/``POST /files`` (plain HTTP bodies, as
the SDK's ``files.read`` and ``files.write`` send them) and the ``filesystem.Filesystem``
Connect service's ``Stat``, ``ListDir``, ``MakeDir``, ``Remove`` and ``Move``.

Bodies never sit whole in memory: a read goes through a temporary file (dsec's ``download``
writes it piece by piece, and it is streamed out as it is read back); an upload is spooled to
one and sent with ``upload``, piece by piece.
"""

from __future__ import annotations

import contextlib
import os
import posixpath
import shutil
import stat
import tempfile
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import IO, Any

from starlette.datastructures import UploadFile
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from ..errors import InvalidSpec, SandboxPathError
from ..records import FileEntry
from .connect import ENOENT, RpcError

__all__ = [
    "FILESYSTEM_UNARY",
    "HOME",
    "absolute",
    "entry_info",
    "read_file",
    "write_files",
]

#: Where relative paths start: a dsec sandbox's commands and files are root's.
HOME = "/root"
PIECE = 1 << 20
MAX_DEPTH_ENTRIES = 10_000  # a ListDir with depth > 1 stops here

_TYPES = {"file": "FILE_TYPE_FILE", "dir": "FILE_TYPE_DIRECTORY", "symlink": "FILE_TYPE_SYMLINK"}
_MODE_BITS = {"file": stat.S_IFREG, "dir": stat.S_IFDIR, "symlink": stat.S_IFLNK}


def absolute(path: Any, field: str = "path") -> str:
    if not isinstance(path, str) or not path or "\0" in path:
        raise InvalidSpec(f"{field} must be a path, got {path!r}", field=field)
    return posixpath.normpath(posixpath.join(HOME, path))


def entry_info(entry: FileEntry, path: str) -> dict[str, Any]:
    """envd's ``EntryInfo`` (protobuf JSON) for a dsec ``FileEntry`` at ``path``."""
    mode = entry.mode & 0o7777
    return {
        "name": entry.name,
        "type": _TYPES.get(entry.type, "FILE_TYPE_UNSPECIFIED"),
        "path": path,
        "size": str(entry.size),  # int64: a string in protobuf JSON
        "mode": mode,
        "permissions": stat.filemode(_MODE_BITS.get(entry.type, 0) | mode),
        "modifiedTime": datetime.fromtimestamp(entry.mtime, UTC).isoformat().replace("+00:00", "Z"),
        "isSymlink": entry.type == "symlink",
    }


async def _run(client: Any, sid: str, argv: list[str], what: str) -> None:
    """A helper command for what dsec has no file call for; a failure is the path's error."""
    r = await client.exec(sid, argv, timeout=60)
    if r.exit_code != 0:
        message = r.stderr.decode("utf-8", "replace").strip() or f"{what} failed"
        errno = ENOENT if "No such file" in message else 0
        raise SandboxPathError(message, path=argv[-1], errno=errno, sandbox_id=sid)


async def _stat(client: Any, sid: str, message: dict[str, Any]) -> dict[str, Any]:
    path = absolute(message.get("path"))
    return {"entry": entry_info(await client.stat(sid, path), path)}


async def _list_dir(client: Any, sid: str, message: dict[str, Any]) -> dict[str, Any]:
    root = absolute(message.get("path"))
    depth = message.get("depth") or 1
    if not isinstance(depth, int) or depth < 1:
        raise RpcError("invalid_argument", f"depth must be at least 1, got {depth!r}")
    out: list[dict[str, Any]] = []
    level = [root]
    for _ in range(depth):
        nxt = []
        for d in level:
            for e in await client.list_dir(sid, d):
                path = posixpath.join(d, e.name)
                out.append(entry_info(e, path))
                if e.type == "dir":
                    nxt.append(path)
            if len(out) > MAX_DEPTH_ENTRIES:
                raise RpcError("resource_exhausted", f"more than {MAX_DEPTH_ENTRIES} entries")
        level = nxt
    return {"entries": out}


async def _make_dir(client: Any, sid: str, message: dict[str, Any]) -> dict[str, Any]:
    path = absolute(message.get("path"))
    with contextlib.suppress(SandboxPathError):
        await client.stat(sid, path)
        raise RpcError("already_exists", f"{path} already exists")
    await _run(client, sid, ["mkdir", "-p", "--", path], "mkdir")
    return {"entry": entry_info(await client.stat(sid, path), path)}


async def _remove(client: Any, sid: str, message: dict[str, Any]) -> dict[str, Any]:
    path = absolute(message.get("path"))
    await client.remove(sid, path, recursive=True)
    return {}


async def _move(client: Any, sid: str, message: dict[str, Any]) -> dict[str, Any]:
    source = absolute(message.get("source"), "source")
    destination = absolute(message.get("destination"), "destination")
    await client.stat(sid, source)  # a missing source is not_found, as in envd
    await _run(client, sid, ["mv", "-f", "--", source, destination], "mv")
    return {"entry": entry_info(await client.stat(sid, destination), destination)}


#: The unary calls of ``filesystem.Filesystem`` dsec answers; the watcher calls are not here.
FILESYSTEM_UNARY = {
    "Stat": _stat,
    "ListDir": _list_dir,
    "MakeDir": _make_dir,
    "Remove": _remove,
    "Move": _move,
}


def _chunks(f: IO[bytes]) -> Iterator[bytes]:
    with f:
        while piece := f.read(PIECE):
            yield piece


async def read_file(client: Any, sid: str, path: str) -> Response:
    """The file's bytes as a streamed body. dsec's ``download`` writes them to a temporary
    file; it is unlinked at once and read back from its descriptor as the body goes out."""
    tmp = tempfile.mkdtemp(prefix="dsec-e2b-read-")
    try:
        local = Path(tmp) / "body"
        await client.download(sid, path, local)
        f = open(local, "rb")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return StreamingResponse(_chunks(f), media_type="application/octet-stream")


async def _upload(client: Any, sid: str, local: str, path: str) -> dict[str, Any]:
    """``upload`` to ``path``, making its parent directories first if they are missing (as
    envd does), and envd's ``WriteInfo`` for it."""
    try:
        await client.upload(sid, local, path, mode=0o644)
    except SandboxPathError as e:
        if e.context.get("errno") != ENOENT:
            raise
        await _run(client, sid, ["mkdir", "-p", "--", posixpath.dirname(path)], "mkdir")
        await client.upload(sid, local, path, mode=0o644)
    return {"name": posixpath.basename(path), "type": "file", "path": path}


async def _spool_body(request: Request, local: str) -> None:
    with open(local, "wb") as f:
        async for piece in request.stream():
            f.write(piece)


async def _spool_part(part: UploadFile, local: str) -> None:
    with open(local, "wb") as f:
        while piece := await part.read(PIECE):
            f.write(piece)


async def write_files(client: Any, sid: str, request: Request) -> Response:
    """``POST /files``: one ``application/octet-stream`` body to ``?path=``, or
    ``multipart/form-data`` with a ``file`` part per file (its filename is its path; ``?path=``
    wins for a single one). Answers envd's list of ``WriteInfo``."""
    query_path = request.query_params.get("path")
    kind = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if request.headers.get("content-encoding", "identity") != "identity":
        raise InvalidSpec("compressed uploads (gzip=True) are not supported", field="gzip")
    with tempfile.TemporaryDirectory(prefix="dsec-e2b-write-") as tmp:
        local = os.path.join(tmp, "body")
        if kind == "multipart/form-data":
            out = []
            async with request.form(max_files=1000, max_part_size=PIECE) as form:
                parts = [p for p in form.getlist("file") if isinstance(p, UploadFile)]
                if not parts:
                    raise InvalidSpec("no file part in the upload", field="file")
                for part in parts:
                    name = query_path if query_path and len(parts) == 1 else part.filename
                    await _spool_part(part, local)
                    out.append(await _upload(client, sid, local, absolute(name)))
            return JSONResponse(out)
        if not query_path:
            raise InvalidSpec("an octet-stream upload needs ?path=", field="path")
        await _spool_body(request, local)
        return JSONResponse([await _upload(client, sid, local, absolute(query_path))])
