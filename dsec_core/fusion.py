"""SandboxFusion's ``POST /run_code``, translated: its request into a ``CodeRun`` (what to write,
compile and run in a warm FnCall member, with which limits) and a ``CodeRunResult`` back into
its answer, so stock clients (the ``sandbox_fusion`` package, verl's code rewards) run code on
a node or an apiserver unchanged. The node runs a ``CodeRun`` (``dsec_core.node.coderun``);
the node and the apiserver both serve ``fusion_endpoint`` over it.

The shapes are SandboxFusion's (its client's ``RunCodeRequest`` and ``RunCodeResponse``):

- request: ``code``, ``language``, ``compile_timeout`` and ``run_timeout`` (seconds, 10 by
  default), ``memory_limit_MB`` (verl's; absent or -1: no limit of the run's own, the member's
  applies), ``stdin`` (a string, passed byte for byte as UTF-8; null: end of input at once;
  lone surrogates ``\\udc80``-``\\udcff`` stand for the raw bytes 0x80-0xff, Python's
  ``surrogateescape``, so input that is not UTF-8 fits in JSON), ``files`` (path -> base64,
  written before the run, relative to the working directory), ``fetch_files`` (paths read back
  after the run, base64 in the answer's ``files``; a missing one is left out). Other fields
  are ignored, as SandboxFusion ignores them.
- answer (``application/json``): ``status`` (``Success``: every stage finished with 0;
  ``Failed``: a stage did not; ``SandboxError``: dsec could not run it), ``message``,
  ``compile_result`` (null for interpreted languages) and ``run_result`` (null after a compile
  failure), each ``{status, execution_time, cpu_time, return_code, stdout, stderr}`` with
  ``status`` ``Finished``, ``Error`` or ``TimeLimitExceeded`` (then ``return_code`` is null),
  output kept up to ``KEEP_OUTPUT`` bytes a stream; ``executor_pod_name`` (the member) and
  ``files``.
- bad input (a body that is not JSON, a field of the wrong type, an unknown language) is a 422
  whose body has SandboxFusion's answer fields (``status: SandboxError``, ``message``) and its
  server's ``detail``, plus dsec's ``error``; never a 500.

Which environment runs a language is the operator's (``DSEC_FUSION_ENVIRONMENTS``, e.g.
``cpp=dev,python=python``); the defaults are the default catalog's ``python`` (python3, bash)
and ``dev`` (build-essential's g++ and gcc).
"""

from __future__ import annotations

import base64
import binascii
import json
import math
import os
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from .errors import DsecError, InvalidSpec, RequestTooLarge

__all__ = [
    "KEEP_OUTPUT",
    "LANGUAGES",
    "MAX_BODY",
    "CodeRun",
    "CodeRunResult",
    "Language",
    "StageResult",
    "answer",
    "environments",
    "error_answer",
    "for_pool",
    "fusion_endpoint",
    "member_memory",
    "parse_request",
]

JSON = "application/json"
#: How much of each stage's stdout and of its stderr an answer keeps.
KEEP_OUTPUT = 1 << 20
#: The largest request body (code, stdin and base64 files together).
MAX_BODY = 64 << 20
#: SandboxFusion's default compile and run timeouts, in seconds.
DEFAULT_TIMEOUT = 10.0
#: The longest timeout a request may ask for.
MAX_TIMEOUT = 3600.0
#: The largest ``memory_limit_MB`` (1 TiB): beyond any node; what no node admits is refused
#: there.
MAX_MEMORY_MB = 1 << 20
#: A member's memory when the request sets no limit of its own; with one, the member gets the
#: limit plus ``MEMBER_HEADROOM`` (rounded up to ``MEMBER_STEP``, so that requests with close
#: limits share a pool): the compiler runs in the member's limit, the program in its own.
DEFAULT_MEMBER_MEMORY = 1 << 30
MEMBER_HEADROOM = 256 << 20
MEMBER_STEP = 256 << 20


@dataclass(frozen=True)
class Language:
    """How a language runs: the file its code goes to, the compile command (None: none),
    the run command (shell commands in the working directory) and its default environment."""

    source: str
    run: str
    compile: str | None = None
    environment: str = "python"


#: The languages served, by SandboxFusion's names.
LANGUAGES: Mapping[str, Language] = {
    "python": Language("main.py", "python3 main.py"),
    "bash": Language("main.sh", "bash main.sh"),
    "cpp": Language(
        "main.cpp",
        "./main",
        compile="g++ -O2 -std=gnu++17 -pthread -o main main.cpp",
        environment="dev",
    ),
    "c": Language("main.c", "./main", compile="gcc -O2 -o main main.c -lm", environment="dev"),
    "perl": Language("main.pl", "perl main.pl", environment="dev"),
}


