"""The one error tree of dsec: catch ``DsecError`` to catch everything we raise on purpose.

Each subclass keeps its context (sandbox id, command, exit code, stderr, ...) as attributes and
in its message. Errors cross the node daemon's HTTP API by name (``to_wire``/``from_wire``), so
a client raises the same class the daemon raised.
"""

from __future__ import annotations

from typing import Any, ClassVar

__all__ = [
    "AdmissionRejected",
    "AgentProtocolError",
    "AgentUnresponsive",
    "AuthenticationFailed",
    "BackendUnavailable",
    "CatalogInvalid",
    "CommandFailed",
    "DiskFull",
    "DsecError",
    "ExecTimeout",
    "ExtraMissing",
    "FeatureUnavailable",
    "GuestImageError",
    "GuestPanic",
    "HeadersTooLarge",
    "IamUnavailable",
    "InvalidSpec",
    "KeyExists",
    "LayerBuildError",
    "LayerCorrupt",
    "LayerExists",
    "LayerInUse",
    "LeakFound",
    "LeaseHeld",
    "MissingParentLayers",
    "MountError",
    "NetlinkError",
    "NodeLost",
    "NodeSideMissing",
    "NodeUnavailable",
    "NotFound",
    "PermissionDenied",
    "PluginApiMismatch",
    "PluginInvalid",
    "PluginVersionMismatch",
    "PolicyUnavailable",
    "ProjectExists",
    "ProjectInUse",
    "QuotaExceeded",
    "RequestTimeout",
    "RequestTooLarge",
    "SandboxDied",
    "SandboxError",
    "SandboxNotRunning",
    "SandboxPathError",
    "SandboxPaused",
    "SessionClosed",
    "SnapshotInUse",
    "SourceUnavailable",
    "StartTimeout",
    "StepInterrupted",
    "ToolError",
    "TrajectoryDiverged",
    "UnknownBackend",
    "UnknownEnvironment",
    "UnknownImage",
    "UnknownKey",
    "UnknownLayer",
    "UnknownLease",
    "UnknownPolicy",
    "UnknownProject",
    "UnknownSandbox",
    "UnknownSession",
    "UnknownSnapshot",
    "UnknownSource",
    "error_from_wire",
]


class DsecError(Exception):
    """Root of every error dsec raises on purpose; anything else is a bug."""

    http_status: ClassVar[int] = 500

    def __init__(self, message: str, **context: Any) -> None:
        super().__init__(message)
        self.message = message
        self.context = context
        for key, value in context.items():
            setattr(self, key, value)

    def __str__(self) -> str:
        return self.message

    def __getattr__(self, name: str) -> Any:
        # Context is set as attributes in __init__; this only answers for what is not there,
        # and tells type checkers that a ``DsecError`` carries context attributes.
        raise AttributeError(f"{type(self).__name__} has no context {name!r}")

    def to_wire(self) -> dict[str, Any]:
        return {
            "type": type(self).__name__,
            "message": self.message,
            "context": {k: v for k, v in self.context.items() if _jsonable(v)},
        }


def _jsonable(value: Any) -> bool:
    return value is None or isinstance(value, (str, int, float, bool, list, dict))


class NotFound(DsecError):
    """Something named does not exist; the message lists what does (``known``: an empty list
    says "none known", None lists nothing)."""

    http_status = 404

    def __init__(self, message: str, *, name: str = "", known: list[str] | None = None, **ctx: Any):
        listed = known is not None
        known = list(known or [])
        if known and "known:" not in message:
            shown = ", ".join(known[:20]) + (" ..." if len(known) > 20 else "")
            message = f"{message} (known: {shown})"
        elif listed and not known and "known:" not in message and name:
            message = f"{message} (none known)"
        super().__init__(message, name=name, known=known, **ctx)


class UnknownSandbox(NotFound):
    """No sandbox with that id on this node."""


class SandboxDied(UnknownSandbox):
    """The sandbox is gone: it stopped on its own (its init or VM killed from outside, a guest
    kernel panic), and the node cleans up (or has cleaned up) after it. Carries
    ``sandbox_id``, ``cause`` (what the backend saw: a VM's console's last words, say) and
    ``kind``: "guest_panic" or "crashed". An infrastructure failure, not the task's doing."""


class UnknownSnapshot(NotFound):
    """No memory snapshot of that name on this node."""


