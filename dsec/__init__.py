"""dsec: elastic sandboxes for agentic RL. The public SDK.

import dsec
with dsec.Client() as client, client.create(environment="judge-fizzbuzz") as sb:
    print(sb.exec("python3 --version").text)
"""

from dsec_core import __version__
from dsec_core.api.iam import MintedKey
from dsec_core.errors import *  # noqa: F403 - the error tree is part of the SDK
from dsec_core.errors import __all__ as _errors
from dsec_core.iam.model import KeyInfo, Project, ProjectRevocation, Quota
from dsec_core.records import (
    CREATE_KEY_LABEL,
    CaseResult,
    ExecResult,
    FileEntry,
    FnCallResult,
    JudgeCase,
    JudgeResult,
    JudgeSpec,
    LayerInfo,
    Limits,
    SandboxInfo,
    SandboxSpec,
    SandboxUsage,
)
from dsec_core.sdk import (
    AsyncClient,
    AsyncGroup,
    AsyncSandbox,
    AsyncSession,
    Client,
    Group,
    Sandbox,
    Session,
)

__all__ = [
    "__version__",
    "Client",
    "AsyncClient",
    "Sandbox",
    "AsyncSandbox",
    "Session",
    "AsyncSession",
    "Group",
    "AsyncGroup",
    "SandboxSpec",
    "SandboxInfo",
    "ExecResult",
    "FnCallResult",
    "JudgeSpec",
    "JudgeCase",
    "JudgeResult",
    "CaseResult",
    "FileEntry",
    "LayerInfo",
    "Limits",
    "SandboxUsage",
    "Project",
    "Quota",
    "KeyInfo",
    "MintedKey",
    "ProjectRevocation",
    "CREATE_KEY_LABEL",
    *_errors,
]
