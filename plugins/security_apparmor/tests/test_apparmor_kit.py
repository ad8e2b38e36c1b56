"""The apparmor policy runs the conformance kit every dsec security policy runs. Where this
host's kernel has no AppArmor (this one), the kit's checks of an enforced policy skip with the
policy's own reason, and the unavailable path is checked instead: the create fails with that
reason and leaves nothing, and best_effort starts the sandbox without it, saying so."""

from __future__ import annotations

from dsec_core.testing import SecurityPolicyConformance


class TestAppArmorKit(SecurityPolicyConformance):
    policy_name = "apparmor"
    backend_name = "container"
    bad_settings = [
        ({"read_only": ["relative/path"]}, "policies.apparmor.read_only[0]"),
        ({"hidden": ["/.dsec"]}, "policies.apparmor.hidden[0]"),  # would hide the agent
        ({"scope": ["ptrace"]}, "policies.apparmor.scope"),
    ]
    tightening = [{"read_only": ["/usr"]}, {"hidden": ["/root"], "scope": ["signal"]}]

    def check_effect(self, sb, settings):
        for path in settings.get("read_only", []):
            assert sb.exec(f"touch {path}/dsec-kit-written").exit_code != 0, path

    def policy_leftovers(self, node):
        # profiles the policy wrote for the kernel, and the directory it keeps them in
        where = node.home / "run" / "apparmor"
        return {"profiles": sorted(p.name for p in where.iterdir()) if where.is_dir() else None}