class UnknownLayer(NotFound):
    """No layer with that ``name@version`` or digest in any layer source."""


class MissingParentLayers(UnknownLayer):
    """A snapshot's parent layers are in no layer source: ``missing`` names them (``ref
    digest``), ``digests`` lists their digests."""


class UnknownBackend(NotFound):
    """No backend plugin registered under that name."""


class UnknownEnvironment(NotFound):
    """No catalog environment (or task) with that name."""


class UnknownImage(NotFound):
    """No docker image of that name or id in the local docker (importing one never pulls)."""


class UnknownSession(NotFound):
    """No shell session with that id in the sandbox."""


class UnknownSource(NotFound):
    """A layer source scheme no plugin handles."""


class UnknownLease(NotFound):
    """No lease of that id on the node: it was released, or the node restarted since."""


class UnknownPolicy(NotFound):
    """A sandbox asked for a security policy no plugin provides."""


class InvalidSpec(DsecError):
    """A request or spec is malformed: wrong type, bad size string, conflicting fields
    (HTTP 422, with ``field`` the path to what is wrong: ``CreateRequest.spec.cpu``)."""

    http_status = 422


class RequestTooLarge(InvalidSpec):
    """A request body is over the API's limit; ``limit`` says how many bytes it may have."""

    http_status = 413


class HeadersTooLarge(InvalidSpec):
    """A request's line and headers are over the server's limit (``DSEC_MAX_HEADER_BYTES``);
    ``limit`` says how many bytes they may have. The server closes the connection."""

    http_status = 431


class RequestTimeout(DsecError):
    """A request did not arrive in time: its headers not complete within
    ``DSEC_HEADER_TIMEOUT``, or no byte of its body for ``DSEC_BODY_TIMEOUT`` (``timeout``, in
    seconds). The server closes the connection."""

    http_status = 408


class CatalogInvalid(InvalidSpec):
    """A catalog document fails its schema; ``path`` is the JSON path of the fault."""


class AmbiguousName(DsecError):
    """A bare environment or task name that more than one catalog defines: ``choices`` lists
    the qualified names (``<catalog>/<name>``) to pick from. Nothing silently shadows."""

    http_status = 409


class LayerStale(DsecError):
    """A layer recipe changed (its recipe fingerprint differs from the built layer's) but its
    version did not: ``ref`` names the layer. Versions are immutable: bump its version."""

    http_status = 409


class LayerBuildError(DsecError):
    """Building an EROFS layer failed (bad source, mkfs.erofs error, docker export error)."""


class LayerExists(DsecError):
    """``name@version`` already names a different layer; versions are immutable."""

    http_status = 409


class LayerInUse(DsecError):
    """A layer snapshots in the same store are taken over (``dependents`` names them): removing
    it would leave them unrestorable. Remove them first, or force it."""

    http_status = 409


class LeakFound(DsecError):
    """``pack_diff``'s leak scan found a declared secret (a hidden test, a reference solution)
    in the packed layer, which was removed. ``hits`` lists ``{"path": ..., "label": ...}``:
    the file inside the sandbox and the secret's label. Never carries the secret's text."""

    http_status = 422


class LeaseHeld(DsecError):
    """A sandbox is held by another trainer's live lease: it can be taken over only once that
    lease lapses or is released. Carries ``sandbox_id`` and ``lease``."""

    http_status = 409


class LayerCorrupt(DsecError):
    """A fetched blob is truncated or does not match its digest; it never reaches a sandbox."""

    http_status = 502


class SourceUnavailable(DsecError):
    """A layer source cannot be reached, or refuses our credentials; ``source`` names it."""

    http_status = 503


class DiskFull(DsecError):
    """The node's disk (its home: layer stores, sandboxes' writable layers, logs) has no room
    for what was asked; ``path`` names where, if known. An infrastructure failure: the
    request can be sent again once room is made, or to another node."""

    http_status = 507


