"""The batch runner: N episodes with at most ``concurrency`` running at once, infrastructure
failures masked and retried in fresh sandboxes, optional fork trees, a progress bar, results as
JSON lines, and a ``RolloutReport`` at the end.

One loop serves both client twins. With an ``AsyncClient`` everything is awaited; with a
blocking ``Client`` (``run``) the same loop runs on an event loop of its own and does each
blocking call (a ``SandboxEnv``'s step, a plain policy, a catalog task's operation) in a thread
of a pool as wide as ``concurrency``, so a blocking client is as parallel as an async one.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import inspect
import os
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import IO, Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from ..errors import InvalidSpec
from ..records import InfraEvent
from ..rl.calls import adrive, drive
from ..rl.errors import InfraFailure
from ..rl.infra import infra_event
from .report import EpisodeResult, RolloutReport
from .tasks import Played, acatalog_tasks, catalog_tasks, resolve, task_episode

__all__ = ["arun", "run"]

#: ``episode(client, index) -> float | EpisodeResult``: one episode of a caller's own making (a
#: coroutine function with an ``AsyncClient``; a plain one runs in a thread).
EpisodeFn = Callable[[Any, int], Any]
#: ``env_factory(index) -> (env, policy)``: a fresh ``SandboxEnv`` or ``AsyncSandboxEnv`` and
#: ``policy(observation, info) -> action`` (plain or async) for each attempt of episode
#: ``index``.
EnvFactory = Callable[[int], Any]


def _positive(name: str, value: Any, least: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise InvalidSpec(f"{name} must be an integer, {least} or more, got {value!r}", field=name)
    return value


@dataclass
class _Forked:
    """A fork tree's trunk after ``fork_at`` steps: its branches, not yet started, and where
    it stood for the policy."""

    branches: list[Any]
    policy: Any
    observation: str
    info: dict[str, Any]
    parent: str | None
    reward: float
    steps: int


@dataclass
class _Tries:
    """How an episode's attempts went."""

    outcome: Played | _Forked | EpisodeResult | None = None
    attempts: int = 0
    sandboxes: list[str] = field(default_factory=list)
    event: InfraEvent | None = None
    error: BaseException | None = None


