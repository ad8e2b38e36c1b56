"""Hook signatures of dsec (pluggy project ``dsec``); plugins implement them with ``@hookimpl``.

Registration hooks take a ``register`` callback, so one plugin can offer several things.
Hooks that pick one answer are ``firstresult``: they stop at the first non-None result.
"""

from __future__ import annotations

import pluggy

__all__ = ["hookimpl", "hookspec"]

hookspec = pluggy.HookspecMarker("dsec")
hookimpl = pluggy.HookimplMarker("dsec")


# --- node set-up: what this node can run ---------------------------------------------------


@hookspec
def dsec_register_backends(register):
    """Offer sandbox backends: call ``register(BackendSubclass)`` once for each."""


@hookspec
def dsec_register_layer_sources(register):
    """Offer layer sources: call ``register(LayerSourceSubclass)``; its ``scheme`` names it."""


@hookspec
def dsec_register_security_policies(register):
    """Offer security policies: call ``register(SecurityPolicySubclass)`` once for each."""


# --- control plane ------------------------------------------------------------------------


@hookspec(firstresult=True)
def dsec_place(request, nodes):
    """Pick the node for a sandbox request from eligible ``nodes``.

    :param request: the ``SandboxSpec`` being placed.
    :param nodes: list of ``NodeLoad`` records of eligible nodes.
    :return: the chosen ``NodeLoad``, or None to let the next plugin decide.
      Stops at first non-None result.
    """


# --- user interface -----------------------------------------------------------------------


@hookspec
def dsec_register_commands(cli):
    """Add click commands or groups to the ``dsec`` CLI: ``cli.add_command(...)``."""
