"""dsec security policy plugin ``apparmor``: a sandbox's file policy (read-only and hidden paths,
signal and abstract-socket scope; the settings ``landlock`` reads too) as an AppArmor profile on
every process of a container sandbox, where the host kernel has AppArmor."""

from dsec_core.hookspecs import hookimpl

from .policy import AppArmorPolicy
from .profile import Profile, quote, render

__all__ = ["AppArmorPolicy", "Profile", "quote", "render"]


@hookimpl
def dsec_register_security_policies(register):
    register(AppArmorPolicy)
