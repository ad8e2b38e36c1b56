"""The ``egress`` security policy: a sandbox's network allowlist, enforced by BPF programs on its
cgroup and changed live by map updates, with egress through the node's egress namespace.

Settings: ``{"allow": ["10.77.0.2/32:8080/tcp", "[fd00::/64]:*/udp", "pypi.example:443/tcp"]}``
(``rules``). With ``SandboxSpec.network="allowlist"`` the sandbox also gets a veth into the
egress namespace (``network``); with ``"internet"`` (no policy to list: the mode brings this
one along, ``implied_by``) the egress namespace gets an uplink through the host's NAT and the
sandbox may reach every IPv4 address outside the private and special ranges
(``rules.INTERNET_DENIED``), plus what its rules allow; with ``"none"`` it stays loopback-only
and the programs only count what it tries. Domains are resolved on the node when the policy is
set and every ``DSEC_EGRESS_REFRESH`` seconds after (``resolve``); the sandbox's ``/etc/hosts``
(a read-only file the node rewrites) names what they resolved to, so programs in it find them
without DNS.
"""

from __future__ import annotations

import logging
import os
import shutil
import threading
from collections.abc import Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dsec_core.backend import Backend, SandboxRuntime, StartedSandbox
from dsec_core.config import NodeConfig
from dsec_core.errors import DsecError, InvalidSpec, PolicyUnavailable, UnknownSandbox
from dsec_core.linux.cgroups import cgroup2_root
from dsec_core.linux.netns import call_in_netns
from dsec_core.security import SecurityPolicy

from .bpf import (
    COUNTERS,
    NodeMaps,
    Programs,
    SandboxMaps,
    ensure_bpffs,
    ensure_object,
    libbpf,
    maps_dir,
    port_index,
)
from .network import EgressNetwork
from .resolve import Resolver
from .rules import Rule, internet_rules, parse_settings, trie_entries

__all__ = ["EgressPolicy", "hosts_file"]

log = logging.getLogger("dsec.egress")

HOSTS_FILE = "egress-hosts"
# the egress namespace's set-up, once per node; per sandbox nothing runs (netlink instead)
TOOLS = ("ip", "nsenter", "nft")


def hosts_file(rt: SandboxRuntime) -> Path:
    """The node's side of the sandbox's /etc/hosts (bind-mounted read-only)."""
    return rt.dir / HOSTS_FILE


@dataclass
class _Tracked:
    """What the policy keeps for one running sandbox."""

    rt: SandboxRuntime
    rules: tuple[Rule, ...]
    resolved: dict[str, tuple[str, ...]] = field(default_factory=dict)
    address: str | None = None

    @property
    def domains(self) -> set[str]:
        return {r.domain for r in self.rules if r.domain}

    def entries(self) -> dict[str, set[bytes]]:
        """The keys of the sandbox's tries: its rules, and in ``network="internet"`` every
        address outside the private ranges."""
        rules = self.rules
        if self.rt.spec.network == "internet":
            rules = (*rules, *internet_rules())
        return trie_entries(rules, self.resolved)


