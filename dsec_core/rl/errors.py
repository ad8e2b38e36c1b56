"""The errors of ``dsec.rl``: an environment used out of turn or given an action it cannot take
(``EnvError`` and its kinds: the caller's bug, raised where the misuse happens), and
``InfraFailure``, an infrastructure failure raised as an error so code that sees one in a
result (an out-of-memory kill) can hand it on to whatever masks it (``dsec.rollout``)."""

from __future__ import annotations

from typing import Any

from ..errors import DsecError
from ..records import InfraEvent

__all__ = [
    "EnvClosed",
    "EnvError",
    "EnvNotReset",
    "EpisodeEnded",
    "InfraFailure",
    "InvalidAction",
]


class EnvError(DsecError):
    """A ``SandboxEnv`` (or ``AsyncSandboxEnv``) was used out of turn or given what it cannot
    take; carries ``sandbox_id`` and ``step``. Catch this to catch each kind below."""

    http_status = 409


class EnvNotReset(EnvError):
    """``step()`` or ``fork()`` before the first ``reset()`` (or after one that raised)."""


class EpisodeEnded(EnvError):
    """``step()`` or ``fork()`` after the episode ended: it was terminated (submitted) or
    truncated (``max_steps``, or an infrastructure failure); ``reset()`` starts the next."""


class EnvClosed(EnvError):
    """Any use of an environment after ``close()``."""


class InvalidAction(EnvError):
    """An action outside the action space: not a string, empty, longer than its
    ``max_length`` or with characters outside its charset (printable ASCII)."""

    http_status = 400


class InfraFailure(DsecError):
    """An infrastructure failure (``event``: an ``InfraEvent``) raised as an error: not the
    task's doing, so a rollout masks and retries it. ``infra_event`` gives back its event."""

    http_status = 503

    def __init__(self, event: InfraEvent, message: str = "", **context: Any) -> None:
        text = message or f"infrastructure failure ({event.kind}) of sandbox {event.sandbox_id}"
        if event.detail and not message:
            text += f": {event.detail}"
        super().__init__(text, kind=event.kind, sandbox_id=event.sandbox_id, **context)
        self.event = event
