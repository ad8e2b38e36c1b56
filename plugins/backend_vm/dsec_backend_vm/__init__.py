"""dsec VM backend plugin: full virtual machines under QEMU (q35) with a screen (``fullvm``):
screenshots and input over QMP (``screen``), the guest kernel and devices that give a VM a
framebuffer and evdev input (``display``) and guest test programs (``guest``)."""

from dsec_core.hookspecs import hookimpl

from .fullvm import FullVmBackend

#: The dsec plugin API this plugin is written for (docs/plugins/index.md, "Writing a plugin").
DSEC_PLUGIN_API = 2

__all__ = ["FullVmBackend"]


@hookimpl
def dsec_register_backends(register):
    register(FullVmBackend)
