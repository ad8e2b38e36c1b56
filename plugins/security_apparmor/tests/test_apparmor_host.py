"""The policy against the host: why it is unavailable (each reason, from sysfs trees made to
look like each kind of host, and from this host itself), settings checks, and the profile's
life on a host with AppArmor: loaded once per distinct settings, named in the OCI config,
unloaded when no sandbox and no process uses it. The kernel side is a stand-in tree and
apparmor_parser a stand-in script that records its calls; everything else is the real code."""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import pytest
from dsec_security_apparmor import parser
from dsec_security_apparmor.kernel import Kernel
from dsec_security_apparmor.policy import AppArmorPolicy
from dsec_security_apparmor.profile import render

from dsec_core.errors import InvalidSpec, PolicyUnavailable, ToolError
from dsec_core.records import SandboxSpec
from dsec_core.security import FileRules

SETTINGS = {"read_only": ["/usr/local/bin"], "hidden": ["/judge"], "scope": ["signal"]}
OTHER = {"hidden": ["/answers"]}


def fake_sys(
    root: Path,
    *,
    enabled: str | None = "Y",
    securityfs: bool = True,
    features: tuple[str, ...] = ("file", "mount", "ptrace", "signal"),
) -> Path:
    """A /sys that looks like a host whose AppArmor is in the given state."""
    if enabled is not None:
        param = root / "module/apparmor/parameters/enabled"
        param.parent.mkdir(parents=True)
        param.write_text(enabled + "\n")
    if securityfs:
        aa = root / "kernel/security/apparmor"
        (aa / "features").mkdir(parents=True)
        for feature in features:
            (aa / "features" / feature).mkdir(parents=True)
        (aa / "profiles").write_text("")
    return root


@dataclass(frozen=True)
class FakeKernel(Kernel):
    """Removing a profile also drops it from the profiles file, as the kernel would."""

    def remove(self, name: str) -> None:
        super().remove(name)
        lines = (self.securityfs / "profiles").read_text().splitlines()
        kept = [line for line in lines if line.rpartition(" (")[0] != name]
        (self.securityfs / "profiles").write_text("".join(f"{line}\n" for line in kept))


FAKE_PARSER = """#!/bin/sh
# stands in for apparmor_parser: records its arguments; -r adds the profile to the kernel's list
echo "$*" >> "{log}"
for last; do :; done
if grep -q FAIL-ME "$last"; then echo "AppArmor parser error: refused" >&2; exit 1; fi
if [ "$1" = "-r" ]; then
    echo "$(sed -n 's/^profile \\([^ ]*\\) .*/\\1/p' "$last") (enforce)" >> "{profiles}"
fi
"""


@pytest.fixture
def host(tmp_path, monkeypatch):
    """A host with AppArmor: a stand-in sysfs, procfs and apparmor_parser; a policy on it."""
    kernel = FakeKernel(sys=fake_sys(tmp_path / "sys"), proc=tmp_path / "proc")
    kernel.proc.mkdir()
    bindir = tmp_path / "bin"
    bindir.mkdir()
    log = tmp_path / "parser.log"
    script = bindir / "apparmor_parser"
    script.write_text(FAKE_PARSER.format(log=log, profiles=kernel.securityfs / "profiles"))
    script.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bindir}:{os.environ['PATH']}")
    monkeypatch.setattr(AppArmorPolicy, "kernel", kernel)
    policy = AppArmorPolicy(home=tmp_path / "home")
    return SimpleNamespace(
        kernel=kernel,
        policy=policy,
        calls=lambda: log.read_text().splitlines() if log.exists() else [],
        dir=tmp_path / "home" / "run" / "apparmor",
    )


def sandbox(sid: str, settings: dict) -> SimpleNamespace:
    """The parts of a SandboxRuntime the policy reads."""
    spec = SandboxSpec(environment="any", policies={"apparmor": settings})
    return SimpleNamespace(id=sid, spec=spec)


def confine(kernel: Kernel, pid: int, label: str) -> None:
    current = kernel.proc / str(pid) / "attr" / "apparmor" / "current"
    current.parent.mkdir(parents=True)
    current.write_text(f"{label} (enforce)\n")


