"""The ``apparmor`` security policy: a sandbox's file policy (``FileRules``, the settings the
``landlock`` policy reads too) enforced by an AppArmor profile on every process of a container
sandbox, the agent included, root or not.

Settings (``SandboxSpec.policies["apparmor"]``): ``read_only`` and ``hidden`` (absolute paths
inside the sandbox) and ``scope`` (``signal``, ``abstract_unix``); see ``FileRules``.

Sandboxes with equal settings share one profile, ``dsec-<12 hex>`` (``profile.render``). The
first sandbox that needs it has it loaded (``apparmor_parser -r -W``, from a file in the
node's runtime directory, ``$DSEC_HOME/run/apparmor/``) and every such sandbox names it in its
OCI config (``process.apparmorProfile``), which runc applies as the agent starts. A profile is
unloaded once no sandbox uses it and no process runs under it: unloading a profile in use would
leave its processes unconfined.

Where the host cannot enforce it (no ``apparmor_parser``; a kernel without AppArmor, or with it
disabled; no securityfs) ``check_available`` says why, and a sandbox that asks for the policy
fails to be created with ``PolicyUnavailable``, unless its settings say ``"best_effort": true``.
"""

from __future__ import annotations

import logging
import os
import shutil
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Any, ClassVar

from dsec_core.backend import AGENT_PATH, SandboxRuntime
from dsec_core.config import NodeConfig
from dsec_core.errors import DsecError, InvalidSpec, PolicyUnavailable, ToolError
from dsec_core.security import NODE_SETTINGS, FileRules, SecurityPolicy

from .kernel import Kernel
from .parser import find_parser, load_profile
from .profile import Profile, render

__all__ = ["AppArmorPolicy"]

log = logging.getLogger("dsec.security.apparmor")

NAME = "apparmor"


