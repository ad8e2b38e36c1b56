"""The SDK: ``Client`` (sync) and ``AsyncClient`` (asyncio) with the same methods, and their
handles (``Sandbox``/``AsyncSandbox``, sessions, rollout groups, trainer leases).

Every operation is written once, in ``core``, without I/O: it builds each request from the
route table (``dsec_core.api.routes``) and reads each answer; the two clients only run it on
their transport (``client``, ``async_client``). Its parameters and docstring are those of the
methods made from it, the clients' and the handles' (``methods``).

``Client()`` with no address talks to ``DSEC_ADDRESS`` (with ``DSEC_TOKEN``) if set, else to
the local node daemon on its unix socket, starting it if none runs (the embedded single-node
default; ``connection``).

Bad arguments raise ``InvalidSpec`` naming the argument before anything is sent: each request is
checked against the same decoders the node runs. While the node is away (its daemon restarting)
a request is retried for up to ``retry`` seconds (``DSEC_RETRY_TIMEOUT``, 15 by default) if it
never reached the node, and GETs and deletes also if it broke before the answer came.
"""

from __future__ import annotations

from .async_client import AsyncClient
from .client import Client
from .connection import RETRY_TIMEOUT
from .core import CHUNK, EXEC_GRACE, GROUP_LABEL, STREAM_START_TIMEOUT
from .handles import (
    AsyncGroup,
    AsyncLease,
    AsyncSandbox,
    AsyncSession,
    Group,
    Lease,
    Sandbox,
    Session,
)

__all__ = [
    "CHUNK",
    "EXEC_GRACE",
    "GROUP_LABEL",
    "RETRY_TIMEOUT",
    "STREAM_START_TIMEOUT",
    "AsyncClient",
    "AsyncGroup",
    "AsyncLease",
    "AsyncSandbox",
    "AsyncSession",
    "Client",
    "Group",
    "Lease",
    "Sandbox",
    "Session",
]
