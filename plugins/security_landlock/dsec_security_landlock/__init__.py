"""dsec security policy plugin ``landlock``: a sandbox's file policy (``read_only`` and
``hidden`` paths, ``scope``d signals and abstract unix sockets) enforced with Landlock by the
sandbox's agent on every process it starts, through the ``"agent"`` enforcement point."""

from dsec_core.hookspecs import hookimpl

from .policy import LandlockPolicy, host_abi

#: The dsec plugin API this plugin is written for (docs/plugins/index.md, "Writing a plugin").
DSEC_PLUGIN_API = 2

__all__ = ["LandlockPolicy", "host_abi"]


@hookimpl
def dsec_register_security_policies(register):
    register(LandlockPolicy)