class ToolError(DsecError):
    """An external program (runc, mkfs.erofs, debootstrap, docker) failed.

    Carries ``command``, ``exit_code``, ``stdout`` and ``stderr`` like python-on-whales does.
    """

    command: list[str]
    exit_code: int | None
    stdout: str
    stderr: str

    def __init__(
        self,
        message: str,
        *,
        command: list[str] | None = None,
        exit_code: int | None = None,
        stdout: str = "",
        stderr: str = "",
        **ctx: Any,
    ):
        tail = (stderr or stdout or "").strip()[-2000:]
        full = message
        if command:
            full += f"\n  command: {' '.join(command)}\n  exit code: {exit_code}"
        if tail:
            full += f"\n  stderr: {tail}"
        super().__init__(
            full, command=command or [], exit_code=exit_code, stdout=stdout, stderr=stderr, **ctx
        )


class GuestImageError(ToolError):
    """Making a VM guest's boot files failed: apt cannot get the kernel package (or the pinned
    version), a kernel module is unknown or compressed, a file for the initramfs is unusable.
    Carries ``command``, ``exit_code`` and ``stderr`` when a program failed, and ``module``
    when a module is at fault."""


class BackendUnavailable(DsecError):
    """The backend exists but cannot run here (missing runtime, kernel feature, ...)."""

    http_status = 503


class FeatureUnavailable(BackendUnavailable):
    """The sandbox's backend does not offer what the request needs (``feature``: a screen,
    say), so this sandbox can never serve it: a client's error (409), unlike the host lacking
    a backend's runtime. Carries ``backend`` and ``feature``."""

    http_status = 409


class PolicyUnavailable(DsecError):
    """A security policy a sandbox asked for cannot be enforced on its backend or this host.

    Never a silent pass: the sandbox is not created. ``policy`` and ``backend`` name the two.
    """

    http_status = 422


class PluginInvalid(DsecError):
    """A plugin registered something that breaks the plugin contract (wrong base class, no
    name, an undeclared feature); the message says what and how to fix it."""


class PluginApiMismatch(PluginInvalid):
    """A plugin was written for another plugin API than this dsec's (``declared`` and
    ``supported``); the message points at what to do: migrate it, or upgrade dsec."""


class PluginVersionMismatch(PluginInvalid):
    """A plugin's distribution was written for other dsec versions than the one running: the
    range it requires of dsec (``requires``, from its ``Requires-Dist: dsec[node]>=0.1,<0.2``)
    does not hold ``running``. Carries ``plugin``, ``distribution``, ``requires``, ``running``."""


class AdmissionRejected(DsecError):
    """The node refuses the request: it would exceed the node's capacity."""

    http_status = 429


class QuotaExceeded(AdmissionRejected):
    """The request would take a project (or one of its ancestors) over its quota of sandboxes,
    CPU or memory. Carries ``project`` (the project whose quota it is), ``resource``
    (``sandboxes``, ``cpu`` or ``memory``), ``limit``, ``used`` and ``requested``."""

    http_status = 429


class SandboxError(DsecError):
    """A sandbox operation failed inside or around the sandbox."""

    http_status = 500


class SandboxNotRunning(SandboxError):
    """The sandbox exists in the records but its processes are gone."""

    http_status = 409


class SandboxPaused(SandboxError):
    """The sandbox is paused: nothing in it answers until it is resumed."""

    http_status = 409


class StartTimeout(SandboxError):
    """A sandbox took longer to start than its spec's ``start_timeout``; it was killed."""

    http_status = 504


class GuestPanic(SandboxError):
    """A VM sandbox's guest kernel panicked (an infrastructure failure, not the command's):
    carries ``sandbox_id`` and the ``console``'s last lines."""

    http_status = 500


class TrajectoryDiverged(SandboxError):
    """A command logged at a step of a trajectory is replayed with another command: the loop
    that replays it is not the one that ran it. Carries ``trajectory``, ``step``, ``logged``
    and ``command``."""

    http_status = 409


class StepInterrupted(SandboxError):
    """A step of a trajectory was started by a node daemon that stopped (or lost its sandbox's
    agent) before the step's result was logged: whether, and how far, the command ran is
    unknown, so it is neither run again nor made up. Carries ``trajectory`` and ``step``. An
    infrastructure failure: the rollout is masked, not scored."""

    http_status = 409


class AgentUnresponsive(SandboxError):
    """A sandbox's agent did not answer within a command's timeout and the grace it has to
    enforce it: its guest or container stopped running (a VM QEMU stopped, a frozen
    sandbox). An infrastructure failure; carries ``sandbox_id``."""

    http_status = 504


