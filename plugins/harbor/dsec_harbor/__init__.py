"""dsec as a Harbor environment provider: ``harbor run -e dsec_harbor:DsecEnvironment``.

``DsecEnvironment`` is loaded on first use: it subclasses Harbor's ``BaseEnvironment``, and
Harbor (Python >= 3.12) is installed only in Harbor's own venv, while dsec's venv imports this
package without it (the Dockerfile reading and the build need only dsec's client).
"""

from __future__ import annotations

from typing import Any

__all__ = ["DsecEnvironment"]


def __getattr__(name: str) -> Any:
    if name == "DsecEnvironment":
        from .environment import DsecEnvironment

        return DsecEnvironment
    raise AttributeError(f"module 'dsec_harbor' has no attribute {name!r}")
