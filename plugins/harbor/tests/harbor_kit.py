"""What the Harbor provider's tests share: Harbor's CLI from its own venv (.venv-harbor, made by
run.sh setup with a Python >= 3.12) run as a subprocess and its trials' rewards read back, the
test task's files, and the default catalog's ``python`` environment put on a kit node."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest

from dsec_core.catalog.model import Catalog
from dsec_core.catalog.store import CatalogStore
from dsec_core.config import NodeConfig
from dsec_core.errors import DsecError
from dsec_core.layers.store import LayerStore
from dsec_core.testing import KitNode

REPO = Path(__file__).resolve().parents[3]
HARBOR_VENV = REPO / ".venv-harbor"
#: Where `run.sh test` builds the default catalog (debootstrap base) once per machine.
BUILT_HOME = Path(os.environ.get("DSEC_TEST_HOME", "/var/lib/dsec-test"))
#: The FROM image of the test task, mapped to the catalog's ``python`` environment (Debian 12
#: with python3 and bash), as an operator maps the images their tasks name.
IMAGE = "python:3.11-slim-bookworm"
IMAGES = f"{IMAGE}=python"

DOCKERFILE = f"""\
FROM {IMAGE}

ENV GREETING="hello from dsec" \\
    APP_HOME=/app
WORKDIR /app
COPY words.txt ./
COPY data/ /app/data/
RUN mkdir -p /opt/tool \\
    && printf '#!/bin/sh\\necho "$GREETING"\\n' > /opt/tool/greet \\
    && chmod +x /opt/tool/greet
ENV PATH=/opt/tool:$PATH
RUN wc -w < words.txt | tr -d ' ' > count.txt && cat data/note.txt >> count.txt
"""
SOLVE = """\
#!/bin/bash
# WORKDIR is the cwd, ENV (PATH, GREETING) is set, COPY and RUN left their files
set -e
{ greet; cat count.txt; } > answer.txt
"""
TEST = """\
#!/bin/bash
# COPY of a directory keeps every file (22 of them: one tar), their modes, root as owner
copied() {
    [ "$(cat /app/data/part-19.txt)" = 19 ] && [ -x /app/data/bin/run.sh ] \\
        && [ "$(stat -c %u /app/data/part-19.txt)" = 0 ]
}
expected="$(printf 'hello from dsec\\n3\\nfrom data/\\n')"
if [ "$(cat /app/answer.txt 2>/dev/null)" = "$expected" ] && [ "$APP_HOME" = /app ] && copied; then
    echo 1 > /logs/verifier/reward.txt
else
    echo 0 > /logs/verifier/reward.txt
fi
"""


def harbor_bin() -> Path:
    """Harbor's CLI, or a skip saying why there is none."""
    harbor = HARBOR_VENV / "bin" / "harbor"
    if not harbor.is_file():
        pytest.skip(
            f"no Harbor venv at {HARBOR_VENV}: run.sh setup makes it with a Python >= 3.12, "
            "and found none on this machine (Harbor needs Python >= 3.12)"
        )
    return harbor


def harbor_env(**extra: str) -> dict[str, str]:
    """The environment a Harbor process gets: the caller's without any DSEC_/E2B_ settings of
    its own (each test sets exactly what it means to test), and nothing that leaves the
    machine: Harbor's telemetry off, LiteLLM's model price map read from its package."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DSEC_", "E2B_"))}
    env.update(HARBOR_TELEMETRY="0", LITELLM_LOCAL_MODEL_COST_MAP="True", NO_COLOR="1", **extra)
    return env


@dataclass
class JobResult:
    """A finished ``harbor run``: each trial's agent and reward (None: no reward)."""

    rewards: list[tuple[str, float | None]]
    output: str
    job_dir: Path

    @property
    def log(self) -> str:
        """The job's log (its environments' messages among Harbor's)."""
        path = self.job_dir / "job.log"
        return path.read_text(errors="replace") if path.is_file() else ""

    def of(self, agent: str) -> list[float | None]:
        return [r for a, r in self.rewards if a == agent]


def run_job(
    tmp: Path, task: Path, env: dict[str, str], *args: str, timeout: float = 240
) -> JobResult:
    """``harbor run -p <task> <args>`` in ``tmp`` (its jobs dir there); the trials' rewards."""
    jobs = tmp / "jobs"
    argv = [
        str(harbor_bin()),
        "run",
        "-p",
        str(task),
        "-o",
        str(jobs),
        "--job-name",
        "job",
        "-q",
        "-y",
    ]
    out = subprocess.run(
        [*argv, *args], cwd=tmp, env=env, capture_output=True, text=True, timeout=timeout
    )
    output = out.stdout + out.stderr
    job = jobs / "job"
    rewards: list[tuple[str, float | None]] = []
    for result in sorted(job.glob("*/result.json")):
        trial = json.loads(result.read_text())
        verifier = trial.get("verifier_result") or {}
        reward = (verifier.get("rewards") or {}).get("reward")
        if exc := trial.get("exception_info"):
            what = f"{exc.get('exception_type')}: {exc.get('exception_message')}"
            output += f"\n{result.parent.name}: {what}"
        rewards.append((trial["agent_info"]["name"], reward))
    assert rewards, f"harbor ran no trial (exit {out.returncode}):\n{output[-4000:]}"
    return JobResult(rewards, output, job)


def _copy_layer(src: LayerStore, dst: LayerStore, ref: str) -> None:
    info = src.resolve(ref)
    if dst.exists(ref):
        return
    with dst.scratch("copy-") as tmp:
        image = Path(tmp) / "image.erofs"
        try:
            os.link(src.image_path(info), image)
        except OSError:  # another filesystem
            shutil.copyfile(src.image_path(info), image)
        dst.add(image, name=info.name, version=info.version, kind=info.kind, source=info.source)


def install_python_env(node: KitNode) -> None:
    """Give ``node`` the default catalog's ``python`` environment (base + toolkit), from the
    machine's built default catalog; skips where that is not built."""
    built = NodeConfig(home=BUILT_HOME)
    try:
        env = CatalogStore(built.catalog_dir).environment("python")
    except (DsecError, OSError):
        pytest.skip(f"the default catalog is not built in {BUILT_HOME} (dsec catalog build)")
    src, dst = LayerStore(built.layer_dir), LayerStore(node.config.layer_dir)
    for ref in env.layer_refs():
        _copy_layer(src, dst, ref)
    CatalogStore(node.config.catalog_dir).save(Catalog(name="default", environments=(env,)))
