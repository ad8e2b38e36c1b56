"""The ``landlock`` security policy: the sandbox's ``FileRules`` handed to its agent (enforcement
point ``"agent"``), which enforces them with Landlock on every process it starts.

Settings (``SandboxSpec.policies["landlock"]``, read by ``dsec_core.security.FileRules``):
``read_only`` paths (nothing beneath them can be written, created, removed, renamed or linked;
reading and running stay allowed), ``hidden`` paths (nothing beneath them at all, reads
included) and ``scope`` (``signal``: no signals to processes outside the sandbox's Landlock
domain, the agent included; ``abstract_unix``: no connecting to abstract unix sockets made
outside it). The agent builds the ruleset at start by walking the sandbox's file system
(``dsec_core/agent/src/landlock.c`` explains the construction and what it cannot express), and
refuses, failing the create with ``PolicyUnavailable``, if its kernel lacks the Landlock ABI
the settings need (3 for file rules, 6 for scopes).

The node's own file operations (``read_file``, ``write_file``, ``list_dir``, ...) are served
outside the domain: a trainer still reads a hidden answer file and installs a harness into a
read-only path. Commands, ``exclusive`` ones included, are all inside it.
"""

from __future__ import annotations

import ctypes
import errno
import functools
from collections.abc import Mapping
from typing import Any

from dsec_core.backend import AgentPolicy, SandboxRuntime
from dsec_core.errors import PolicyUnavailable
from dsec_core.security import FileRules, SecurityPolicy

__all__ = ["FILE_RULES_ABI", "SCOPE_ABI", "LandlockPolicy", "host_abi"]

NR_LANDLOCK_CREATE_RULESET = 444  # the same number on every architecture
LANDLOCK_CREATE_RULESET_VERSION = 1
#: The Landlock ABI file rules need (TRUNCATE), and the one scopes need.
FILE_RULES_ABI = 3
SCOPE_ABI = 6


@functools.cache
def host_abi() -> int:
    """This kernel's Landlock ABI version; 0 if it has no Landlock (or it is off at boot)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    abi = libc.syscall(
        ctypes.c_long(NR_LANDLOCK_CREATE_RULESET),
        None,
        ctypes.c_size_t(0),
        ctypes.c_uint32(LANDLOCK_CREATE_RULESET_VERSION),
    )
    return max(0, int(abi))


class LandlockPolicy(SecurityPolicy):
    """Read-only and hidden paths and scoped signals and sockets, per sandbox, with Landlock."""

    name = "landlock"
    targets = frozenset({"agent"})
    example = (
        {"read_only": ["/bin", "/usr/bin"], "hidden": ["/home"], "scope": ["signal"]},
        "none",
    )

    def __init__(self) -> None:
        self._in_force: dict[str, dict[str, Any]] = {}

    @classmethod
    def check_available(cls) -> None:
        # The agent checks again against its own kernel at start (a guest's, for a VM) and
        # refuses scopes the kernel lacks; here: is there Landlock for file rules at all.
        abi = host_abi()
        if abi < FILE_RULES_ABI:
            why = "no Landlock" if abi == 0 else f"Landlock ABI {abi}"
            raise PolicyUnavailable(
                f"security policy 'landlock' needs Landlock ABI {FILE_RULES_ABI} or later "
                f"(Linux 6.2, with landlock in the lsm= list); this kernel has {why}",
                policy="landlock",
                abi=abi,
                errno=errno.EOPNOTSUPP,
            )

    def validate(self, settings: Mapping[str, Any]) -> None:
        FileRules.parse(settings, self.name)

    def apply(
        self, target: str, rt: SandboxRuntime, settings: Mapping[str, Any], subject: Any
    ) -> None:
        if target != "agent":
            return
        rules = FileRules.parse(settings, self.name)
        doc: AgentPolicy = subject
        doc.read_only.extend(rules.read_only)
        doc.hidden.extend(rules.hidden)
        doc.scope.extend(s for s in rules.scope if s not in doc.scope)
        self._in_force[rt.id] = self._summary(rules)

    def adopted(self, rt: SandboxRuntime, settings: Mapping[str, Any]) -> None:
        self._in_force[rt.id] = self._summary(FileRules.parse(settings, self.name))

    def stats(self, rt: SandboxRuntime) -> Mapping[str, Any]:
        return self._in_force.get(rt.id, {})

    def released(self, rt: SandboxRuntime) -> None:
        self._in_force.pop(rt.id, None)

    @staticmethod
    def _summary(rules: FileRules) -> dict[str, Any]:
        return {
            "read_only": list(rules.read_only),
            "hidden": list(rules.hidden),
            "scope": list(rules.scope),
            "abi": host_abi(),
        }