class _Runner:
    def __init__(
        self,
        client: Any,
        *,
        episodes: int,
        tasks: list[Any] | None,
        env_factory: EnvFactory | None,
        episode: EpisodeFn | None,
        concurrency: int,
        retries: int,
        fork_at: int | None,
        n: int,
        seed: int | None,
        files: Mapping[str, Mapping[str, str | bytes]],
        sink: IO[str] | None,
        bar: Progress | None,
    ) -> None:
        self.client = client
        self.blocking = not inspect.iscoroutinefunction(getattr(client, "exec", None))
        self.episodes, self.tasks = episodes, tasks
        self.env_factory, self.episode_fn = env_factory, episode
        self.retries, self.fork_at, self.n, self.seed = retries, fork_at, n, seed
        self.files = files
        self.slots = asyncio.Semaphore(concurrency)
        self.pool = concurrent.futures.ThreadPoolExecutor(
            max_workers=concurrency, thread_name_prefix="dsec-rollout"
        )
        self.sink, self.bar = sink, bar
        self.bar_task = None
        self.results: list[EpisodeResult] = []
        if bar is not None:
            per = n if fork_at is not None else 1
            self.bar_task = bar.add_task("rollout", total=episodes * per, stats="")

    # --- calling what may block -----------------------------------------------------------
    async def call(self, fn: Callable[..., Any], *args: Any, **kw: Any) -> Any:
        """``fn(*args, **kw)``: awaited if it is a coroutine function, else in a thread of the
        pool (its result awaited if it gives an awaitable)."""
        if inspect.iscoroutinefunction(fn):
            return await fn(*args, **kw)
        loop = asyncio.get_running_loop()
        out = await loop.run_in_executor(self.pool, lambda: fn(*args, **kw))
        return await out if inspect.isawaitable(out) else out

    # --- the episodes --------------------------------------------------------------------
    def task_name(self, index: int) -> str:
        if self.tasks is not None:
            return str(self.tasks[index % len(self.tasks)].name)
        fn = self.episode_fn or self.env_factory
        return getattr(fn, "__name__", "episode")

    async def all(self) -> None:
        try:
            await asyncio.gather(*(self.tree(i) for i in range(self.episodes)))
        finally:
            self.pool.shutdown(wait=False, cancel_futures=True)

    async def tree(self, index: int) -> None:
        """Episode ``index``: its attempts, then (a fork tree) each branch's."""
        started = time.monotonic()
        tries = await self.attempts(lambda attempt, trace: self.play(index, attempt, trace))
        if not isinstance(tries.outcome, _Forked):
            if self.fork_at is not None and self.bar is not None and self.bar_task is not None:
                # one result where n branches were counted: it ended (or failed) before its fork
                total = self.bar.tasks[0].total or 0
                self.bar.update(self.bar_task, total=total - (self.n - 1))
            self.finish(self.result(index, tries, started))
            return
        fork = tries.outcome
        try:
            await asyncio.gather(
                *(self.branch(index, fork, j, env, started) for j, env in enumerate(fork.branches))
            )
        finally:
            for env in fork.branches:
                with contextlib.suppress(Exception):
                    await self.call(env.close)

    async def branch(self, index: int, fork: _Forked, j: int, env: Any, started: float) -> None:
        async def play(attempt: int, trace: list[str]) -> Played:
            obs, info = await self.call(env.reset)
            self.mask(info)
            trace.append(env.sandbox_id)
            meta = {"episode": index, "branch": j, "attempt": attempt}
            info = {**fork.info, "sandbox_id": env.sandbox_id, **meta}
            reward, steps, *_ = await self.steps(env, fork.policy, fork.observation, info, meta)
            return Played(fork.reward + reward, steps=fork.steps + steps)

        tries = await self.attempts(play)
        self.finish(replace(self.result(index, tries, started), parent=fork.parent, branch=j))

    async def attempts(self, play: Callable[[int, list[str]], Any]) -> _Tries:
        """Up to 1 + ``retries`` attempts, each holding a slot: an infrastructure failure is
        retried (the next attempt makes a fresh sandbox), anything else fails the episode."""
        tries = _Tries()
        while True:
            tries.attempts += 1
            trace: list[str] = []
            try:
                async with self.slots:
                    tries.outcome = await play(tries.attempts, trace)
            except Exception as e:
                tries.sandboxes += [s for s in trace if s]
                event = infra_event(e)
                if event is None:
                    tries.error = e
                    return tries
                tries.event = event
                if tries.attempts > self.retries:
                    return tries
                continue
            tries.sandboxes += [s for s in trace if s]
            return tries

    async def play(self, index: int, attempt: int, trace: list[str]) -> Any:
        if self.tasks is not None:
            task = self.tasks[index % len(self.tasks)]
            op = task_episode(task, self.files.get(task.name), trace)
            if self.blocking:
                return await self.call(drive, self.client, op)
            return await adrive(self.client, op)
        if self.episode_fn is not None:
            got = await self.call(self.episode_fn, self.client, index)
            if isinstance(got, EpisodeResult):
                trace += got.sandboxes
                return got
            if isinstance(got, bool) or not isinstance(got, (int, float)):
                raise InvalidSpec(
                    f"an episode function returns a reward (a float) or an EpisodeResult, "
                    f"got {type(got).__name__}",
                    field="episode",
                )
            return Played(float(got))
        return await self.play_env(index, attempt, trace)

    async def play_env(self, index: int, attempt: int, trace: list[str]) -> Played | _Forked:
        assert self.env_factory is not None
        made = await self.call(self.env_factory, index)
        try:
            env, policy = made
        except (TypeError, ValueError):
            raise InvalidSpec(
                f"an env factory returns (env, policy), got {type(made).__name__}",
                field="env_factory",
            ) from None
        try:
            seed = None if self.seed is None else self.seed + index
            obs, info = await self.call(env.reset, seed=seed)
            self.mask(info)
            trace.append(env.sandbox_id)
            meta = {"episode": index, "branch": None, "attempt": attempt}
            info = {**info, **meta}
            reward, steps, obs, info, ended = await self.steps(
                env, policy, obs, info, meta, limit=self.fork_at
            )
            if ended or self.fork_at is None:
                return Played(reward, steps=steps)
            branches = await self.call(env.fork, self.n, start=False)
            return _Forked(branches, policy, obs, info, env.sandbox_id, reward, steps)
        finally:
            with contextlib.suppress(Exception):  # the branches go on from its snapshot
                await self.call(env.close)

    async def steps(
        self,
        env: Any,
        policy: Any,
        obs: str,
        info: dict[str, Any],
        meta: dict[str, Any],
        limit: int | None = None,
    ) -> tuple[float, int, str, dict[str, Any], bool]:
        """Step ``env`` with ``policy`` until the episode ends (or ``limit`` steps): the
        reward summed, the steps taken, the last observation and info, and whether it
        ended."""
        total, taken = 0.0, 0
        while limit is None or taken < limit:
            action = await self.call(policy, obs, info)
            obs, reward, terminated, truncated, info = await self.call(env.step, action)
            taken += 1
            self.mask(info)
            info = {**info, **meta}
            total += float(reward)
            if terminated or truncated:
                return total, taken, obs, info, True
        return total, taken, obs, info, False

    @staticmethod
    def mask(info: Mapping[str, Any]) -> None:
        """Raise ``InfraFailure`` if an env's ``info`` says its step was masked."""
        if info.get("masked") and isinstance(info.get("infra"), InfraEvent):
            raise InfraFailure(info["infra"])

    # --- results -------------------------------------------------------------------------
    def result(self, index: int, tries: _Tries, started: float) -> EpisodeResult:
        seconds = round(time.monotonic() - started, 3)
        common: dict[str, Any] = dict(
            index=index,
            task=self.task_name(index),
            attempts=tries.attempts,
            infra=tries.event.kind if tries.event is not None else None,
            duration=seconds,
            sandboxes=tuple(tries.sandboxes),
        )
        got = tries.outcome
        if isinstance(got, EpisodeResult):  # the caller's own: ours fill what it left out
            return replace(
                got,
                index=index,
                attempts=tries.attempts,
                duration=got.duration or seconds,
                infra=got.infra or common["infra"],
                task=got.task or common["task"],
                sandboxes=got.sandboxes or common["sandboxes"],
            )
        if isinstance(got, Played):
            return EpisodeResult(
                reward=got.reward,
                status="ok",
                steps=got.steps,
                outcome=got.outcome,
                timed_out=got.timed_out,
                backend=got.backend,
                verdicts=got.verdicts,
                **common,
            )
        if tries.error is not None:
            e = tries.error
            return EpisodeResult(
                reward=None,
                status="failed",
                error=str(e) or type(e).__name__,
                error_type=type(e).__name__,
                **common,
            )
        return EpisodeResult(reward=None, status="masked", **common)

    def finish(self, result: EpisodeResult) -> None:
        self.results.append(result)
        if self.sink is not None:
            self.sink.write(result.to_json() + "\n")
            self.sink.flush()
        if self.bar is not None and self.bar_task is not None:
            self.bar.update(self.bar_task, advance=1, stats=self.stats())

    def stats(self) -> str:
        count = {s: 0 for s in ("ok", "failed", "masked")}
        rewards = []
        for r in self.results:
            count[r.status] += 1
            if r.status == "ok" and r.reward is not None:
                rewards.append(r.reward)
        mean = f"{sum(rewards) / len(rewards):.3f}" if rewards else "-"
        return (
            f"ok {count['ok']}  [red]failed {count['failed']}[/red]  "
            f"[yellow]masked {count['masked']}[/yellow]  mean reward {mean}"
        )