# --- unavailable, and why -------------------------------------------------------------------
@pytest.mark.parametrize(
    ("state", "reason"),
    [
        ({"enabled": None, "securityfs": False}, "built without CONFIG_SECURITY_APPARMOR"),
        ({"enabled": "N"}, "built into the kernel but not enabled"),
        ({"securityfs": False}, "securityfs not mounted"),
        ({"features": ("file", "mount", "ptrace")}, "does not mediate signal rules"),
    ],
    ids=["not-built", "disabled", "no-securityfs", "old-kernel"],
)
def test_each_reason_it_is_unavailable(tmp_path, monkeypatch, state, reason):
    monkeypatch.setattr(AppArmorPolicy, "kernel", Kernel(sys=fake_sys(tmp_path, **state)))
    with pytest.raises(PolicyUnavailable) as e:
        AppArmorPolicy.check_available()
    assert reason in str(e.value) and e.value.policy == "apparmor"
    assert [reason in r for r in e.value.reasons] == [True]


def test_no_parser_is_a_reason_too(tmp_path, monkeypatch):
    monkeypatch.setattr(AppArmorPolicy, "kernel", Kernel(sys=fake_sys(tmp_path)))
    monkeypatch.setenv("PATH", os.fspath(tmp_path))
    monkeypatch.setattr(parser, "SBIN", ())
    with pytest.raises(PolicyUnavailable) as e:
        AppArmorPolicy.check_available()
    (reason,) = e.value.reasons
    assert reason == "apparmor_parser is not installed (Debian: apt-get install apparmor)"


def test_available_where_the_kernel_has_it(host):
    AppArmorPolicy.check_available()  # the stand-in host has all it needs


@pytest.mark.skipif(Kernel().unavailable() is None, reason="this host's kernel has AppArmor")
def test_this_host_says_why_not():
    with pytest.raises(PolicyUnavailable) as e:
        AppArmorPolicy.check_available()
    assert Kernel().unavailable() in e.value.reasons
    assert str(e.value).startswith("security policy 'apparmor' cannot be enforced on this host: ")


# --- settings -------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("settings", "field"),
    [
        ({"read_only": ["relative"]}, "policies.apparmor.read_only[0]"),
        ({"hidden": ["/ok", "/.dsec"]}, "policies.apparmor.hidden[1]"),
        ({"hidden": ["/.dsec/agent"]}, "policies.apparmor.hidden[0]"),
        ({"scope": ["ptrace"]}, "policies.apparmor.scope"),
        ({"writable": ["/tmp"]}, "policies.apparmor.writable"),
    ],
)
def test_bad_settings_name_the_field(host, settings, field):
    with pytest.raises(InvalidSpec) as e:
        host.policy.validate(settings)
    assert e.value.field == field


def test_a_scope_the_kernel_cannot_enforce_is_unavailable(host):
    host.policy.validate(SETTINGS)  # signal: the kernel has it
    with pytest.raises(PolicyUnavailable) as e:
        host.policy.validate({"scope": ["abstract_unix"]})
    assert "abstract_unix" in str(e.value) and e.value.scope == ["abstract_unix"]
    (host.kernel.securityfs / "features" / "network").mkdir()
    (host.kernel.securityfs / "features" / "network" / "af_unix").write_text("yes\n")
    host.policy.validate({"scope": ["abstract_unix"]})


# --- a profile's life -----------------------------------------------------------------------
def test_loaded_once_per_settings_and_named_in_the_oci_config(host):
    name = render(FileRules.parse(SETTINGS, "apparmor")).name
    configs = [{"process": {"args": ["/.dsec/agent"]}} for _ in range(3)]
    host.policy.apply_oci(sandbox("a", SETTINGS), SETTINGS, configs[0])
    host.policy.apply_oci(sandbox("b", SETTINGS), SETTINGS, configs[1])
    assert [c["process"]["apparmorProfile"] for c in configs[:2]] == [name, name]
    path = host.dir / name
    assert host.calls() == [f"-r -W -L {host.dir / 'cache'} {path}"]  # loaded once
    assert path.read_text() == render(FileRules.parse(SETTINGS, "apparmor")).text
    assert stat.S_IMODE(host.dir.stat().st_mode) == 0o700
    assert host.kernel.loaded() == {name}
    assert host.policy.stats(sandbox("a", SETTINGS)) == {"profile": name}

    host.policy.apply_oci(sandbox("c", OTHER), OTHER, configs[2])
    other = configs[2]["process"]["apparmorProfile"]
    assert other != name and host.kernel.loaded() == {name, other}

    host.policy.released(sandbox("a", SETTINGS))
    assert host.kernel.loaded() == {name, other}  # b still runs under it
    host.policy.released(sandbox("b", SETTINGS))
    host.policy.released(sandbox("c", OTHER))
    assert host.kernel.loaded() == set()
    assert (host.kernel.securityfs / ".remove").read_text() == other  # the last one written
    assert [p for p in host.dir.iterdir() if p.name != "cache"] == []  # profile files gone
    host.policy.close()
    assert not host.dir.exists()  # nothing left in the runtime dir