class EgressPolicy(SecurityPolicy):
    """Default-deny egress allowlist: CIDR, port and protocol, or domain, port and protocol."""

    name = "egress"
    targets = frozenset({"oci", "started"})
    network_modes = frozenset({"allowlist", "internet"})
    #: ``network="internet"`` needs no allow rules: a sandbox that does not list the policy
    #: gets it with none (``SecurityPolicy.implied_by``).
    implied_by = frozenset({"internet"})
    live = True
    # One TEST-NET-1 destination: the programs, maps, veth and egress namespace all come up,
    # and nothing leaves the node (documentation addresses, routed nowhere).
    example = ({"allow": ["192.0.2.10/32:443/tcp"]}, "allowlist")

    def __init__(self) -> None:
        self._sandboxes: dict[str, _Tracked] = {}
        self._lock = threading.RLock()
        self._config: NodeConfig | None = None
        self._network: EgressNetwork | None = None
        self._resolver: Resolver | None = None
        self._refresher: threading.Thread | None = None
        self._stop = threading.Event()
        # programs being attached while the backend starts the sandbox: (cgroup, future)
        self._pending: dict[str, tuple[Path, Future[None]]] = {}
        self._attacher: ThreadPoolExecutor | None = None
        self._programs: Programs | None = None  # loaded on first use, shared by sandboxes

    # --- what the node asks first ----------------------------------------------------------
    @classmethod
    def check_available(cls) -> None:
        if os.geteuid() != 0:
            raise PolicyUnavailable("the egress policy needs root (BPF, netns)", policy=cls.name)
        missing = [t for t in (*TOOLS, "clang") if shutil.which(t) is None]
        if missing:
            raise PolicyUnavailable(
                f"the egress policy needs {', '.join(missing)} (apt-get install iproute2 "
                "util-linux nftables clang libbpf-dev)",
                policy=cls.name,
                missing=missing,
            )
        libbpf()
        cgroup = Path("/sys/fs/cgroup")
        if not any((d / "cgroup.controllers").exists() for d in (cgroup, cgroup / "unified")):
            raise PolicyUnavailable(
                "the egress policy attaches to cgroup v2, which is not mounted", policy=cls.name
            )

    @classmethod
    def enforceable_on(cls, backend: type[Backend]) -> bool:
        # the running sandbox for its cgroup and netns; the OCI config, where there is one,
        # for /etc/hosts and an early attach (a VM has none)
        return "started" in backend.policy_targets

    def validate(self, settings: Mapping[str, Any]) -> None:
        try:
            parse_settings(settings)
        except InvalidSpec as e:
            # the field as the node names every policy's: policies.egress.allow[2]
            field = f"policies.{self.name}.{e.context.get('field', 'settings')}"
            raise InvalidSpec(e.message, **{**e.context, "field": field}) from None

    # --- lazily made node-wide parts -------------------------------------------------------
    @property
    def config(self) -> NodeConfig:
        if self._config is None:
            self._config = NodeConfig.from_env()
        return self._config

    @property
    def network(self) -> EgressNetwork:
        if self._network is None:
            self._network = EgressNetwork(self.config.home)
        return self._network

    @property
    def programs(self) -> Programs:
        with self._lock:
            if self._programs is None:
                ensure_bpffs()
                self._programs = Programs.load(ensure_object(self.config.bin_dir), maps_dir())
            return self._programs

    @property
    def resolver(self) -> Resolver:
        if self._resolver is None:
            self._resolver = Resolver.from_env()
        return self._resolver

    # --- enforcement -----------------------------------------------------------------------
    def apply(
        self, target: str, rt: SandboxRuntime, settings: Mapping[str, Any], subject: Any
    ) -> None:
        if target == "oci":
            self._apply_oci(rt, subject)
        elif target == "started":
            self._started(rt, settings, subject)

    def _apply_oci(self, rt: SandboxRuntime, config: dict[str, Any]) -> None:
        path = hosts_file(rt)
        path.write_text(_hosts_text(config.get("hostname", ""), {}))
        config["mounts"].append(
            {
                "destination": "/etc/hosts",
                "type": "bind",
                "source": os.fspath(path),
                "options": ["bind", "ro", "nosuid", "nodev", "noexec"],
            }
        )
        self._attach_early(rt, config.get("linux", {}).get("cgroupsPath"))

    def _attach_early(self, rt: SandboxRuntime, cgroups_path: Any) -> None:
        """Attach the programs to the cgroup v2 directory the OCI config names, made now, so
        they are there before anything runs in it. In a thread, while the backend starts the
        container: off the event loop (the first attach compiles and loads the programs) and
        out of the create's way. The runtime joins the directory that exists; ``_started``
        waits for the attach and checks the sandbox really is there."""
        root = cgroup2_root()
        if root is None or not isinstance(cgroups_path, str) or not cgroups_path.startswith("/"):
            return  # no v2 hierarchy, or a path the runtime resolves its own way
        cgroup = root / cgroups_path.lstrip("/")
        try:
            cgroup.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            log.debug("sandbox %s: no early attach, cannot make %s: %s", rt.id, cgroup, e)
            return
        with self._lock:
            if self._attacher is None:
                self._attacher = ThreadPoolExecutor(2, thread_name_prefix="dsec-egress-attach")
            future = self._attacher.submit(self.programs.attach, rt.id, cgroup)
            self._pending[rt.id] = (cgroup, future)

    def _started(self, rt: SandboxRuntime, settings: Mapping[str, Any], s: StartedSandbox) -> None:
        try:
            tracked = _Tracked(rt, parse_settings(settings))
            tracked.resolved = self.resolver.resolve(tracked.domains)
            attached = self._wait_attached(rt.id, s.cgroup2)
            if not attached:
                if s.cgroup2 is None:
                    raise PolicyUnavailable(
                        f"sandbox {rt.id} has no cgroup v2 directory to attach the egress "
                        "programs to",
                        policy=self.name,
                        sandbox_id=rt.id,
                    )
                self.programs.attach(rt.id, s.cgroup2)
            with SandboxMaps.open(rt.id) as maps:
                maps.sync(tracked.entries())
            if rt.spec.network == "internet":
                self.network.ensure_uplink()
            if rt.spec.network in self.network_modes:
                # a VM: its guest's packets are checked on its veth, whose index names it
                # (made from its cgroup id: the cgroup v2 directory's inode, as attached above)
                index = None
                if s.guest and s.cgroup2 is not None:
                    index = port_index(os.stat(s.cgroup2).st_ino)
                tracked.address = self.network.attach(rt.id, s.netns, index=index)
                if index is not None:
                    programs = self.programs
                    call_in_netns(self.network.path, lambda: programs.attach_port(rt.id, index))
            self._write_hosts(tracked)
        except BaseException:
            self._release(rt.id)
            raise
        self._track(tracked)

    def _wait_attached(self, sandbox_id: str, cgroup: Path | None) -> bool:
        """Wait for the early attach of the sandbox; True if its programs are on ``cgroup``.
        An early attach to another directory than the one the sandbox runs in is undone."""
        with self._lock:
            pending = self._pending.pop(sandbox_id, None)
        if pending is None:
            return False
        where, future = pending
        future.result()  # its error is the create's
        if cgroup is not None and where == cgroup:
            return True
        log.warning("sandbox %s runs in %s, not %s: attaching there", sandbox_id, cgroup, where)
        _unregister(sandbox_id)
        _remove_cgroup(where)
        return False

    def update(self, rt: SandboxRuntime, settings: Mapping[str, Any]) -> None:
        rules = parse_settings(settings)
        with self._lock:
            tracked = self._sandboxes.get(rt.id) or _Tracked(rt, rules)
            new = _Tracked(rt, rules, address=tracked.address)
            new.resolved = self.resolver.resolve(new.domains)
            with SandboxMaps.open(rt.id) as maps:
                maps.sync(new.entries())
            self._write_hosts(new)
            self._track(new)

    def adopted(self, rt: SandboxRuntime, settings: Mapping[str, Any]) -> None:
        tracked = _Tracked(rt, parse_settings(settings))
        tracked.resolved = self.resolver.resolve(tracked.domains)
        tracked.address = self.network.address_of(rt.id)
        try:
            with SandboxMaps.open(rt.id) as maps:
                maps.sync(tracked.entries())
        except DsecError as e:
            log.warning("sandbox %s: its egress maps are gone: %s", rt.id, e)
            return
        self._write_hosts(tracked)
        self._track(tracked)

    def stats(self, rt: SandboxRuntime) -> Mapping[str, Any]:
        try:
            with SandboxMaps.open(rt.id) as maps:
                denied = maps.denied()
                rules = sum(len(list(maps.keys(n))) for n in ("allow4", "allow6"))
        except DsecError:
            return {}
        with self._lock:
            tracked = self._sandboxes.get(rt.id)
        out: dict[str, Any] = {
            "denied": sum(denied.values()),
            "denied_by": {k: denied[k] for k in COUNTERS if denied[k]},
            "rules": rules,
        }
        if tracked is not None:
            out["address"] = tracked.address
            if tracked.domains:
                out["resolved"] = {d: list(tracked.resolved.get(d, ())) for d in tracked.domains}
                out["unresolved"] = sorted(
                    d for d in tracked.domains if not tracked.resolved.get(d)
                )
        return out

    def released(self, rt: SandboxRuntime) -> None:
        self._release(rt.id)

    def _release(self, sandbox_id: str) -> None:
        with self._lock:
            self._sandboxes.pop(sandbox_id, None)
            pending = self._pending.pop(sandbox_id, None)
        if pending is not None:  # a create that failed before the sandbox started
            where, future = pending
            if future.exception() is not None:
                log.debug("sandbox %s: early attach failed: %s", sandbox_id, future.exception())
            _remove_cgroup(where)  # the backend may never have taken it over
        _unregister(sandbox_id)
        if self._network is not None or EgressNetwork(self.config.home).exists():
            self.network.detach(sandbox_id)

    def close(self) -> None:
        self._stop.set()
        if self._refresher is not None:
            self._refresher.join(timeout=10)
            self._refresher = None
        with self._lock:
            attacher, self._attacher = self._attacher, None
        if attacher is not None:
            attacher.shutdown(wait=True)
        with self._lock:
            programs, self._programs = self._programs, None
        if programs is not None:
            # Attached programs stay with their sandboxes' cgroups, and the maps stay pinned
            # (empty, they hold next to nothing): another node on this host may share them.
            programs.close()
        network = self._network or EgressNetwork(self.config.home)
        if network.exists() and not network.remove_if_unused():
            log.info("egress namespace %s stays: sandboxes still use it", network.name)

    # --- domains, on a schedule ------------------------------------------------------------
    def _track(self, tracked: _Tracked) -> None:
        with self._lock:
            self._sandboxes[tracked.rt.id] = tracked
            if tracked.domains and self._refresher is None:
                self._stop.clear()
                self._refresher = threading.Thread(
                    target=self._refresh_loop, name="dsec-egress-resolve", daemon=True
                )
                self._refresher.start()

    def _refresh_loop(self) -> None:
        while not self._stop.wait(self.resolver.refresh):
            try:
                self.refresh()
            except Exception:  # the schedule must go on
                log.exception("re-resolving egress domains")

    def refresh(self) -> None:
        """Resolve every sandbox's domains again and update the maps and hosts files of those
        whose answers changed."""
        with self._lock:
            tracked = list(self._sandboxes.values())
        names = set().union(*(t.domains for t in tracked)) if tracked else set()
        if not names:
            return
        answers = self.resolver.resolve(names, fresh=True)
        for t in tracked:
            resolved = {d: answers.get(d, ()) for d in t.domains}
            if resolved == t.resolved:
                continue
            with self._lock:
                if self._sandboxes.get(t.rt.id) is not t:
                    continue  # released or updated meanwhile
                try:
                    with SandboxMaps.open(t.rt.id) as maps:
                        maps.sync(_Tracked(t.rt, t.rules, resolved).entries())
                except DsecError as e:
                    log.warning("sandbox %s: egress maps: %s", t.rt.id, e)
                    continue
                t.resolved = resolved
                self._write_hosts(t)
                log.info("sandbox %s: egress domains now resolve to %s", t.rt.id, resolved)

    def _write_hosts(self, t: _Tracked) -> None:
        path = hosts_file(t.rt)
        if not path.exists():
            return
        # in place: the sandbox's bind mount holds this inode
        with open(path, "r+") as f:
            hostname = _hostname_of(f.read())
            f.seek(0)
            f.write(_hosts_text(hostname, t.resolved))
            f.truncate()


