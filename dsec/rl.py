"""dsec.rl: the trainer-facing interface (``dsec_core.rl``): a gymnasium environment over a
sandbox, forking from snapshots, and typed infrastructure failures. Needs ``gymnasium``
(``pip install dsec[rl]``)."""

from dsec_core.records import INFRA_KINDS, InfraEvent, LeaseInfo, TrajectoryEntry
from dsec_core.rl import (
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
    "InfraEvent",
    "Lease",
    "LeaseInfo",
    "Reward",
    "SandboxEnv",
    "TrajectoryEntry",
    "command_reward",
    "drive_client_source",
    "infra_event",
]
