"""The builder's typed errors: each a ``DsecError`` (so the CLI prints ``Error: ...`` and exits
non-zero), with its context (build name, tool, step, checks) kept as attributes."""

from __future__ import annotations

from dsec_core.errors import DsecError, InvalidSpec, UnknownSandbox

__all__ = ["BuildExists", "BuildSessionLost", "BuildToolError", "QAFailed", "UnknownBuild"]


class BuildToolError(InvalidSpec):
    """A tool call the session cannot run as asked: an unknown tool or a bad argument (from a
    plan, ``tool`` and ``step`` say which). Nothing ran: the session is as it was."""


class UnknownBuild(UnknownSandbox):
    """No build record of that name under ``$DSEC_HOME/builds``."""


class BuildExists(DsecError):
    """A build of that name is open or staged already: finish or remove it first."""

    http_status = 409


class BuildSessionLost(UnknownSandbox):
    """The build's sandbox is gone (killed, expired, its node restarted without it): nothing
    of the build was packed, and nothing staged is left half-written."""


class QAFailed(DsecError):
    """A staged layer failed QA: ``failed`` names the checks, ``report`` is the stored report.
    The layer stays staged with its report; nothing is published."""

    http_status = 422
