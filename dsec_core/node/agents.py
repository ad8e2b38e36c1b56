"""Inside a sandbox: commands, shell sessions and files go to the sandbox's agent
(``AgentClient``, one per sandbox, made on first use), with the spec's environment and working
directory; a command that ends badly is checked against the sandbox's OOM kills, and a command
of a trajectory is answered from its log when the log has it.
"""

from __future__ import annotations

import shlex
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import replace

from ..agent.rpc import AgentClient
from ..backend import Feature
from ..errors import InvalidSpec, SandboxPaused
from ..records import ExecResult, InfraEvent
from .host import AgentHost
from .sandbox import Sandbox

__all__ = ["Agents"]


class Agents:
    """The agents of ``host``'s sandboxes."""

    def __init__(self, host: AgentHost) -> None:
        self.host = host

    def agent(self, sid: str) -> AgentClient:
        """The agent of running, unpaused sandbox ``sid``."""
        sb = self.host.sandbox(sid)
        if sb.status != "running":
            raise sb.not_running()
        if sb.paused:  # its agent is frozen too: a request would wait until the resume
            raise SandboxPaused(f"sandbox {sid} is paused; resume it first", sandbox_id=sid)
        if sb.agent is None:
            sb.agent = AgentClient(sb.rt.agent_socket, sandbox_id=sid)
        return sb.agent

    async def exec(
        self,
        sid: str,
        cmd: str | Sequence[str],
        *,
        timeout: float | None = None,
        cwd: str | None = None,
        env: dict[str, str] | None = None,
        stdin: bytes | None = None,
        max_output: int = 1 << 20,
        background: bool = False,
        exclusive: bool = False,
        trajectory: str | None = None,
        step: int | None = None,
    ) -> ExecResult:
        """Run a command in the sandbox (see ``AgentClient.exec``): what it leaves running is
        killed when it exits unless ``background``; ``exclusive`` kills everything else first.
        With ``trajectory``, the command is ``step`` of that trajectory log (default: the next
        step): a step logged already is answered from the log without running
        (``TrajectoryLogs.run``). A command the OOM killer struck is ``oom_killed``."""
        sb = self.host.sandbox(sid)
        merged = {**sb.rt.spec.env, **(env or {})} or None
        cwd = cwd or sb.rt.spec.workdir or "/"

        async def run() -> ExecResult:
            result = await self.agent(sid).exec(
                cmd,
                timeout=timeout,
                cwd=cwd,
                env=merged,
                stdin=stdin,
                max_output=max_output,
                background=background,
                exclusive=exclusive,
            )
            if result.exit_code != 0 or result.timed_out:
                result = self.note_oom(sb, result)
            return result

        if trajectory is None:
            if step is not None:
                raise InvalidSpec("step needs a trajectory", field="step")
            return await run()
        command = cmd if isinstance(cmd, str) else shlex.join(cmd)
        return await self.host.trajectories.run(trajectory, step, sid, command, run)

    def exec_stream(
        self,
        sid: str,
        cmd: str | Sequence[str],
        *,
        timeout: float | None = None,
        cwd: str | None = None,
        env: dict[str, str] | None = None,
        stdin: bytes | None = None,
        max_output: int = 1 << 20,
        background: bool = False,
        exclusive: bool = False,
    ) -> AsyncIterator[tuple[str, bytes] | ExecResult]:
        """``exec`` with the output as it comes (``AgentClient.exec_stream``): a sandbox that
        is not there or not running is refused now; what goes wrong later ends the stream."""
        sb = self.host.sandbox(sid)
        agent = self.agent(sid)
        merged = {**sb.rt.spec.env, **(env or {})} or None
        cwd = cwd or sb.rt.spec.workdir or "/"

        async def run() -> AsyncIterator[tuple[str, bytes] | ExecResult]:
            stream = agent.exec_stream(
                cmd,
                timeout=timeout,
                cwd=cwd,
                env=merged,
                stdin=stdin,
                max_output=max_output,
                background=background,
                exclusive=exclusive,
            )
            try:
                async for item in stream:
                    if isinstance(item, ExecResult) and (item.exit_code != 0 or item.timed_out):
                        item = self.note_oom(sb, item)
                    yield item
            finally:
                await stream.aclose()  # type: ignore[attr-defined]

        return run()

    def note_oom(self, sb: Sandbox, result: ExecResult) -> ExecResult:
        """``result`` marked ``oom_killed`` if the sandbox's OOM kills grew while it ran (an
        infra event is recorded then)."""
        if Feature.CGROUPS not in sb.backend.features:
            return result
        kills = sb.backend.usage(sb.rt, sb.backend_state).oom_kills
        if kills is None or kills <= sb.oom_kills:
            return result
        sb.oom_kills = kills
        self.host.record_event(
            InfraEvent(
                "out_of_memory",
                sb.rt.id,
                time.time(),
                f"the OOM killer struck while {result.command or 'a command'} ran "
                f"(memory limit {sb.rt.limits.memory} bytes)",
            )
        )
        return replace(result, oom_killed=True)

    async def session_open(
        self, sid: str, cwd: str | None = None, env: dict[str, str] | None = None
    ) -> str:
        sb = self.host.sandbox(sid)
        return await self.agent(sid).session_open(
            cwd=cwd or sb.rt.spec.workdir or "/", env={**sb.rt.spec.env, **(env or {})} or None
        )
