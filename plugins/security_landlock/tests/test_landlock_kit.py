"""The landlock policy runs the conformance kit every dsec security policy runs (as root: the
kit's sandboxes run on a real node)."""

from __future__ import annotations

from dsec_core.testing import SecurityPolicyConformance


class TestLandlockKit(SecurityPolicyConformance):
    policy_name = "landlock"
    backend_name = "container"
    bad_settings = [
        ({"read_only": ["usr/bin"]}, "policies.landlock.read_only[0]"),
        ({"hidden": ["/a", "/b/../c"]}, "policies.landlock.hidden[1]"),
        ({"hidden": ["/"]}, "policies.landlock.hidden[0]"),
        ({"scope": ["everything"]}, "policies.landlock.scope"),
    ]
    tightening = [{"read_only": ["/usr"]}, {"hidden": ["/home"], "scope": ["signal"]}]

    def check_effect(self, sb, settings):
        for path in settings.get("read_only", []):
            r = sb.exec(f"touch {path}/dsec-kit-written")
            assert r.exit_code != 0 and b"ermission denied" in r.stderr, (path, r)
        for path in settings.get("hidden", []):
            r = sb.exec(f"ls {path}")
            assert r.exit_code != 0 and b"ermission denied" in r.stderr, (path, r)
