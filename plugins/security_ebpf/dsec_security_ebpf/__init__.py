"""dsec security policy plugin ``egress``: a per-sandbox egress allowlist (CIDR or domain, port,
protocol; default deny) enforced by BPF programs on the sandbox's cgroup, changed live by map
updates, with egress through a per-node network namespace."""

from dsec_core.hookspecs import hookimpl

from .network import EgressNetwork, egress_namespace, veth_name
from .policy import EgressPolicy
from .rules import Rule, parse_rule, parse_settings

#: The dsec plugin API this plugin is written for (docs/plugins/index.md, "Writing a plugin").
DSEC_PLUGIN_API = 2

__all__ = [
    "EgressNetwork",
    "EgressPolicy",
    "Rule",
    "egress_namespace",
    "parse_rule",
    "parse_settings",
    "veth_name",
]


@hookimpl
def dsec_register_security_policies(register):
    register(EgressPolicy)
