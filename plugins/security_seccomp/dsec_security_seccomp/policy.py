"""The ``seccomp`` security policy: every container sandbox gets the default profile
(``profile.py``). Where the backend offers the ``"agent"`` enforcement point (the container
backend does), the profile is compiled once per settings into a BPF program (``bpf.py``), cached
here, and handed to the sandbox's agent, which installs it on itself before it serves, so every
process in the sandbox runs under it. A backend that offers only ``"oci"`` gets the profile in
its OCI config instead, which runc compiles and installs at every start (tens of milliseconds).

Settings (``SandboxSpec.policies["seccomp"]``):

- ``userns`` (bool, default false): let the sandbox create namespaces, a user namespace
  first, and mount inside them (nested containers, rootless podman, bubblewrap);
- ``allow`` (list of syscall names, default none): exceptions allowed without conditions, for
  environments that need a call the profile denies (``["io_uring_setup", "io_uring_enter",
  "io_uring_register"]``, ``["ioctl"]``). Each name must be one libseccomp on this node knows,
  else runc would skip it silently.

``{"enabled": false}`` turns the profile off for a sandbox (the node strips that key).
"""

from __future__ import annotations

import ctypes
import functools
import os
import platform
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any, ClassVar

from dsec_core.backend import AgentPolicy, SandboxRuntime
from dsec_core.errors import InvalidSpec, PolicyUnavailable
from dsec_core.security import SecurityPolicy

from . import bpf, libseccomp
from .profile import ARCHITECTURES, build_profile

__all__ = ["SeccompPolicy"]

SETTINGS = ("allow", "userns")
ACTIONS_AVAIL = Path("/proc/sys/kernel/seccomp/actions_avail")
SYSCALL_NAME = re.compile(r"[a-z_][a-z0-9_]{0,63}")
# Allowing these without conditions lets the sandbox make namespaces: that is ``userns``.
NAMESPACE_MAKERS = ("clone", "clone3", "unshare")


def _field(key: str) -> str:
    return f"policies.seccomp.{key}"


X32_SYSCALL_BIT = 0x40000000
NR_GETPID_X86_64 = 39


@functools.cache
def absent_architectures(machine: str) -> frozenset[str]:
    """Compat ABIs of ``machine`` that this kernel does not run, so the profile can leave them
    out: on x86_64, x32 (``CONFIG_X86_X32_ABI``, off in most kernels), found by asking for
    getpid through it. The native ABI and i386 are always kept."""
    if machine != "x86_64":
        return frozenset()
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    if libc.syscall(ctypes.c_long(X32_SYSCALL_BIT | NR_GETPID_X86_64)) == os.getpid():
        return frozenset()
    return frozenset({"SCMP_ARCH_X32"})