class AppArmorPolicy(SecurityPolicy):
    """File rules as an AppArmor profile per distinct settings, loaded on first use."""

    name = NAME
    targets = frozenset({"oci"})
    example = (
        {"read_only": ["/usr/local/bin"], "hidden": ["/root/.answers"], "scope": ["signal"]},
        "none",
    )

    #: The host's AppArmor (tests stand in a tree of their own).
    kernel: ClassVar[Kernel] = Kernel()

    def __init__(self, home: Path | None = None) -> None:
        self._home = home
        self._lock = threading.Lock()
        self._profiles: dict[str, Profile] = {}  # loaded by this node (or found loaded), by name
        self._users: dict[str, str] = {}  # sandbox id -> its profile's name

    @classmethod
    def check_available(cls) -> None:
        reasons = []
        if find_parser() is None:
            reasons.append("apparmor_parser is not installed (Debian: apt-get install apparmor)")
        kernel = cls.kernel.unavailable()
        if kernel:
            reasons.append(kernel)
        if reasons:
            raise PolicyUnavailable(
                f"security policy {NAME!r} cannot be enforced on this host: {'; '.join(reasons)}",
                policy=NAME,
                reasons=reasons,
            )

    def validate(self, settings: Mapping[str, Any]) -> None:
        rules = FileRules.parse(settings, NAME)
        for i, path in enumerate(rules.hidden):
            if AGENT_PATH == path or AGENT_PATH.startswith(path + "/"):
                # The agent runs under the profile too: it could not start.
                raise InvalidSpec(
                    f"policies.{NAME}.hidden[{i}]: {path!r} would hide the sandbox's agent "
                    f"({AGENT_PATH})",
                    field=f"policies.{NAME}.hidden[{i}]",
                )
        # Where AppArmor is missing altogether, the node's check_available says so, better
        # than any one missing mediation would.
        self.check_available()
        missing = self.kernel.missing_for_scope(rules.scope)
        if missing:
            raise PolicyUnavailable(
                f"security policy {NAME!r}: this kernel's AppArmor cannot enforce scope "
                f"{', '.join(missing)} (no such mediation under {self.kernel.securityfs}/features)",
                policy=NAME,
                scope=missing,
            )

    def profile(self, settings: Mapping[str, Any]) -> Profile:
        """The profile for a sandbox with these (valid) settings."""
        return render(FileRules.parse(settings, NAME))

    def apply_oci(
        self, rt: SandboxRuntime, settings: Mapping[str, Any], config: dict[str, Any]
    ) -> None:
        process = config.setdefault("process", {})
        if process.get("apparmorProfile"):
            # A process runs under one profile; replacing another policy's would be silent.
            raise PolicyUnavailable(
                f"sandbox {rt.id}: its OCI config already names AppArmor profile "
                f"{process['apparmorProfile']!r} (another policy set it)",
                policy=NAME,
                sandbox_id=rt.id,
            )
        profile = self.profile(settings)
        with self._lock:
            if profile.name not in self._profiles:
                self._load(profile)
            self._users[rt.id] = profile.name
        process["apparmorProfile"] = profile.name

    def adopted(self, rt: SandboxRuntime, settings: Mapping[str, Any]) -> None:
        profile = self.profile(settings)
        with self._lock:
            self._users[rt.id] = profile.name
            self._profiles.setdefault(profile.name, profile)

    def stats(self, rt: SandboxRuntime) -> Mapping[str, Any]:
        name = self._users.get(rt.id)
        return {"profile": name} if name else {}

    def released(self, rt: SandboxRuntime) -> None:
        with self._lock:
            name = self._users.pop(rt.id, None) or self._name_in_spec(rt)
            if name and name not in self._users.values():
                self._unload(name)

    def close(self) -> None:
        with self._lock:
            for name in [n for n in self._profiles if n not in self._users.values()]:
                self._unload(name)
            if not self._profiles:
                shutil.rmtree(self._dir(), ignore_errors=True)

    # --- loading and unloading, under the lock ----------------------------------------------
    def _dir(self) -> Path:
        config = NodeConfig() if self._home is None else NodeConfig(home=self._home)
        return config.run_dir / NAME  # NodeConfig() takes $DSEC_HOME, as the daemon did

    def _load(self, profile: Profile) -> None:
        where = self._dir()
        where.mkdir(mode=0o700, parents=True, exist_ok=True)
        path = where / profile.name
        tmp = path.with_suffix(".tmp")
        tmp.write_text(profile.text)
        os.replace(tmp, path)
        try:
            load_profile(path, where / "cache", strict=profile.strict)
        except ToolError:  # the parser refused it: the create fails, and nothing was loaded
            path.unlink(missing_ok=True)
            raise
        self._profiles[profile.name] = profile
        log.info("loaded AppArmor profile %s", profile.name)

    def _unload(self, name: str) -> None:
        """Unload ``name`` unless a process still runs under it (a sandbox of a previous
        daemon not adopted yet, a straggler): ``close`` tries again."""
        if name in self.kernel.loaded():
            pids = self.kernel.confined(name)
            if pids:
                log.info("AppArmor profile %s: still in use by pids %s, kept", name, pids[:5])
                self._profiles.setdefault(name, Profile(name, ""))
                return
            try:
                self.kernel.remove(name)
            except OSError as e:  # the node must go on releasing; the profile stays known
                log.warning("unloading AppArmor profile %s: %s", name, e)
                return
            log.info("unloaded AppArmor profile %s", name)
        self._profiles.pop(name, None)
        (self._dir() / name).unlink(missing_ok=True)

    @staticmethod
    def _name_in_spec(rt: SandboxRuntime) -> str | None:
        # A sandbox a restarted daemon found dead was never applied or adopted here: its
        # profile follows from the settings in its spec.
        raw = rt.spec.policies.get(NAME)
        if raw is None:
            return None
        settings = {k: v for k, v in raw.items() if k not in NODE_SETTINGS}
        try:
            return render(FileRules.parse(settings, NAME)).name
        except DsecError:
            return None