async def arun(
    client: Any,
    episodes: int | None = None,
    *,
    tasks: Sequence[Any] | None = None,
    env_factory: EnvFactory | None = None,
    episode: EpisodeFn | None = None,
    concurrency: int = 8,
    retries: int = 2,
    fork_at: int | None = None,
    n: int = 1,
    out: str | os.PathLike[str] | None = None,
    progress: bool = True,
    seed: int | None = None,
    files: Mapping[str, Mapping[str, str | bytes]] | None = None,
    console: Console | None = None,
) -> RolloutReport:
    """Run ``episodes`` episodes on ``client`` (an ``AsyncClient``, or a ``Client``: its
    calls then go to threads), at most ``concurrency`` at once, and report them.

    The episodes come from one source: ``tasks`` (catalog ``Task`` records or names of the
    default catalog's tasks; episode ``i`` runs task ``i % len(tasks)``; ``files`` maps a
    task's name to files written into its sandbox first), ``env_factory`` (``index -> (env,
    policy)``: a ``SandboxEnv`` or ``AsyncSandboxEnv`` stepped by ``policy(observation, info)
    -> action`` until it ends; its reward is the sum of the steps'; ``info`` also holds
    ``episode``, ``branch`` and ``attempt``; ``seed + index`` seeds its reset), or ``episode``
    (``(client, index) -> reward or EpisodeResult``, plain or async). With none, the default
    catalog's tasks the node can serve, ``episodes`` defaulting to one each.

    An infrastructure failure (an error ``dsec.rl.infra_event`` types, an out-of-memory kill,
    an env's masked step, ``InfraFailure``) is retried up to ``retries`` times, each attempt in
    a fresh sandbox, then reported ``masked``, never scored; any other error is ``failed``.
    ``fork_at=k, n=m`` (env factories): each episode runs ``k`` steps, forks into ``m``
    branches (``env.fork(m, start=False)``: one ``pack_diff``, a restore per branch when it
    has a slot) and each branch finishes as a result of its own (``parent``, ``branch``); a
    branch's failure is retried from the fork point. ``out`` (a path) gets one JSON line per
    result as each finishes; ``progress`` shows a bar of episodes done, failed and masked and
    the mean reward so far, and prints the report's table at the end.
    """
    if sum(x is not None for x in (tasks, env_factory, episode)) > 1:
        raise InvalidSpec("give tasks, env_factory or episode, one of them", field="tasks")
    concurrency = _positive("concurrency", concurrency, 1)
    retries = _positive("retries", retries, 0)
    n = _positive("n", n, 1)
    if fork_at is not None:
        _positive("fork_at", fork_at, 0)
        if env_factory is None:
            raise InvalidSpec(
                "fork_at forks an env's episode: it needs env_factory", field="fork_at"
            )
    chosen: list[Any] | None = None
    if env_factory is None and episode is None:
        if tasks is None:
            if inspect.iscoroutinefunction(getattr(client, "exec", None)):
                chosen = await acatalog_tasks(client)
            else:
                chosen = await asyncio.to_thread(catalog_tasks, client)
        else:
            chosen = resolve(list(tasks))
        if not chosen:
            raise InvalidSpec("no tasks to run (the node can serve none of them)", field="tasks")
        if episodes is None:
            episodes = len(chosen)
    if episodes is None:
        raise InvalidSpec("how many episodes? give episodes=", field="episodes")
    episodes = _positive("episodes", episodes, 0)
    console = console or Console()
    sink = open(out, "w") if out is not None else None
    bar = None
    if progress:
        bar = Progress(
            TextColumn("{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("{task.fields[stats]}"),
            TimeElapsedColumn(),
            console=console,
        )
    runner = _Runner(
        client,
        episodes=episodes,
        tasks=chosen,
        env_factory=env_factory,
        episode=episode,
        concurrency=concurrency,
        retries=retries,
        fork_at=fork_at,
        n=n,
        seed=seed,
        files=files or {},
        sink=sink,
        bar=bar,
    )
    started = time.monotonic()
    try:
        if bar is not None:
            with bar:
                await runner.all()
        else:
            await runner.all()
    finally:
        if sink is not None:
            sink.close()
    report = RolloutReport(
        tuple(runner.results),
        time.monotonic() - started,
        None if out is None else os.fspath(out),
    )
    if progress:
        console.print(report.table())
    return report


def run(client: Any, episodes: int | None = None, **options: Any) -> RolloutReport:
    """``arun`` for a blocking ``Client`` (or an ``AsyncClient``), from code that is not in
    an event loop; from one that is (a notebook), the rollout runs on a loop in a thread of
    its own. Takes ``arun``'s arguments."""
    coro = arun(client, episodes, **options)
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro)
    box: dict[str, Any] = {}

    def in_thread() -> None:
        try:
            box["report"] = asyncio.run(coro)
        except BaseException as e:  # handed to the caller's thread
            box["error"] = e

    thread = threading.Thread(target=in_thread, name="dsec-rollout")
    thread.start()
    thread.join()
    if "error" in box:
        raise box["error"]
    return box["report"]
