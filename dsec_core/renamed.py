"""The names this release renamed, old to new, and what keeps each old one importable for one
more release with a ``DeprecationWarning`` (docs/plugins/renamed.md).

A renamed module leaves a stub at its old path that calls ``warn_renamed`` and re-exports the
new module; a renamed name in a module that stays is served by that module's ``__getattr__``
(``renamed_getattr``). dsec imports neither (``tests/test_architecture.py`` checks), and both
go in the next release. Standard library only: every floor's stubs use it.
"""

from __future__ import annotations

import importlib
import warnings
from collections.abc import Callable
from typing import Any

__all__ = ["MODULES", "NAMES", "renamed_getattr", "warn_renamed"]

#: old module -> new module (the old one is a stub that warns on import)
MODULES: dict[str, str] = {
    "dsec_core.agent.drive": "dsec_core.node.drive_client",
    "dsec_core.cluster.keeper": "dsec_core.cluster.node_keeper",
    "dsec_core.inputs": "dsec_core.screen_input",
    "dsec_core.lazy.keeper": "dsec_core.lazy.fuse_keeper",
    "dsec_core.node.ondemand": "dsec_core.node.lazy_layers",
    "dsec_core.profiling": "dsec_core.read_profiles",
}

#: old ``module.name`` -> new ``module.name``: names renamed in a module that stays, and the
#: names a stub module above serves under their old name
NAMES: dict[str, str] = {
    "dsec_core.node.pools.Lease": "dsec_core.node.pools.Checkout",
    "dsec_core.vm.qemu.Drive": "dsec_core.vm.qemu.Disk",
    "dsec_core.node.ondemand.OnDemandLayers": "dsec_core.node.lazy_layers.LazyLayers",
}


def warn_renamed(old: str, new: str, stacklevel: int = 3) -> None:
    """Warn that ``old`` is now ``new``. The default ``stacklevel`` points at whoever imported
    the stub module (or the name) that calls this."""
    warnings.warn(
        f"{old} is renamed {new}; the old name goes in the next release",
        DeprecationWarning,
        stacklevel=stacklevel,
    )


def renamed_getattr(module: str) -> Callable[[str], Any]:
    """A module ``__getattr__`` for ``module`` that serves its old names (``NAMES``) with a
    warning, and raises ``AttributeError`` for anything else."""

    def __getattr__(name: str) -> Any:
        new = NAMES.get(f"{module}.{name}")
        if new is None:
            raise AttributeError(f"module {module!r} has no attribute {name!r}")
        warn_renamed(f"{module}.{name}", new)
        new_module, _, new_name = new.rpartition(".")
        return getattr(importlib.import_module(new_module), new_name)

    return __getattr__
