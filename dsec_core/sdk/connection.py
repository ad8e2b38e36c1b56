"""Where a client connects, the same for both twins: the address given, else ``DSEC_ADDRESS``
(with ``DSEC_TOKEN``), else the local node daemon's unix socket, started if none runs (the
embedded single-node default); and for how long a request keeps trying while the node is away.

Starting the local daemon is the one step of a client's set-up that blocks, in both twins: it
happens once, in their constructor (``Connected``), before any operation.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

from ..api.transport import Address
from ..config import NodeConfig
from ..errors import InvalidSpec
from ..localnode import ensure_daemon

RETRY_TIMEOUT = 15.0  # seconds a request keeps trying while the node is away (a restart)


class Connected:
    """What both twins are made of: a ``Connection`` of their arguments (see ``Client``), and
    their transport (``_transport``: blocking or asyncio) on it."""

    _transport: ClassVar[Callable[..., Any]]

    def __init__(
        self,
        address: str | os.PathLike[str] | None = None,
        *,
        token: str | None = None,
        verify: bool | str | os.PathLike[str] = True,
        autostart: bool = True,
        retry: float | None = None,
        api_key: str | None = None,
    ) -> None:
        c = connection(address, token=token, api_key=api_key, autostart=autostart, retry=retry)
        self.address = str(c.address)
        self._http = self._transport(c.address, token=c.token, verify=verify, retry=c.retry)


@dataclass(frozen=True)
class Connection:
    """What a client's transport is made with."""

    address: Address
    token: str | None
    retry: float


def connection(
    address: str | os.PathLike[str] | None,
    *,
    token: str | None,
    api_key: str | None,
    autostart: bool,
    retry: float | None,
) -> Connection:
    """The ``Connection`` of a client's arguments (``InvalidSpec`` naming a bad one)."""
    seconds = _retry_timeout(retry)
    where, token = _resolve(address, _api_key(token, api_key), autostart)
    return Connection(where, token, seconds)


def _retry_timeout(retry: float | None) -> float:
    if retry is None:
        text = os.environ.get("DSEC_RETRY_TIMEOUT", "").strip()
        try:
            retry = float(text) if text else RETRY_TIMEOUT
        except ValueError:
            retry = -1.0
        field = "DSEC_RETRY_TIMEOUT"
    else:
        field = "retry"
    if isinstance(retry, bool) or not isinstance(retry, (int, float)) or not 0 <= retry < 1e9:
        raise InvalidSpec(f"{field} must be seconds (0 or more), got {retry!r}", field=field)
    return float(retry)


def _api_key(token: str | None, api_key: str | None) -> str | None:
    """An apiserver's API key travels as the bearer token, as a node's token does."""
    if api_key is not None and token is not None and api_key != token:
        raise InvalidSpec("give token or api_key, not both", field="api_key")
    return token if token is not None else api_key


def _resolve(
    address: str | os.PathLike[str] | None, token: str | None, autostart: bool
) -> tuple[Address, str | None]:
    if token is not None and not isinstance(token, str):
        raise InvalidSpec(f"token must be a string, got {type(token).__name__}", field="token")
    if address is None and os.environ.get("DSEC_ADDRESS"):
        address = os.environ["DSEC_ADDRESS"]
        if token is None:  # the token goes with the address it was set for, never elsewhere
            token = os.environ.get("DSEC_TOKEN") or None
    if address is not None:
        return Address.parse(address), token
    config = NodeConfig.from_env()
    if autostart:
        ensure_daemon(config)
    return Address("unix", path=os.fspath(config.socket_path)), token
