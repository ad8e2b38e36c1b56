"""dsec.rl: the trainer-facing interface (``dsec_core.rl``): a gymnasium environment over a
sandbox and its asyncio twin, forking from snapshots, typed infrastructure failures, and the
typed errors of an environment used out of turn. Needs ``gymnasium`` (``pip install dsec[rl]``)."""

from dsec_core.records import INFRA_KINDS, InfraEvent, LeaseInfo, TrajectoryEntry
from dsec_core.rl import (
    AsyncSandboxEnv,
    EnvClosed,
    EnvError,
    EnvNotReset,
    EpisodeEnded,
    InfraFailure,
    InvalidAction,
    Reward,
    SandboxEnv,
    command_reward,
    drive_client_source,
    infra_event,
)
from dsec_core.sdk import AsyncLease, Lease

__all__ = [
    "INFRA_KINDS",
    "AsyncLease",
    "AsyncSandboxEnv",
    "EnvClosed",
    "EnvError",
    "EnvNotReset",
    "EpisodeEnded",
    "InfraEvent",
    "InfraFailure",
    "InvalidAction",
    "Lease",
    "LeaseInfo",
    "Reward",
    "SandboxEnv",
    "TrajectoryEntry",
    "command_reward",
    "drive_client_source",
    "infra_event",
]
