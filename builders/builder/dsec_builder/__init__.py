"""dsec environment builder: agents build environments in a sandbox on the platform itself.

``dsec build start --from ENV --name NEW`` opens a build session (a sandbox under the builder's
account, network only to the package indexes its policy names); its tools (exec, session exec,
read, write, list, finish) are served to MCP clients and replayed from YAML plans; ``finish``
scrubs the session, packs it as a staged layer (leak-scanned), runs QA in fresh sandboxes under
a runtime identity and publishes the environment once QA passes.
"""

from __future__ import annotations

from dsec_core.hookspecs import hookimpl

from .errors import BuildExists, BuildSessionLost, BuildToolError, QAFailed, UnknownBuild
from .plan import load_plan, run_plan
from .policy import BuildPolicy, PackageIndex
from .qa import DEFAULT_MAX_BYTES, Check, QAReport, TaskSpec, run_qa, run_task
from .record import BuildRecord, BuildStore
from .session import BuildContext, BuildSession, FinishResult
from .tools import TOOL_NAMES, BuildTools

#: The dsec plugin API this plugin is written for (docs/plugins/index.md, "Writing a plugin").
DSEC_PLUGIN_API = 2

__all__ = [
    "DEFAULT_MAX_BYTES",
    "TOOL_NAMES",
    "BuildContext",
    "BuildExists",
    "BuildPolicy",
    "BuildRecord",
    "BuildSession",
    "BuildSessionLost",
    "BuildStore",
    "BuildToolError",
    "BuildTools",
    "Check",
    "FinishResult",
    "PackageIndex",
    "QAFailed",
    "QAReport",
    "TaskSpec",
    "UnknownBuild",
    "load_plan",
    "run_plan",
    "run_qa",
    "run_task",
]


@hookimpl
def dsec_register_commands(cli):
    """``dsec build``."""
    from .cli import build

    cli.add_command(build)