@dataclass(frozen=True)
class CodeRun:
    """One program to run in a warm member of ``environment``'s FnCall pool: ``files`` (the
    code among them) written to the working directory, ``compile`` run once (a failure ends
    it), then ``run`` with ``stdin``, each stage with its own wall-clock timeout; the run under
    ``memory_limit`` bytes of its own (None: only the member's ``memory``); ``fetch_files``
    read back afterwards. ``project`` and ``start`` are an FnCall's."""

    language: str
    environment: str
    run: str
    compile: str | None = None
    files: Mapping[str, bytes] = field(default_factory=dict)
    stdin: bytes = b""
    compile_timeout: float = DEFAULT_TIMEOUT
    run_timeout: float = DEFAULT_TIMEOUT
    memory_limit: int | None = None
    fetch_files: tuple[str, ...] = ()
    memory: int = DEFAULT_MEMBER_MEMORY
    cpu: float = 1.0
    project: str | None = None
    start: bool = True


@dataclass(frozen=True)
class StageResult:
    """One stage (compile or run): ``status`` is ``Finished`` (it exited, ``return_code``
    says how), ``TimeLimitExceeded`` (killed at its timeout; no return code) or ``Error``
    (dsec could not run it; ``stderr`` says why)."""

    status: str
    execution_time: float
    return_code: int | None
    stdout: bytes = b""
    stderr: bytes = b""
    cpu_time: float | None = None

    @property
    def ok(self) -> bool:
        return self.status == "Finished" and self.return_code == 0


@dataclass(frozen=True)
class CodeRunResult:
    """What a ``CodeRun`` did: its stages (``compile`` None without one, ``run`` None after a
    compile failure), the fetched files and the member that ran it."""

    compile: StageResult | None
    run: StageResult | None
    files: Mapping[str, bytes] = field(default_factory=dict)
    member: str = ""

    @property
    def status(self) -> str:
        stages = [s for s in (self.compile, self.run) if s is not None]
        return "Success" if self.run is not None and all(s.ok for s in stages) else "Failed"


# --- the request --------------------------------------------------------------------------
def environments() -> dict[str, str]:
    """Each language's environment: the defaults with ``DSEC_FUSION_ENVIRONMENTS``
    (``LANG=ENV,...``) over them."""
    found = {name: lang.environment for name, lang in LANGUAGES.items()}
    text = os.environ.get("DSEC_FUSION_ENVIRONMENTS", "").strip()
    for item in filter(None, (i.strip() for i in text.split(","))):
        name, eq, env = (p.strip() for p in item.partition("="))
        if not eq or not env or name not in LANGUAGES:
            raise InvalidSpec(
                f"DSEC_FUSION_ENVIRONMENTS: {item!r} is not LANGUAGE=ENVIRONMENT with a "
                f"language of {sorted(LANGUAGES)}",
                field="DSEC_FUSION_ENVIRONMENTS",
            )
        found[name] = env
    return found


