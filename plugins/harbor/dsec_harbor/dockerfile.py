"""A task's ``environment/Dockerfile`` read into the steps dsec replays: the base it starts
FROM, then RUN, COPY/ADD, WORKDIR, ENV, ARG and USER in order. Pure parsing, no I/O besides
reading the file, so the build (``dsec_harbor.build``) and its tests share one reading."""

from __future__ import annotations

import json
import re
import shlex
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

from dsec_core.errors import InvalidSpec

#: Instructions that change nothing a sandbox sees (metadata, or what only `docker run` reads).
IGNORED = frozenset(
    {"LABEL", "MAINTAINER", "EXPOSE", "CMD", "ENTRYPOINT", "HEALTHCHECK", "STOPSIGNAL", "VOLUME"}
)
#: Docker's PATH for an image that sets none: what ``ENV PATH=/x:$PATH`` extends.
DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
_VAR = re.compile(r"\$(?:\{([A-Za-z_][A-Za-z0-9_]*)(?::?-([^}]*))?\}|([A-Za-z_][A-Za-z0-9_]*))")


@dataclass(frozen=True)
class Run:
    """``RUN``: a shell command (``/bin/sh -c``) or, in JSON form, an argv."""

    command: str | tuple[str, ...]


@dataclass(frozen=True)
class Copy:
    """``COPY``/``ADD`` of build-context paths (relative to the context) to ``dest``."""

    sources: tuple[str, ...]
    dest: str
    chown: str | None = None


@dataclass(frozen=True)
class Recipe:
    """What a Dockerfile asks for: ``base`` (the FROM image, as written), the steps in order
    (``Run``, ``Copy``; each runs with the ENV, WORKDIR and USER in effect at it, recorded
    alongside), and the ENV, WORKDIR and USER in effect at the end, which sandboxes of the
    built environment keep (Docker's semantics)."""

    base: str
    steps: tuple[tuple[Run | Copy, dict[str, str], str, str | None], ...] = ()
    env: dict[str, str] = field(default_factory=dict)
    workdir: str = "/"
    user: str | None = None


def _logical_lines(text: str) -> list[tuple[int, str]]:
    """(line number, instruction) with comments dropped and ``\\`` continuations joined."""
    out: list[tuple[int, str]] = []
    buf: list[str] = []
    start = 0
    for n, raw in enumerate(text.splitlines(), 1):
        line = raw.rstrip()
        if not buf and (not line.strip() or line.lstrip().startswith("#")):
            continue
        if buf and line.lstrip().startswith("#"):
            continue  # a comment inside a continued instruction, as docker allows
        if not buf:
            start = n
        if line.endswith("\\"):
            buf.append(line[:-1])
            continue
        buf.append(line)
        out.append((start, " ".join(part.strip() for part in buf).strip()))
        buf = []
    if buf:
        out.append((start, " ".join(part.strip() for part in buf).strip()))
    return out


def _expand(text: str, variables: dict[str, str]) -> str:
    def sub(m: re.Match[str]) -> str:
        name = m.group(1) or m.group(3)
        if name in variables:
            return variables[name]
        return m.group(2) or ""

    return _VAR.sub(sub, text)


def _json_list(text: str) -> list[str] | None:
    if not text.startswith("["):
        return None
    try:
        value = json.loads(text)
    except ValueError:
        return None
    return [str(v) for v in value] if isinstance(value, list) else None


def _pairs(args: str, variables: dict[str, str]) -> dict[str, str]:
    """``ENV``/``ARG`` arguments: ``k=v k2="v 2"`` or the legacy ``k v``."""
    words = shlex.split(args, posix=True)
    if words and "=" not in words[0]:  # legacy form: ENV KEY the rest of the line
        key, _, value = args.partition(" ")
        return {key: _expand(value.strip(), variables)}
    out: dict[str, str] = {}
    for word in words:
        key, eq, value = word.partition("=")
        if not eq:
            out[key] = variables.get(key, "")
            continue
        out[key] = _expand(value, {**variables, **out})
    return out


def parse(path: Path | str, image_env: Mapping[str, str] | None = None) -> Recipe:
    """Read the Dockerfile at ``path``; ``image_env`` is its FROM image's ENV, which ``$NAME``
    in its instructions expand against (default: Docker's PATH alone). ``InvalidSpec``
    (naming the line) for what dsec does not replay: several stages, ``COPY --from``, ``ADD``
    of a URL, an empty file."""
    file = Path(path)
    text = file.read_text()
    base: str | None = None
    args: dict[str, str] = {}  # ARG values (their defaults: harbor passes no build args)
    env: dict[str, str] = {}
    workdir = "/"
    user: str | None = None
    steps: list[tuple[Run | Copy, dict[str, str], str, str | None]] = []

    def bad(n: int, why: str) -> InvalidSpec:
        return InvalidSpec(f"{file}:{n}: {why}", path=str(file), field="Dockerfile")

    for n, line in _logical_lines(text):
        word, _, rest = line.partition(" ")
        instruction, rest = word.upper(), rest.strip()
        variables = {"PATH": DEFAULT_PATH, **(image_env or {}), **args, **env}
        if instruction == "FROM":
            if base is not None:
                raise bad(n, "multi-stage Dockerfiles are not supported (one FROM)")
            image = rest.split()
            image = [w for w in image if not w.startswith("--platform")]
            if not image:
                raise bad(n, "FROM names no image")
            base = _expand(image[0], args)
            continue
        if instruction == "ARG":
            for key, value in _pairs(rest, variables).items():
                args.setdefault(key, value)
            continue
        if base is None:
            raise bad(n, f"{instruction} before FROM")
        if instruction in IGNORED:
            continue
        if instruction == "ENV":
            env.update(_pairs(rest, variables))
        elif instruction == "WORKDIR":
            target = PurePosixPath(workdir) / _expand(rest, variables)
            workdir = str(target)
        elif instruction == "USER":
            user = _expand(rest, variables).split(":")[0] or None
        elif instruction == "RUN":
            if rest.startswith("--"):
                raise bad(n, f"RUN flags are not supported: {rest.split()[0]}")
            argv = _json_list(rest)
            steps.append((Run(tuple(argv) if argv else rest), dict(env), workdir, user))
        elif instruction in ("COPY", "ADD"):
            chown = None
            words = _json_list(rest) or shlex.split(rest)
            while words and words[0].startswith("--"):
                flag = words.pop(0)
                if flag.startswith("--from"):
                    raise bad(n, "COPY --from (multi-stage) is not supported")
                if flag.startswith("--chown="):
                    chown = flag.partition("=")[2]
            words = [_expand(w, variables) for w in words]
            if len(words) < 2:
                raise bad(n, f"{instruction} needs a source and a destination")
            if instruction == "ADD" and any("://" in w for w in words[:-1]):
                raise bad(n, "ADD of a URL is not supported (the build has no network)")
            dest = words[-1]
            if not dest.startswith("/"):
                dest = str(PurePosixPath(workdir) / dest) + ("/" if dest.endswith("/") else "")
            steps.append((Copy(tuple(words[:-1]), dest, chown), dict(env), workdir, user))
        else:
            raise bad(n, f"unsupported instruction {instruction}")
    if base is None:
        raise InvalidSpec(f"{file}: no FROM", path=str(file), field="Dockerfile")
    return Recipe(base=base, steps=tuple(steps), env=env, workdir=workdir, user=user)