def test_a_unix_scope_profile_is_loaded_strict(host):
    (host.kernel.securityfs / "features" / "network").mkdir()
    (host.kernel.securityfs / "features" / "network" / "af_unix").write_text("yes\n")
    settings = {"scope": ["abstract_unix"]}
    host.policy.apply_oci(sandbox("a", settings), settings, {})
    assert "--warn=dev --Werror=dev" in host.calls()[0]


def test_another_profile_in_the_config_is_not_replaced(host):
    config = {"process": {"apparmorProfile": "someone-else"}}
    with pytest.raises(PolicyUnavailable, match="someone-else"):
        host.policy.apply_oci(sandbox("a", SETTINGS), SETTINGS, config)
    assert config["process"]["apparmorProfile"] == "someone-else" and host.calls() == []


def test_a_refused_profile_fails_the_create_and_loads_nothing(host):
    settings = {"hidden": ["/FAIL-ME"]}
    config: dict = {}
    with pytest.raises(ToolError) as e:
        host.policy.apply_oci(sandbox("a", settings), settings, config)
    assert "refused" in e.value.stderr and "apparmorProfile" not in config.get("process", {})
    assert host.kernel.loaded() == set() and host.policy.stats(sandbox("a", settings)) == {}
    assert [p.name for p in host.dir.iterdir()] == []  # no profile file left either
    host.policy.released(sandbox("a", settings))  # the node releases it: nothing to do
    host.policy.close()
    assert not host.dir.exists()


def test_a_profile_in_use_by_a_process_stays_loaded(host):
    name = render(FileRules.parse(SETTINGS, "apparmor")).name
    host.policy.apply_oci(sandbox("a", SETTINGS), SETTINGS, {})
    confine(host.kernel, 4242, name)  # a straggler the sandbox's stop did not reap yet
    host.policy.released(sandbox("a", SETTINGS))
    assert host.kernel.loaded() == {name}
    host.policy.close()
    assert host.kernel.loaded() == {name}  # unloading would leave pid 4242 unconfined
    (host.kernel.proc / "4242" / "attr" / "apparmor" / "current").unlink()
    host.policy.close()
    assert host.kernel.loaded() == set()


def test_a_restarted_daemon_adopts_and_releases(host, tmp_path):
    name = render(FileRules.parse(SETTINGS, "apparmor")).name
    host.policy.apply_oci(sandbox("live", SETTINGS), SETTINGS, {})
    host.policy.apply_oci(sandbox("dead", OTHER), OTHER, {})
    other = render(FileRules.parse(OTHER, "apparmor")).name
    confine(host.kernel, 100, name)
    host.policy.close()  # the daemon stops; its sandboxes keep running with their profiles
    assert host.kernel.loaded() == {name, other}

    again = AppArmorPolicy(home=tmp_path / "home")
    # the node's re-adoption: "dead" died meanwhile (its spec still says best_effort, a key
    # the node strips before a policy sees settings); "live" runs on
    again.released(sandbox("dead", {**OTHER, "best_effort": True}))
    again.adopted(sandbox("live", SETTINGS), SETTINGS)
    assert host.kernel.loaded() == {name}
    assert again.stats(sandbox("live", SETTINGS)) == {"profile": name}
    (host.kernel.proc / "100" / "attr" / "apparmor" / "current").unlink()
    again.released(sandbox("live", SETTINGS))
    assert host.kernel.loaded() == set()
    assert host.calls() == [  # nothing was loaded again
        f"-r -W -L {host.dir / 'cache'} {host.dir / name}",
        f"-r -W -L {host.dir / 'cache'} {host.dir / other}",
    ]