class SeccompPolicy(SecurityPolicy):
    """A default-deny seccomp profile in the style of Docker's, per sandbox."""

    name = "seccomp"
    targets = frozenset({"agent", "oci"})
    default = True

    machine: ClassVar[str] = platform.machine()

    def __init__(self) -> None:
        self._in_force: dict[str, dict[str, Any]] = {}
        # per settings (``_key``), made once: the compiled program and the stats summary
        self._programs: dict[tuple[bool, tuple[str, ...]], bytes] = {}
        self._summaries: dict[tuple[str, bool, tuple[str, ...]], dict[str, Any]] = {}

    @classmethod
    def check_available(cls) -> None:
        if cls.machine not in ARCHITECTURES:
            raise PolicyUnavailable(
                f"security policy 'seccomp' has no profile for machine {cls.machine!r} "
                f"(it knows {', '.join(sorted(ARCHITECTURES))})",
                policy="seccomp",
                machine=cls.machine,
            )
        try:
            actions = ACTIONS_AVAIL.read_text().split()
        except OSError:
            actions = []
        if "errno" not in actions or "allow" not in actions:
            raise PolicyUnavailable(
                "security policy 'seccomp' needs a kernel with seccomp filters "
                f"(CONFIG_SECCOMP_FILTER; {ACTIONS_AVAIL} lists {actions or 'nothing'})",
                policy="seccomp",
            )
        libseccomp.version()  # PolicyUnavailable if the library is not there

    @classmethod
    def loosens(cls, settings: Mapping[str, Any]) -> str | None:
        """``allow`` (calls the profile denies) and ``userns`` (namespaces) both let the
        sandbox do more than the default profile does; an empty ``allow`` or ``userns``
        false change nothing."""
        why = []
        if settings.get("userns") is True:
            why.append("userns lets the sandbox make namespaces")
        if settings.get("allow"):
            why.append("allow lets the sandbox make calls the profile denies")
        return "; ".join(why) or None

    def validate(self, settings: Mapping[str, Any]) -> None:
        for key in settings:
            if key not in SETTINGS:
                raise InvalidSpec(
                    f"security policy 'seccomp' has no setting {key!r} "
                    f"(it takes {', '.join(SETTINGS)})",
                    field=_field(str(key)),
                )
        userns = settings.get("userns", False)
        if not isinstance(userns, bool):
            raise InvalidSpec(
                f"seccomp: userns must be true or false, not {userns!r}", field=_field("userns")
            )
        allow = settings.get("allow", [])
        if not isinstance(allow, (list, tuple)):
            raise InvalidSpec(
                f"seccomp: allow must be a list of syscall names, not {allow!r}",
                field=_field("allow"),
            )
        for i, name in enumerate(allow):
            where = f"{_field('allow')}[{i}]"
            if not isinstance(name, str) or not SYSCALL_NAME.fullmatch(name):
                raise InvalidSpec(f"seccomp: {name!r} is not a syscall name", field=where)
            if not libseccomp.knows(name):
                raise InvalidSpec(
                    f"seccomp: allow names {name!r}, which libseccomp {libseccomp.version()} "
                    "on this node does not know (runc would skip it)",
                    field=where,
                )
            if name in NAMESPACE_MAKERS and not userns:
                raise InvalidSpec(
                    f"seccomp: allowing {name!r} without conditions lets the sandbox create "
                    "namespaces; say userns: true for that",
                    field=where,
                )

    def apply(
        self, target: str, rt: SandboxRuntime, settings: Mapping[str, Any], subject: Any
    ) -> None:
        """Through the agent where the backend offers it, else through the OCI config."""
        if target == "agent":
            self.apply_agent(rt, settings, subject)
        elif target == "oci" and "agent" not in rt.targets:
            self.apply_oci(rt, settings, subject)

    def apply_agent(
        self, rt: SandboxRuntime, settings: Mapping[str, Any], doc: AgentPolicy
    ) -> None:
        if doc.seccomp:
            raise PolicyUnavailable(
                f"sandbox {rt.id}: its agent policy already has a seccomp program "
                "(another policy set one)",
                policy=self.name,
                sandbox_id=rt.id,
            )
        doc.seccomp = self.program(settings)
        self._in_force[rt.id] = self._summary(settings, "agent")

    def program(self, settings: Mapping[str, Any]) -> bytes:
        """The profile for these (valid) settings as the BPF program the agent installs,
        compiled once per settings (about 20 ms) and kept."""
        key = _key(settings)
        program = self._programs.get(key)
        if program is None:
            program = self._programs[key] = bpf.compile_profile(self.profile(settings))
        return program

    def apply_oci(
        self, rt: SandboxRuntime, settings: Mapping[str, Any], config: dict[str, Any]
    ) -> None:
        linux = config.setdefault("linux", {})
        if linux.get("seccomp") is not None:
            # Two profiles cannot both be in force; dropping the other one would be silent.
            raise PolicyUnavailable(
                f"sandbox {rt.id}: its OCI config already has a seccomp profile "
                "(another policy set one)",
                policy=self.name,
                sandbox_id=rt.id,
            )
        linux["seccomp"] = self.profile(settings)
        self._in_force[rt.id] = self._summary(settings, "oci")

    def adopted(self, rt: SandboxRuntime, settings: Mapping[str, Any]) -> None:
        via = "agent" if "agent" in rt.targets else "oci"
        self._in_force[rt.id] = self._summary(settings, via)

    def profile(self, settings: Mapping[str, Any]) -> dict[str, Any]:
        """The OCI ``linux.seccomp`` section for a sandbox with these (valid) settings."""
        return build_profile(
            self.machine,
            userns=bool(settings.get("userns", False)),
            allow=settings.get("allow", ()),
            without=absent_architectures(self.machine),
        )

    def stats(self, rt: SandboxRuntime) -> Mapping[str, Any]:
        return self._in_force.get(rt.id, {})

    def released(self, rt: SandboxRuntime) -> None:
        self._in_force.pop(rt.id, None)

    def _summary(self, settings: Mapping[str, Any], via: str) -> dict[str, Any]:
        """What ``stats`` shows of a sandbox's profile; shared by sandboxes with the same
        settings (building the profile takes about half a millisecond)."""
        key = (via, *_key(settings))
        summary = self._summaries.get(key)
        if summary is None:
            profile = self.profile(settings)
            summary = self._summaries[key] = {
                "via": via,
                "default": "EPERM",
                "architectures": list(profile["architectures"]),
                "rules": len(profile["syscalls"]),
                "userns": bool(settings.get("userns", False)),
                "allow": sorted(settings.get("allow", [])),
            }
        return summary


def _key(settings: Mapping[str, Any]) -> tuple[bool, tuple[str, ...]]:
    """What of (valid) settings makes the profile: userns, and the allowed syscalls."""
    return bool(settings.get("userns", False)), tuple(sorted(settings.get("allow", ())))
