"""dsec container backend plugin: sandboxes under runc with user, pid, mount, net, ipc and uts
namespaces, cgroup limits, masked /proc paths, no-new-privileges and a small capability set."""

from dsec_core.hookspecs import hookimpl

from .runc import ContainerBackend

#: The dsec plugin API this plugin is written for (docs/plugins/index.md, "Writing a plugin").
DSEC_PLUGIN_API = 2

__all__ = ["ContainerBackend"]


@hookimpl
def dsec_register_backends(register):
    register(ContainerBackend)