def _unregister(sandbox_id: str) -> None:
    """Drop the sandbox's rules and counters from the maps, if it has any there."""
    try:
        with NodeMaps.open() as maps:
            maps.unregister(sandbox_id)
    except UnknownSandbox:
        pass  # no maps pinned: nothing was ever registered


def _remove_cgroup(d: Path) -> None:
    """Remove an empty cgroup directory made for an early attach (its programs go with it)."""
    try:
        d.rmdir()
    except FileNotFoundError:
        pass
    except OSError as e:
        log.warning("cannot remove cgroup %s: %s", d, e)


def _hosts_text(hostname: str, resolved: Mapping[str, tuple[str, ...]]) -> str:
    lines = [
        "127.0.0.1\tlocalhost",
        "::1\tlocalhost ip6-localhost ip6-loopback",
    ]
    if hostname:
        lines.append(f"127.0.1.1\t{hostname}")
    lines.append("# dsec egress: what the allowlist's domains resolved to on the node")
    for name in sorted(resolved):
        lines += [f"{addr}\t{name}" for addr in resolved[name]]
    return "\n".join(lines) + "\n"


def _hostname_of(text: str) -> str:
    for line in text.splitlines():
        if line.startswith("127.0.1.1\t"):
            return line.split("\t", 1)[1]
    return ""
