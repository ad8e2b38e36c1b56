"""``dsec build demo``: a task environment built by the scripted driver from a real public
repository, offline, then run as ``dsec demo`` runs a task.

The pieces it is made of are shared with ``bench/build.py``: the sample repository
(``SAMPLE_PROJECT``: pypa/sampleproject, in ``demo_data``), the wheels its dependency comes
from (``index_wheels``: peppercorn, and Debian's own pip wheel for a base without pip) and the
shell command that installs it from a package index (``install_command``).
"""

from __future__ import annotations

import shutil
from pathlib import Path
from urllib.parse import urlsplit

from dsec_core.errors import InvalidSpec

__all__ = [
    "DEMO_DATA",
    "SAMPLE_PROJECT",
    "WHEELS",
    "host_pip_wheel",
    "index_wheels",
    "install_command",
]

DEMO_DATA = Path(__file__).resolve().parent / "demo_data"
#: pypa/sampleproject (MIT; see demo_data/SOURCES.md): ``sample.simple.add_one``, its tests, a
#: pyproject depending on peppercorn
SAMPLE_PROJECT = DEMO_DATA / "sampleproject"
#: The wheels of the sample's dependencies (peppercorn 0.6, from PyPI)
WHEELS = DEMO_DATA / "wheels"
#: Where Debian keeps the pip wheel its venvs bootstrap from (python3-pip-whl, which
#: python3-venv brings)
DEBIAN_WHEELS = Path("/usr/share/python-wheels")


def host_pip_wheel() -> Path:
    """Debian's pip wheel on this machine: a sandbox whose base has python3 but no pip (the
    default ``python`` environment) runs pip straight from it, fetched from the index."""
    found = sorted(DEBIAN_WHEELS.glob("pip-*-py3-none-any.whl"))
    if not found:
        raise InvalidSpec(
            f"no pip wheel in {DEBIAN_WHEELS}: install Debian's python3-pip-whl "
            "(python3-venv brings it)",
            path=str(DEBIAN_WHEELS),
        )
    return found[-1]


def index_wheels(directory: Path) -> Path:
    """Fill ``directory`` with what the demo's index serves: ``WHEELS`` and the host's pip
    wheel. Returns it."""
    directory.mkdir(parents=True, exist_ok=True)
    for wheel in [*sorted(WHEELS.glob("*.whl")), host_pip_wheel()]:
        shutil.copyfile(wheel, directory / wheel.name)
    return directory


def install_command(index_url: str, packages: tuple[str, ...] = ("peppercorn",)) -> str:
    """A shell command that pip-installs ``packages`` from the index at ``index_url`` (its
    ``/simple/``) into the system's python3, with the base's pip or, where the base has none,
    Debian's pip wheel fetched from the same index (``index_wheels`` serves it) and run in
    place; it fails fast (no retries) when the index is out of reach."""
    host = urlsplit(index_url).hostname or ""
    files = index_url.rstrip("/").rsplit("/simple", 1)[0] + "/files/"
    fetch = "import sys, urllib.request as u; u.urlretrieve(sys.argv[1], sys.argv[2])"
    return (
        "set -e; "
        "if python3 -m pip --version >/dev/null 2>&1; then pip='python3 -m pip'; else "
        f"python3 -c '{fetch}' {files}{host_pip_wheel().name} /tmp/pip.whl; "
        "pip='python3 /tmp/pip.whl/pip'; fi; "
        "$pip install --no-cache-dir --break-system-packages --disable-pip-version-check "
        f"--retries 0 --timeout 10 --index-url {index_url} --trusted-host {host} "
        f"{' '.join(packages)}; rm -f /tmp/pip.whl"
    )
