"""dsec.rl: the trainer-facing interface. A gymnasium environment over a sandbox (and its asyncio
twin), forking of trajectories from snapshots, and the typing of infrastructure failures a
trainer masks.

    env = SandboxEnv(client, environment="judge-fizzbuzz", reward=command_reward("make test"))
    obs, info = env.reset()
    obs, reward, terminated, truncated, info = env.step("ls")
    obs, reward, terminated, truncated, info = env.step("submit")   # scored by ``reward``
    if info["infra"] is not None:   # preempted, out of memory, start timeout, node lost
        ...                         # not the policy's doing: mask it, do not score it zero

``AsyncSandboxEnv`` is the same environment on an ``AsyncClient``, its methods awaited. An
environment used out of turn raises an ``EnvError`` (``EnvNotReset``, ``EpisodeEnded``,
``EnvClosed``, ``InvalidAction``). ``env.fork(n)`` packs the sandbox's state (``pack_diff``) and
returns ``n`` environments that each go on from it in a sandbox of their own, without replaying
the steps so far. Rollout groups (``Client.group``) create, fork, pause and kill many sandboxes
together; leases (``Client.lease``) pause them when their trainer dies; ``dsec.rollout`` runs
batches of episodes. A loop that runs inside an agent sandbox drives its workers through the
drive socket: ``drive_client_source()`` is the Python client to copy in.

The environments need ``gymnasium`` (``pip install dsec[rl]``), loaded when one is first named;
the rest of this package (what ``dsec.rollout`` uses) does not.
"""

from __future__ import annotations

from importlib import resources
from typing import TYPE_CHECKING, Any

from .errors import EnvClosed, EnvError, EnvNotReset, EpisodeEnded, InfraFailure, InvalidAction
from .infra import infra_event
from .rewards import Reward, command_reward

if TYPE_CHECKING:
    from .env import CHARSET, AsyncSandboxEnv, SandboxEnv

__all__ = [
    "CHARSET",
    "AsyncSandboxEnv",
    "EnvClosed",
    "EnvError",
    "EnvNotReset",
    "EpisodeEnded",
    "InfraFailure",
    "InvalidAction",
    "Reward",
    "SandboxEnv",
    "command_reward",
    "drive_client_source",
    "infra_event",
]

_ENVS = ("CHARSET", "AsyncSandboxEnv", "SandboxEnv")


def __getattr__(name: str) -> Any:
    if name in _ENVS:
        from .env import CHARSET, AsyncSandboxEnv, SandboxEnv

        return {"CHARSET": CHARSET, "AsyncSandboxEnv": AsyncSandboxEnv, "SandboxEnv": SandboxEnv}[
            name
        ]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def drive_client_source() -> str:
    """The text of the drive socket's Python client (standard library only), to write into an
    agent sandbox as ``drive.py``: ``from drive import Drive``."""
    return resources.files("dsec_core.node").joinpath("drive_client.py").read_text()
