"""The host kernel's AppArmor, as sysfs and securityfs show it: whether it is there and enabled,
which rule classes it enforces, which profiles are loaded, which processes run under one, and
removing a profile. Paths hang off ``sys`` and ``proc`` roots so tests can stand in a tree."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

__all__ = ["Kernel"]

#: Rule classes a profile's scope needs, and where the kernel says it enforces them (under
#: ``apparmor/features``). Unix socket mediation is in Ubuntu's kernels and came late to
#: mainline; without it the parser would downgrade the scope's ``unix`` rules to a plain
#: ``network unix`` rule that allows them all.
SCOPE_FEATURES = {
    "abstract_unix": ("network/af_unix", "network_v9/af_unix"),
    "signal": ("signal",),
}
#: What every profile's base uses; the parser refuses to load rules the kernel would not enforce.
BASE_FEATURES = {
    "file rules": ("file",),
    "mount rules": ("mount",),
    "ptrace rules": ("ptrace",),
    "signal rules": ("signal",),
}


@dataclass(frozen=True)
class Kernel:
    """AppArmor of the kernel whose sysfs is at ``sys`` and procfs at ``proc``."""

    sys: Path = Path("/sys")
    proc: Path = Path("/proc")

    @property
    def securityfs(self) -> Path:
        return self.sys / "kernel" / "security" / "apparmor"

    @property
    def enabled_param(self) -> Path:
        return self.sys / "module" / "apparmor" / "parameters" / "enabled"

    def unavailable(self) -> str | None:
        """Why profiles cannot be loaded and enforced here, or None if they can."""
        try:
            enabled = self.enabled_param.read_text().strip()
        except FileNotFoundError:
            also = "" if self.securityfs.exists() else f", nor does {self.securityfs}"
            return (
                f"the kernel has no AppArmor ({self.enabled_param} does not exist{also}: "
                "built without CONFIG_SECURITY_APPARMOR)"
            )
        except OSError as e:
            return f"cannot read {self.enabled_param}: {e.strerror}"
        if enabled != "Y":
            return (
                f"AppArmor is built into the kernel but not enabled ({self.enabled_param} is "
                f"{enabled!r}; boot with apparmor=1 and apparmor in lsm=)"
            )
        if not self.securityfs.is_dir():
            return (
                f"{self.securityfs} does not exist (securityfs not mounted at "
                f"{self.securityfs.parent}, or AppArmor is not among the active LSMs)"
            )
        missing = [what for what, paths in BASE_FEATURES.items() if not self._has(paths)]
        if missing:
            return f"the kernel's AppArmor does not mediate {', '.join(missing)}"
        return None

    def missing_for_scope(self, scope: tuple[str, ...]) -> list[str]:
        """The scopes among ``scope`` this kernel's AppArmor cannot enforce."""
        return [s for s in scope if not self._has(SCOPE_FEATURES[s])]

    def _has(self, paths: tuple[str, ...]) -> bool:
        features = self.securityfs / "features"
        for rel in paths:
            p = features / rel
            if p.is_dir():
                return True
            try:
                if p.read_text().strip() not in ("", "no"):
                    return True
            except OSError:
                continue
        return False

    def loaded(self) -> set[str]:
        """Names of the profiles loaded in the kernel (its ``profiles`` file: ``name (mode)``)."""
        try:
            text = (self.securityfs / "profiles").read_text()
        except OSError:
            return set()
        return {line.rpartition(" (")[0] for line in text.splitlines() if " (" in line}

    def remove(self, name: str) -> None:
        """Unload profile ``name``; processes still under it would become unconfined, so call
        this only when ``confined(name)`` is empty. OSError if the kernel refuses."""
        with open(self.securityfs / ".remove", "w") as f:
            f.write(name)

    def confined(self, name: str) -> list[int]:
        """Host pids of the processes running under profile ``name``."""
        out = []
        for entry in os.scandir(self.proc):
            if not entry.name.isdigit():
                continue
            label = ""
            # attr/apparmor/current since Linux 5.8 (when several LSMs may have labels);
            # attr/current before
            for rel in ("attr/apparmor/current", "attr/current"):
                try:
                    with open(os.path.join(entry.path, rel)) as f:
                        label = f.read().strip()
                    break
                except OSError:
                    continue
            # "dsec-0123456789ab (enforce)", or a stack "a//&dsec-... (enforce)"
            profiles = label.rpartition(" (")[0] or label
            if name in profiles.split("//&"):
                out.append(int(entry.name))
        return out
