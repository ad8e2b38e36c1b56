"""How ``dsec_harbor.dockerfile`` reads the Dockerfiles Harbor's tasks are written in: ARG and
ENV expansion as docker does it, the exec (JSON) forms, the legacy ``ENV k v`` form, COPY
destinations under WORKDIR, and a typed error naming the line for what dsec does not replay."""

from __future__ import annotations

from pathlib import Path

import pytest
from dsec_harbor.dockerfile import DEFAULT_PATH, Copy, Run, parse

from dsec_core.errors import InvalidSpec


def _parse(tmp_path: Path, text: str, image_env: dict[str, str] | None = None):
    (tmp_path / "Dockerfile").write_text(text)
    return parse(tmp_path / "Dockerfile", image_env)


def test_args_and_envs_expand_as_docker_expands_them(tmp_path):
    recipe = _parse(
        tmp_path,
        "ARG VERSION=3.12\n"
        "ARG IMAGE=python:${VERSION}-slim\n"
        "FROM ${IMAGE}\n"
        "ARG VERSION\n"
        "ENV PY_VERSION=$VERSION HOME_DIR=/home/${USER_NAME:-agent}\n"
        "ENV LEGACY value with spaces\n"
        "ENV PATH=/opt/venv/bin:$PATH\n",
        {"PATH": "/usr/local/bin:/usr/bin:/bin"},
    )
    assert recipe.base == "python:3.12-slim"
    assert recipe.env == {
        "PY_VERSION": "3.12",
        "HOME_DIR": "/home/agent",
        "LEGACY": "value with spaces",
        "PATH": "/opt/venv/bin:/usr/local/bin:/usr/bin:/bin",  # the image's PATH, extended
    }
    assert _parse(tmp_path, "FROM x\nENV PATH=/a:$PATH\n").env["PATH"] == f"/a:{DEFAULT_PATH}"


def test_run_copy_workdir_and_user_are_steps_with_what_holds_at_each(tmp_path):
    recipe = _parse(
        tmp_path,
        "FROM ubuntu:24.04\n"
        "# a comment\n"
        "WORKDIR /srv\n"
        "WORKDIR app\n"
        'RUN ["python3", "-c", "print(1)"]\n'
        "COPY --chown=1000:1000 a.txt b.txt ./lib/\n"
        "COPY conf /etc/conf\n"
        "USER agent\n"
        "RUN echo one \\\n"
        "    && echo two\n"
        'LABEL x=y\nEXPOSE 80\nCMD ["sleep", "inf"]\n',
    )
    assert recipe.workdir == "/srv/app" and recipe.user == "agent"
    steps = [step for step, *_ in recipe.steps]
    assert steps == [
        Run(("python3", "-c", "print(1)")),
        Copy(("a.txt", "b.txt"), "/srv/app/lib/", "1000:1000"),
        Copy(("conf",), "/etc/conf", None),
        Run("echo one && echo two"),
    ]
    assert [user for *_, user in recipe.steps] == [None, None, None, "agent"]


@pytest.mark.parametrize(
    ("text", "what"),
    [
        ("FROM a AS build\nRUN make\nFROM b\n", "multi-stage"),
        ("FROM a\nCOPY --from=build /out /out\n", "COPY --from"),
        ("FROM a\nADD https://example.com/x.tgz /x\n", "ADD of a URL"),
        ("FROM a\nRUN --mount=type=cache,target=/root/.cache pip install x\n", "RUN flags"),
        ("RUN true\n", "before FROM"),
        ("FROM a\nONBUILD RUN true\n", "unsupported instruction ONBUILD"),
        ("# nothing\n", "no FROM"),
    ],
)
def test_what_dsec_does_not_replay_is_an_error_naming_the_line(tmp_path, text, what):
    with pytest.raises(InvalidSpec) as e:
        _parse(tmp_path, text)
    assert what in str(e.value) and "Dockerfile" in str(e.value)
