"""envd's file side over dsec's file calls: ``GET``/``POST /files`` (plain HTTP bodies, as
the SDK's ``files.read`` and ``files.write`` send them) and the ``filesystem.Filesystem``
Connect service's ``Stat``, ``ListDir``, ``MakeDir``, ``Remove`` and ``Move``.

Bodies never sit whole in memory: a read goes through a temporary file (dsec's ``download``
writes it piece by piece, and it is streamed out as it is read back); an upload is spooled to
one (a multipart upload, one per file part, as the parts arrive) and sent with ``upload``,
piece by piece. An upload is at most ``MAX_UPLOAD`` bytes (``DSEC_MAX_UPLOAD``; 413 beyond,
refused from its Content-Length before anything is spooled) and must keep coming
(``DSEC_BODY_TIMEOUT``; 408); its spool is removed whatever happens.
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

from python_multipart.exceptions import FormParserError
from python_multipart.multipart import MultipartParser, parse_options_header
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from ..api.routes import MAX_UPLOAD
from ..api.serving import body_pieces, check_declared
from ..errors import InvalidSpec, SandboxPathError
from ..records import FileEntry
from .connect import ENOENT, RpcError

__all__ = [
    "FILESYSTEM_UNARY",
    "HOME",
    "MAX_FILES",
    "absolute",
    "entry_info",
    "read_file",
    "write_files",
]

#: Where relative paths start: a dsec sandbox's commands and files are root's.
HOME = "/root"
PIECE = 1 << 20
MAX_DEPTH_ENTRIES = 10_000  # a ListDir with depth > 1 stops here
#: The most file parts one multipart upload may have.
MAX_FILES = 1000
#: The most bytes of headers one part of a multipart upload may have.
MAX_PART_HEADERS = 64 << 10

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
    # envd makes the destination's missing parent directories first
    parent = posixpath.dirname(destination)
    await _run(
        client,
        sid,
        [
            "sh",
            "-c",
            'mkdir -p -- "$1" && exec mv -f -- "$2" "$3"',
            "mv",
            parent,
            source,
            destination,
        ],
        "mv",
    )
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
        async for piece in body_pieces(request, MAX_UPLOAD):
            f.write(piece)


class _PartSpool:
    """The parser callbacks that spool each ``file`` part (one with a filename) of a
    multipart body to a file of its own in ``directory`` as it arrives, and drop any other
    part as it comes; what a part's headers may hold is bounded by ``MAX_PART_HEADERS``."""

    def __init__(self, directory: str) -> None:
        self.directory = directory
        self.files: list[tuple[str, str]] = []  # (filename, spooled copy), parts complete
        self._current: tuple[str, str] | None = None
        self._out: IO[bytes] | None = None
        self._headers: dict[bytes, bytes] = {}
        self._field = self._value = b""
        self._header_bytes = 0

    def on_part_begin(self) -> None:
        self._headers, self._header_bytes = {}, 0

    def on_header_field(self, data: bytes, start: int, end: int) -> None:
        self._count(end - start)
        self._field += data[start:end]

    def on_header_value(self, data: bytes, start: int, end: int) -> None:
        self._count(end - start)
        self._value += data[start:end]

    def _count(self, n: int) -> None:
        self._header_bytes += n
        if self._header_bytes > MAX_PART_HEADERS:
            raise InvalidSpec(
                f"a part of the upload has over {MAX_PART_HEADERS} bytes of headers",
                field="file",
                limit=MAX_PART_HEADERS,
            )

    def on_header_end(self) -> None:
        self._headers[self._field.lower()] = self._value
        self._field = self._value = b""

    def on_headers_finished(self) -> None:
        _, options = parse_options_header(self._headers.get(b"content-disposition"))
        if options.get(b"name") != b"file" or b"filename" not in options:
            return  # not a file: its data is dropped
        if len(self.files) >= MAX_FILES:
            raise InvalidSpec(f"an upload may have {MAX_FILES} files at most", field="file")
        raw = options[b"filename"]
        try:
            filename = raw.decode()
        except UnicodeDecodeError:
            filename = raw.decode("latin-1")
        local = os.path.join(self.directory, f"part-{len(self.files)}")
        self._out = open(local, "wb")
        self._current = (filename, local)

    def on_part_data(self, data: bytes, start: int, end: int) -> None:
        if self._out is not None:
            self._out.write(data[start:end])

    def on_part_end(self) -> None:
        if self._out is not None and self._current is not None:
            self._out.close()
            self.files.append(self._current)
        self._out, self._current = None, None

    @property
    def in_part(self) -> bool:
        """Whether a file part is begun and not ended (at the body's end: cut short)."""
        return self._out is not None

    def close(self) -> None:
        if self._out is not None:
            self._out.close()
            self._out = None


async def _spool_parts(request: Request, directory: str) -> list[tuple[str, str]]:
    """The file parts of a ``multipart/form-data`` upload, each spooled into ``directory``:
    (filename, spooled copy) in order."""
    _, params = parse_options_header(request.headers.get("content-type"))
    boundary = params.get(b"boundary")
    if not boundary:
        raise InvalidSpec("a multipart upload needs a boundary", field="content-type")
    spool = _PartSpool(directory)
    try:
        parser = MultipartParser(
            boundary,
            {
                "on_part_begin": spool.on_part_begin,
                "on_part_data": spool.on_part_data,
                "on_part_end": spool.on_part_end,
                "on_header_field": spool.on_header_field,
                "on_header_value": spool.on_header_value,
                "on_header_end": spool.on_header_end,
                "on_headers_finished": spool.on_headers_finished,
            },
        )
        async for piece in body_pieces(request, MAX_UPLOAD):
            parser.write(piece)
        parser.finalize()
        if spool.in_part:
            raise InvalidSpec("the upload ended inside a part", field="file")
    except FormParserError as e:
        raise InvalidSpec(f"the upload is no multipart/form-data: {e}", field="file") from None
    finally:
        spool.close()
    return spool.files


async def write_files(client: Any, sid: str, request: Request) -> Response:
    """``POST /files``: one ``application/octet-stream`` body to ``?path=``, or
    ``multipart/form-data`` with a ``file`` part per file (its filename is its path; ``?path=``
    wins for a single one). Answers envd's list of ``WriteInfo``."""
    query_path = request.query_params.get("path")
    kind = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if request.headers.get("content-encoding", "identity") != "identity":
        raise InvalidSpec("compressed uploads (gzip=True) are not supported", field="gzip")
    check_declared(request, MAX_UPLOAD)  # before anything is spooled
    with tempfile.TemporaryDirectory(prefix="dsec-e2b-write-") as tmp:
        if kind == "multipart/form-data":
            parts = await _spool_parts(request, tmp)
            if not parts:
                raise InvalidSpec("no file part in the upload", field="file")
            out = []
            for filename, local in parts:
                name = query_path if query_path and len(parts) == 1 else filename
                out.append(await _upload(client, sid, local, absolute(name)))
            return JSONResponse(out)
        if not query_path:
            raise InvalidSpec("an octet-stream upload needs ?path=", field="path")
        local = os.path.join(tmp, "body")
        await _spool_body(request, local)
        return JSONResponse([await _upload(client, sid, local, absolute(query_path))])