def member_memory(memory_limit: int | None) -> int:
    """The member memory for a run limited to ``memory_limit`` bytes (see ``MEMBER_STEP``)."""
    if memory_limit is None:
        return DEFAULT_MEMBER_MEMORY
    want = memory_limit + MEMBER_HEADROOM
    return max(DEFAULT_MEMBER_MEMORY, -(-want // MEMBER_STEP) * MEMBER_STEP)


def parse_request(raw: bytes) -> CodeRun:
    """The ``CodeRun`` a ``/run_code`` body asks for; ``InvalidSpec`` naming the field if
    it is not one SandboxFusion would take, or asks for a language not served here."""
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise InvalidSpec(f"the body is not JSON: {e}", field="body") from e
    if not isinstance(body, dict):
        raise InvalidSpec("the body must be a JSON object", field="body")
    code = body.get("code")
    if not isinstance(code, str):
        raise InvalidSpec("code must be a string (the program)", field="code")
    name = body.get("language")
    if not isinstance(name, str) or name not in LANGUAGES:
        raise InvalidSpec(
            f"unsupported language {name!r}; this server runs {', '.join(sorted(LANGUAGES))}",
            field="language",
            supported=sorted(LANGUAGES),
        )
    lang = LANGUAGES[name]
    stdin = body.get("stdin")
    if stdin is not None and not isinstance(stdin, str):
        raise InvalidSpec("stdin must be a string or null", field="stdin")
    limit_mb = body.get("memory_limit_MB")
    if limit_mb is not None and (
        not isinstance(limit_mb, (int, float))
        or isinstance(limit_mb, bool)
        or not math.isfinite(limit_mb)
        or limit_mb > MAX_MEMORY_MB
    ):
        raise InvalidSpec(
            f"memory_limit_MB must be a number of MiB (at most {MAX_MEMORY_MB}; -1: none)",
            field="memory_limit_MB",
        )
    limit = int(limit_mb * (1 << 20)) if limit_mb is not None and limit_mb > 0 else None
    files = {lang.source: _bytes(code, "code")}
    files.update(_files(body.get("files")))
    fetch = body.get("fetch_files") or []
    if not isinstance(fetch, list) or not all(isinstance(p, str) and p for p in fetch):
        raise InvalidSpec("fetch_files must be a list of paths", field="fetch_files")
    return CodeRun(
        language=name,
        environment=environments()[name],
        run=lang.run,
        compile=lang.compile,
        files=files,
        stdin=b"" if stdin is None else _bytes(stdin, "stdin"),
        compile_timeout=_seconds(body, "compile_timeout"),
        run_timeout=_seconds(body, "run_timeout"),
        memory_limit=limit,
        fetch_files=tuple(fetch),
        memory=member_memory(limit),
    )


def _files(value: Any) -> dict[str, bytes]:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise InvalidSpec("files must be an object of path -> base64", field="files")
    out = {}
    for path, data in value.items():
        if data is None:  # SandboxFusion's Optional[str]: nothing to write
            continue
        if not path or not isinstance(data, str):
            raise InvalidSpec(f"files: {path!r} needs base64 contents", field="files")
        try:
            out[path] = base64.b64decode(data, validate=True)
        except (binascii.Error, ValueError) as e:
            raise InvalidSpec(f"files: {path!r} is not base64: {e}", field="files") from e
    return out


def _bytes(text: str, what: str) -> bytes:
    try:
        return text.encode("utf-8", "surrogateescape")
    except UnicodeEncodeError as e:  # a lone surrogate that stands for no byte
        raise InvalidSpec(f"{what}: {e}", field=what) from e


def _seconds(body: Mapping[str, Any], name: str) -> float:
    value = body.get(name)
    if value is None:
        return DEFAULT_TIMEOUT
    if (
        not isinstance(value, (int, float))
        or isinstance(value, bool)
        or not math.isfinite(value)
        or not 0 < value <= MAX_TIMEOUT
    ):
        raise InvalidSpec(f"{name} must be seconds in (0, {MAX_TIMEOUT:g}]", field=name)
    return float(value)


# --- the answer ---------------------------------------------------------------------------
def answer(result: CodeRunResult) -> bytes:
    """The ``/run_code`` answer of ``result``, as JSON."""
    return _dump(
        {
            "status": result.status,
            "message": "",
            "compile_result": _stage(result.compile),
            "run_result": _stage(result.run),
            "executor_pod_name": result.member or None,
            "files": {p: base64.b64encode(d).decode() for p, d in result.files.items()},
        }
    )


def _stage(s: StageResult | None) -> dict[str, Any] | None:
    if s is None:
        return None
    return {
        "status": s.status,
        "execution_time": round(s.execution_time, 6),
        "cpu_time": s.cpu_time,
        "return_code": s.return_code,
        "stdout": _text(s.stdout),
        "stderr": _text(s.stderr),
    }


def _text(data: bytes) -> str:
    # cut at KEEP_OUTPUT; bytes that are not UTF-8 become U+FFFD, which every JSON parser takes
    return data[:KEEP_OUTPUT].decode("utf-8", "replace")


def error_answer(err: DsecError) -> Response:
    """``err`` in SandboxFusion's shape (``status: SandboxError`` and ``message``, its server's
    ``detail``) and dsec's (``error``), with the error's HTTP status."""
    content = {
        "status": "SandboxError",
        "message": err.message,
        "detail": err.message,
        "compile_result": None,
        "run_result": None,
        "files": {},
        "error": err.to_wire(),
    }
    return Response(_dump(content), err.http_status, media_type=JSON)


def _dump(content: Any) -> bytes:
    return json.dumps(content, ensure_ascii=False).encode()


# --- serving ------------------------------------------------------------------------------
#: Runs a parsed request for a server (the node runs it; the apiserver places it on a node).
Runner = Callable[[Request, bytes, CodeRun], Awaitable[bytes]]


def fusion_endpoint(run: Runner) -> Callable[[Request], Awaitable[Response]]:
    """A Starlette endpoint for ``POST /run_code`` that reads and checks the body, gives the
    body and its ``CodeRun`` to ``run`` and answers what that returns (an ``answer``); a
    ``DsecError`` is answered by ``error_answer``."""

    async def endpoint(request: Request) -> Response:
        try:
            raw = await _read(request)
            spec = parse_request(raw)
            return Response(await run(request, raw, spec), media_type=JSON)
        except DsecError as e:
            return error_answer(e)

    return endpoint


async def _read(request: Request) -> bytes:
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > MAX_BODY:
            raise RequestTooLarge(f"a /run_code body is at most {MAX_BODY >> 20} MiB")
        chunks.append(chunk)
    return b"".join(chunks)


def for_pool(spec: CodeRun, project: str | None, start: bool) -> CodeRun:
    """``spec`` in ``project``'s pool (``start``: whether it may start a member)."""
    return replace(spec, project=project, start=start)
