"""The seccomp policy runs the conformance kit every dsec security policy runs (as root: the
kit's sandboxes run on a real node)."""

from __future__ import annotations

from dsec_core.testing import SecurityPolicyConformance


class TestSeccompKit(SecurityPolicyConformance):
    policy_name = "seccomp"
    backend_name = "container"
    bad_settings = [
        ({"allow": ["no_such_call"]}, "policies.seccomp.allow[0]"),
        ({"userns": 1}, "policies.seccomp.userns"),
        ({"allow": ["unshare"]}, "policies.seccomp.allow[0]"),  # namespaces need userns
    ]
    loosening = [{"userns": True}, {"allow": ["io_uring_setup"]}]
    tightening = [{"userns": False}, {"allow": []}]

    def check_effect(self, sb, settings):
        # a filter on the agent, and so on every process it starts
        assert "Seccomp:\t2" in sb.exec("cat /proc/self/status").text
