"""dsec FnCall backend plugin: container sandboxes that can be reset between calls (a read-only
root, fresh tmpfs work areas), for the node's warm FnCall pools."""

from dsec_core.hookspecs import hookimpl

from .member import FnCallBackend

__all__ = ["FnCallBackend"]


@hookimpl
def dsec_register_backends(register):
    register(FnCallBackend)
