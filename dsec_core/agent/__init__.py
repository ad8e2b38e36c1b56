"""The in-sandbox agent: ``dsec-agent.c`` runs as each sandbox's init and serves exec, shell
sessions and file operations; ``ensure_agent`` compiles it once per source version.

The binary is static (glibc, no NSS) so it runs in any root filesystem, and it is named by a
digest of its source, so a changed agent never reuses a stale build.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
from pathlib import Path

from ..errors import BackendUnavailable, ToolError

__all__ = ["AGENT_SOURCE", "ensure_agent"]

AGENT_SOURCE = Path(__file__).with_name("dsec-agent.c")


def ensure_agent(bin_dir: Path) -> Path:
    """Return ``bin_dir/dsec-agent-<digest>``, compiling it first if it is missing.

    Builds into a temporary name in ``bin_dir`` and renames it into place, so concurrent callers
    (several daemons, parallel tests) never see a half-written binary.
    """
    source = AGENT_SOURCE.read_bytes()
    digest = hashlib.sha256(source).hexdigest()[:12]
    bin_dir = Path(bin_dir)
    target = bin_dir / f"dsec-agent-{digest}"
    if target.exists():
        return target
    gcc = shutil.which("gcc") or shutil.which("cc")
    if gcc is None:
        raise BackendUnavailable("building the sandbox agent needs gcc and static glibc "
                                 "(apt-get install gcc libc6-dev)", tool="gcc")
    bin_dir.mkdir(parents=True, exist_ok=True)
    tmp = bin_dir / f".dsec-agent-{digest}.{os.getpid()}.{os.urandom(4).hex()}.tmp"
    command = [gcc, "-static", "-O2", "-Wall", "-Werror", "-o", str(tmp), str(AGENT_SOURCE)]
    try:
        proc = subprocess.run(command, capture_output=True, text=True)
        if proc.returncode != 0:
            raise ToolError("building the sandbox agent failed", command=command,
                            exit_code=proc.returncode, stdout=proc.stdout, stderr=proc.stderr)
        os.chmod(tmp, 0o755)
        os.rename(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)
    return target
