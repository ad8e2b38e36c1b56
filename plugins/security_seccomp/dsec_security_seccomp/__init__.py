"""dsec security policy plugin ``seccomp``: a default-deny seccomp profile, in the style of
Docker's default, on every container sandbox (through the OCI config), with per-sandbox
exceptions (``allow``) and nested namespaces on request (``userns``)."""

from dsec_core.hookspecs import hookimpl

from .policy import SeccompPolicy
from .profile import build_profile

#: The dsec plugin API this plugin is written for (docs/plugins/index.md, "Writing a plugin").
DSEC_PLUGIN_API = 2

__all__ = ["SeccompPolicy", "build_profile"]


@hookimpl
def dsec_register_security_policies(register):
    register(SeccompPolicy)
