"""The contract for security policy plugins (AppArmor/Landlock, eBPF network allowlists, ...).

A policy sees each sandbox before it starts and may tighten its OCI configuration; it is told
when the sandbox ends so it can drop per-sandbox state.
"""

from __future__ import annotations

from typing import Any, ClassVar

from .backend import SandboxRuntime

__all__ = ["SecurityPolicy"]


class SecurityPolicy:
    """Subclass, set ``name``, register from ``dsec_register_security_policies``."""

    name: ClassVar[str]

    @classmethod
    def check_available(cls) -> None:
        """Raise ``BackendUnavailable`` if the kernel lacks what the policy needs."""

    def apply_oci(self, rt: SandboxRuntime, config: dict[str, Any]) -> None:
        """Tighten a container's OCI runtime config in place before it starts."""

    def released(self, rt: SandboxRuntime) -> None:
        """The sandbox is gone; drop anything kept for it."""
