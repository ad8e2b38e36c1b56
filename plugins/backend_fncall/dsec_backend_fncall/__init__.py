"""dsec FnCall backend plugin: container sandboxes that can be reset between calls (a read-only
root, fresh tmpfs work areas), for the node's warm FnCall pools."""

from dsec_core.hookspecs import hookimpl

from .member import FnCallBackend

#: The dsec plugin API this plugin is written for (docs/plugins/index.md, "Writing a plugin").
DSEC_PLUGIN_API = 2

__all__ = ["FnCallBackend"]


@hookimpl
def dsec_register_backends(register):
    register(FnCallBackend)