class AgentProtocolError(SandboxError):
    """A sandbox's agent answered with a reply that breaks the wire protocol or its limits (a
    header or body larger than the request allows, a malformed field); nothing of it is used,
    and nothing of the claimed size was allocated."""

    http_status = 502


class ExecTimeout(SandboxError):
    """A command ran past its timeout; its whole process tree was killed."""

    http_status = 504


class CommandFailed(SandboxError):
    """``ExecResult.check()`` found a non-zero exit code."""

    http_status = 500


class SandboxPathError(SandboxError):
    """A file operation inside the sandbox failed (no such file, is a directory, ...)."""

    http_status = 400


class SessionClosed(SandboxError):
    """The shell session ended (its shell exited or was killed after a timeout)."""

    http_status = 410


class MountError(DsecError):
    """A mount(2)-family call failed while composing layers."""


class NetlinkError(DsecError):
    """The kernel refused a network set-up request: a netlink message (devices, addresses,
    routes) or entering a network namespace. Carries ``operation``, ``errno`` and ``netns``."""


class NodeUnavailable(DsecError):
    """The node daemon cannot be reached or started."""

    http_status = 503


class NodeSideMissing(DsecError):
    """What was asked needs dsec's node side (the node daemon, the apiserver, catalogs,
    plugins), and this install is the client alone: ``pip install 'dsec[node]'`` adds it.
    Carries ``command`` (what needed it), ``missing`` (the node extra's distributions not
    installed) and ``install`` (the command that adds them). Not a ``NodeUnavailable``: no
    node went away, and no retry or infrastructure mask will help."""


class ExtraMissing(DsecError):
    """What was asked needs an optional extra of dsec this install lacks (``dsec mcp`` needs
    ``pip install 'dsec[mcp]'``). Carries ``command``, ``extra``, ``missing`` (its
    distributions not installed) and ``install`` (the command that adds them)."""


class NodeLost(NodeUnavailable):
    """The node that holds the sandbox stopped answering the control plane's probes (its
    daemon or its machine is gone). Carries ``node`` and ``sandbox``; the sandbox's state is
    unknown until the node comes back."""


class AuthenticationFailed(DsecError):
    """A request to the node's network API carried no bearer token, or the wrong one; or an
    apiserver request carried no API key, a revoked one or an unknown one."""

    http_status = 401


class PermissionDenied(DsecError):
    """The caller's key is valid but its role may not do this (an agent key managing keys, a
    member key creating projects). Never raised for another project's sandbox: that is
    ``UnknownSandbox``, so ids do not leak."""

    http_status = 403


# --- IAM (dsec_core.iam) -------------------------------------------------------------------


class UnknownProject(NotFound):
    """No IAM project at that path (``name``): it was never created, or it was revoked."""


class UnknownKey(NotFound):
    """No API key with that id (``name``), or none the caller may manage: another project's
    key ids are not told apart from ones that never existed."""


class ProjectExists(DsecError):
    """An IAM project at that path (``project``) already exists."""

    http_status = 409


class KeyExists(DsecError):
    """The project (``project``) already has an API key of that name (``name``)."""

    http_status = 409


class SnapshotInUse(DsecError):
    """A memory snapshot is still the memory of running sandboxes started from it
    (``sandboxes`` names them): each maps its saved RAM, sharing its pages. Kill them (or
    let them end) first."""

    http_status = 409


class ProjectInUse(DsecError):
    """An IAM project still has subprojects (``children``) or API keys (``keys``): revoking
    it would orphan them. Revoke them first, or force it (which revokes them too)."""

    http_status = 409


class IamUnavailable(DsecError):
    """The IAM store (its SQLite file or etcd, ``store``) cannot be reached or read."""

    http_status = 503


def _all_subclasses(cls: type[DsecError]) -> list[type[DsecError]]:
    out: list[type[DsecError]] = []
    for sub in cls.__subclasses__():
        out.append(sub)
        out.extend(_all_subclasses(sub))
    return out


def error_from_wire(payload: dict[str, Any]) -> DsecError:
    """Rebuild the typed error a daemon sent; unknown names become a plain ``DsecError``."""
    by_name = {c.__name__: c for c in _all_subclasses(DsecError)}
    cls = by_name.get(payload.get("type", ""), DsecError)
    err = cls.__new__(cls)
    context = dict(payload.get("context") or {})
    DsecError.__init__(err, payload.get("message", "unknown error"), **context)
    return err
