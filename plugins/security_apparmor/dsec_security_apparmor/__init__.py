"""dsec security policy plugin ``apparmor``: a sandbox's file policy (read-only and hidden paths,
signal and abstract-socket scope; the settings ``landlock`` reads too) as an AppArmor profile on
every process of a container sandbox, where the host kernel has AppArmor."""

from dsec_core.hookspecs import hookimpl

from .policy import AppArmorPolicy
from .profile import Profile, quote, render

#: The dsec plugin API this plugin is written for (docs/plugins/index.md, "Writing a plugin").
DSEC_PLUGIN_API = 2

__all__ = ["AppArmorPolicy", "Profile", "quote", "render"]


@hookimpl
def dsec_register_security_policies(register):
    register(AppArmorPolicy)
