"""The egress policy runs the conformance kit every dsec security policy runs, on the node of
this plugin's tests (conftest.py): its example allows one TEST-NET-1 destination, so the
programs, maps, veth and egress namespace all come up and nothing leaves the node."""

from __future__ import annotations

from dsec_security_ebpf import egress_namespace
from dsec_security_ebpf.testing import stale_registrations

from dsec_core.linux.netns import links, netns_exists
from dsec_core.testing import SecurityPolicyConformance


class TestEgressKit(SecurityPolicyConformance):
    policy_name = "egress"
    backend_name = "container"
    bad_settings = [
        ({"allow": ["10.0.0.1:80/tcp", "10.0.0.1:80/gre"]}, "policies.egress.allow[1]"),
        ({"allow": ["10.1.1.1/33:1/tcp"]}, "policies.egress.allow[0]"),
        ({"allow": "10.0.0.1:80/tcp"}, "policies.egress.allow"),
    ]
    tightening = [{"allow": []}, {"allow": ["192.0.2.1/32:80/tcp"]}]
    live_example = {"allow": ["192.0.2.11/32:80/tcp", "192.0.2.12/32:53/udp"]}

    def check_effect(self, sb, settings):
        (state,) = [p for p in sb.policies() if p.name == "egress"]
        assert state.stats["rules"] == len(settings["allow"]), state.stats  # one CIDR each

    def policy_leftovers(self, node):
        # The maps are the host's, shared with every other node on it (parallel test workers'
        # too): what this node may not leave is an entry whose sandbox is gone.
        stale = sorted(stale_registrations(wait=0))
        # the egress namespace itself comes with the first sandbox and goes with the node
        ns = egress_namespace(node.home)
        veths = sorted(n for n in links(ns) if n != "lo") if netns_exists(ns) else []
        return {"stale_registrations": stale, "veths": veths}


class TestEgressKitOnMicroVms(TestEgressKit):
    """The same kit with the sandboxes as microVMs: the guest's card takes the veth's place
    and its packets are checked there (``test_vm_egress.py`` has the traffic)."""

    backend_name = "microvm"
    sandbox_spec = {"memory": "256M"}
