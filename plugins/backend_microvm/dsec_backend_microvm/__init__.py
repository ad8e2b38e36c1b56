"""dsec microVM backend plugin: each sandbox is a small QEMU guest with its own kernel, booted
from the node's EROFS layers (virtio-pmem with DAX, or read-only virtio-blk) and served by the
same agent as a container, over a virtio-serial channel."""

from dsec_core.hookspecs import hookimpl

from .microvm import MicroVmBackend

#: The dsec plugin API this plugin is written for (docs/plugins/index.md, "Writing a plugin").
DSEC_PLUGIN_API = 2

__all__ = ["MicroVmBackend"]


@hookimpl
def dsec_register_backends(register):
    register(MicroVmBackend)
