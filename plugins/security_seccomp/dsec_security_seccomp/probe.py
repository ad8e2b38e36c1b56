"""A static C probe of dangerous kernel surfaces (``probe.c``), for tests: build it with gcc,
copy it into a sandbox and read what each attempt returned.

It ships with the plugin so that every suite measuring a seccomp profile (the plugin's own, the
adversarial suite, a third party's) runs the same attempts. Run it only inside a sandbox or a
container: as root on a host, its attempts are real (they clean up after themselves, but still).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from dsec_core.errors import SandboxPathError, ToolError
from dsec_core.linux.tools import compile_static

__all__ = ["PROBE_SOURCE", "build_probe", "parse_probe", "run_probe"]

PROBE_SOURCE = Path(__file__).with_name("probe.c")
#: Where ``run_probe`` puts the probe in a sandbox.
PROBE_PATH = "/.dsec-probe"


def build_probe(directory: Path) -> Path:
    """Compile the probe into ``directory`` (static, not PIE: the 32-bit probes pass pointers
    that must sit below 4 GiB) and return its path."""
    return compile_static(
        [PROBE_SOURCE],
        Path(directory) / "dsec-seccomp-probe",
        "the seccomp probe",
        flags=["-O2", "-Wall", "-Werror", "-no-pie"],
    )


def parse_probe(output: str) -> dict[str, str]:
    """``{probe: "ok" | errno name | "signal:N"}`` from the probe's output."""
    results = {}
    for line in output.splitlines():
        name, _, result = line.partition(" ")
        if name and result:
            results[name] = result
    return results


def run_probe(
    sandbox: Any, probe: Path, *names: str, env: Mapping[str, str] | None = None
) -> dict[str, str]:
    """Copy ``probe`` into ``sandbox`` (a ``dsec.Sandbox``; once) and run the named probes (all
    if none are named) as its root; returns ``parse_probe`` of the output."""
    try:
        sandbox.stat(PROBE_PATH)
    except SandboxPathError:  # not there yet
        sandbox.write_file(PROBE_PATH, probe.read_bytes(), mode=0o755)
    r = sandbox.exec([PROBE_PATH, *(names or ("all",))], env=dict(env or {}), timeout=120)
    if r.exit_code != 0:
        raise ToolError(
            "the seccomp probe failed",
            command=[PROBE_PATH, *names],
            exit_code=r.exit_code,
            stderr=r.stderr.decode(errors="replace"),
        )
    return parse_probe(r.stdout.decode())
