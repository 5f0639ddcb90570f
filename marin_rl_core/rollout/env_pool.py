"""Envs in processes of their own (``episodes.env_processes > 0``).

:class:`EnvProcessPool` builds a lesson's env in each of ``n`` child processes and stands in for
it as a :class:`~marin_rl_core.protocols.MultiTurnEnv`: problems are posed by the first process,
and each episode lives in one process (the episodes of one problem in the same one, problems
round robin), its ``step`` an ``async`` round trip. So an
env that crashes (a segfault in a native library, ``os._exit``), hangs, or burns CPU cannot take
the rollout worker down or hold its generation up:

* a process that dies fails the episodes it held (counted as env errors) and is started again
  for the episodes that follow (``restarts`` counts it);
* a step the runner cuts off (``episodes.step_timeout_s``) kills its process, which may be stuck
  in it, and fails that process's other episodes; the process is started again.

Messages go over a ``multiprocessing`` pipe to a child this process started (the standard
library's pickling), never over the network or through storage. The child is started with
``spawn`` (a fresh interpreter, no JAX state inherited) and imports the env's ``build`` and
config class by name, so both must be importable module-level objects.

An :class:`~marin_rl_core.protocols.AgentEnv` in a pool runs its programs there: the pool is an
agent env whose ``run_agent`` (and ``score``) run in the problem's process, every episode a
process holds at once (``async`` ones on its event loop, plain ones on threads). Their
``openai`` clients then spend the processes' CPU and hold no lock the worker's generation
thread needs; each talks to the worker's endpoint over loopback as before. An agent that ends
the process (``os._exit``, a segfault) fails the episodes running there; one that outlives
``episodes.episode_timeout_s`` is cancelled there (a plain one's thread is left to end on its
own, its calls refused).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import logging
import multiprocessing
import os
import threading
from collections.abc import Callable
from typing import Any

from marin_rl_core.types import Action, Problem, Step

logger = logging.getLogger(__name__)


class EnvProcessDied(RuntimeError):
    """The env process holding an episode died or was killed."""


def _failure(exc: BaseException) -> str:
    """An exception as the rollout worker sees it: its type, message and where it was raised
    (the innermost frame: the env's or agent's own line)."""
    import traceback

    frames = traceback.extract_tb(exc.__traceback__)
    where = f" ({os.path.basename(frames[-1].filename)}:{frames[-1].lineno})" if frames else ""
    return f"{type(exc).__name__}: {exc}{where}"


class _ChildAgents:
    """An agent env's programs in an env process: every episode the process holds at once, an
    ``async`` ``run_agent`` as a task on the process's event loop (a thread of its own), a plain
    one on a thread; each answers its call when it ends. ``send`` sends an answer."""

    def __init__(self, send: Callable[[tuple[int, bool, Any]], None]):
        from marin_rl_core.rollout.env_threads import DaemonThreadPool

        self.send = send
        self.loop = asyncio.new_event_loop()
        self.tasks: dict[int, asyncio.Task[Any]] = {}
        self.threads = DaemonThreadPool("marinrl-agents", 4096)
        threading.Thread(
            target=self.loop.run_forever, name="marinrl-agent-loop", daemon=True
        ).start()

    def start(self, call_id: int, episode_id: int, fn: Callable[..., Any], *args: Any) -> None:
        """Run ``fn(*args)`` (``run_agent`` or ``score``) as episode ``episode_id``'s task."""

        def create() -> None:
            task = self.loop.create_task(self._answer(call_id, fn, args))
            self.tasks[episode_id] = task
            task.add_done_callback(lambda _: self.tasks.pop(episode_id, None))

        self.loop.call_soon_threadsafe(create)

    def cancel(self, episode_id: int) -> None:
        """The rollout worker gave up on the episode (its time ran out): cancel an ``async``
        agent; a plain one's thread is left to end on its own (its calls are refused)."""

        def cancel() -> None:
            task = self.tasks.get(episode_id)
            if task is not None:
                task.cancel()

        self.loop.call_soon_threadsafe(cancel)

    async def _answer(self, call_id: int, fn: Callable[..., Any], args: tuple[Any, ...]) -> None:
        import inspect

        try:
            if inspect.iscoroutinefunction(fn):
                result = await fn(*args)
            else:
                result = await self.threads.call(fn, *args)
            if inspect.isawaitable(result):
                result = await result
        except asyncio.CancelledError:
            self.send((call_id, False, "the episode was cancelled"))
        except Exception as exc:  # noqa: BLE001 - sent back: it fails that episode only
            self.send((call_id, False, _failure(exc)))
        else:
            self.send((call_id, True, result))


def _serve(conn: Any, build: Callable[[Any], Any], config: Any) -> None:
    """The child's loop: build the env, then answer one request at a time (an agent env's
    programs run beside it, see :class:`_ChildAgents`)."""
    import inspect

    from marin_rl_core.rollout.episode_state import SingleTurnEpisodes, as_multi_turn

    try:
        env = as_multi_turn(build(config))
    except Exception as exc:  # noqa: BLE001 - every call answers with it: the worker says why
        failed = f"building the env in its process failed: {_failure(exc)}"
        while True:
            try:
                call_id, _, _ = conn.recv()
            except (EOFError, OSError):
                return
            conn.send((call_id, False, failed))
    episodes: dict[int, Any] = {}
    agents: _ChildAgents | None = None
    sending = threading.Lock()

    def send(answer: tuple[int, bool, Any]) -> None:
        with sending:
            try:
                conn.send(answer)
            except (EOFError, OSError):  # the rollout worker is gone
                pass
            except Exception as exc:  # noqa: BLE001 - a result that does not pickle
                why = f"{type(exc).__name__}: {exc}"
                conn.send((answer[0], False, f"its result must pickle to leave the process: {why}"))

    while True:
        try:
            request = conn.recv()
        except (EOFError, OSError):
            return
        call_id, op, args = request
        try:
            if op in ("run_agent", "score_agent"):
                if agents is None:
                    agents = _ChildAgents(send)
                episode_id, *rest = args
                fn = env.run_agent if op == "run_agent" else env.score
                agents.start(call_id, episode_id, fn, *rest)
                continue  # answered when it ends
            if op == "cancel_agent":
                if agents is not None:
                    agents.cancel(args[0])
                continue
            if op == "sample_problems":
                n, mode, seed = args
                result: Any = env.sample_problems(n, mode=mode, seed=seed)
            elif op == "reset":
                episode_id, problem = args
                episodes[episode_id] = env.reset(problem)
                result = None
            elif op == "step":
                episode_id, action = args
                result = episodes[episode_id].step(action)
                if inspect.isawaitable(result):
                    result = asyncio.run(_await(result))
            elif op == "describe":
                result = {
                    "single_turn": isinstance(env, SingleTurnEpisodes),
                    "agent": callable(getattr(env, "run_agent", None)),
                    "score": callable(getattr(env, "score", None)),
                }
            elif op == "close":
                episode = episodes.pop(args[0], None)
                close = getattr(env, "close", None)
                if close is not None and episode is not None:
                    close(episode)
                result = None
            else:
                raise ValueError(f"unknown request {op!r}")
            send((call_id, True, result))
        except Exception as exc:  # noqa: BLE001 - sent back, raised in the rollout worker
            send((call_id, False, f"{type(exc).__name__}: {exc}"))


async def _await(awaitable: Any) -> Any:
    return await awaitable


class _EnvProcess:
    """One child process and the thread that reads its answers."""

    def __init__(self, index: int, build: Callable[[Any], Any], config: Any):
        context = multiprocessing.get_context("spawn")
        self.index = index
        self.conn, child = context.Pipe()
        self.process = context.Process(
            target=_serve, args=(child, build, config), name=f"marinrl-env-{index}", daemon=True
        )
        self.process.start()
        child.close()
        self.pending: dict[int, concurrent.futures.Future[Any]] = {}
        self.lock = threading.Lock()
        self.dead = False
        self.reader = threading.Thread(
            target=self._read, name=f"marinrl-env-{index}-reader", daemon=True
        )
        self.reader.start()

    def _read(self) -> None:
        while True:
            try:
                call_id, ok, payload = self.conn.recv()
            except (EOFError, OSError):
                break
            with self.lock:
                future = self.pending.pop(call_id, None)
            if future is not None and not future.done():  # done: cancelled, nobody waits
                if ok:
                    future.set_result(payload)
                else:
                    future.set_exception(RuntimeError(payload))
        self._fail_all(f"env process {self.index} (pid {self.process.pid}) died")

    def _fail_all(self, why: str) -> None:
        with self.lock:
            self.dead = True
            pending, self.pending = self.pending, {}
        for future in pending.values():
            if not future.done():
                future.set_exception(EnvProcessDied(why))

    def call(self, call_id: int, op: str, *args: Any) -> concurrent.futures.Future[Any]:
        future: concurrent.futures.Future[Any] = concurrent.futures.Future()
        with self.lock:
            if self.dead:
                future.set_exception(EnvProcessDied(f"env process {self.index} is gone"))
                return future
            self.pending[call_id] = future
        try:
            self.conn.send((call_id, op, args))
        except (OSError, ValueError) as exc:
            # A broken pipe: the process died before its reader thread saw the pipe close.
            self._fail_all(f"env process {self.index} (pid {self.process.pid}) died ({exc})")
        return future

    def kill(self, why: str = "") -> None:
        """Stop the process if it still runs, and fail the calls it held. A process that had
        already exited (found dead before its reader saw the pipe close) failed them by dying:
        they say so, with ``why`` (its exit code), not that it was stopped."""
        exited = not self.process.is_alive()
        if not exited:
            self.process.kill()
        self.process.join(timeout=5)
        self.conn.close()
        if exited:
            self._fail_all(
                f"env process {self.index} (pid {self.process.pid}) died"
                + (f" ({why})" if why else "")
            )
        else:
            self._fail_all(f"env process {self.index} was stopped")


class _RemoteEpisode:
    def __init__(self, pool: EnvProcessPool, process: _EnvProcess, episode_id: int):
        self.pool, self.process, self.episode_id = pool, process, episode_id

    async def step(self, action: Action) -> Step:
        future = self.pool._call(self.process, "step", self.episode_id, action)
        try:
            return await asyncio.wrap_future(future)
        except asyncio.CancelledError:
            # Cut off by a timeout: the process may be stuck in this step. Replace it.
            self.pool.replace(self.process, why="a step was cut off")
            raise


class EnvProcessPool:
    """A :class:`~marin_rl_core.protocols.MultiTurnEnv` whose env runs in ``n`` child
    processes; see the module docstring.

    Args:
        build: the env plugin's ``build``.
        config: the env config to build it with.
        n: processes.
        name: for logs.
        timeout: the longest ``sample_problems``, ``reset`` or ``close`` may take.
    """

    def __init__(
        self, build: Callable[[Any], Any], config: Any, n: int, *, name: str, timeout: float = 120.0
    ):
        if n < 1:
            raise ValueError(f"an env process pool needs at least one process, got {n}")
        self.build, self.config, self.name, self.timeout = build, config, name, timeout
        self._ids = itertools.count()
        self._lock = threading.Lock()
        self.processes = [_EnvProcess(i, build, config) for i in range(n)]
        self._next = itertools.cycle(range(n))
        self._assigned: dict[str, int] = {}
        self.restarts = 0
        # Every process built its env before the first batch: its episodes' time limits do not
        # pay for a process starting.
        ready = [self._call(process, "describe") for process in self.processes]
        try:
            described = ready[0].result(timeout)
            for other in ready[1:]:
                other.result(timeout)
        except BaseException:  # an env that cannot be built (its error says why), or no answer
            self.shutdown()
            raise
        self.single_turn: bool = bool(described["single_turn"])
        """Whether the env in the processes is a single-turn env (``score``)."""
        self.agent: bool = bool(described["agent"])
        """Whether it is an :class:`~marin_rl_core.protocols.AgentEnv`: then the pool is one too,
        its programs (and ``score``, if the env has one) run in the processes."""
        if self.agent:
            self.run_agent = self._run_agent
            if described["score"]:
                self.score = self._score

    def _call(self, process: _EnvProcess, op: str, *args: Any) -> concurrent.futures.Future[Any]:
        return process.call(next(self._ids), op, *args)

    def _live(self, index: int) -> _EnvProcess:
        """Process ``index``, started again first if it died."""
        with self._lock:
            process = self.processes[index]
            if process.dead or not process.process.is_alive():
                # Its pipe may close before the process is reaped: give the exit code a moment.
                process.process.join(timeout=2)
                self._restart(index, why=f"exit code {process.process.exitcode}")
            return self.processes[index]

    def _restart(self, index: int, *, why: str) -> None:
        old = self.processes[index]
        old.kill(why)
        self.restarts += 1
        logger.warning(
            "env %s: process %d (pid %s) is replaced (%s); its episodes failed",
            self.name,
            index,
            old.process.pid,
            why,
        )
        self.processes[index] = _EnvProcess(index, self.build, self.config)

    def replace(self, process: _EnvProcess, *, why: str) -> None:
        with self._lock:
            if self.processes[process.index] is process:
                self._restart(process.index, why=why)

    def sample_problems(self, n: int, *, mode: Any, seed: int) -> list[Problem]:
        process = self._live(0)
        try:
            return self._call(process, "sample_problems", n, mode, seed).result(self.timeout)
        except concurrent.futures.TimeoutError:
            # The process may be stuck in it: every later call would wait behind it.
            self.replace(process, why=f"sample_problems did not return within {self.timeout:g} s")
            raise TimeoutError(
                f"env {self.name}: sample_problems did not return within {self.timeout:g} s; "
                "its process was replaced"
            ) from None

    def _process_of(self, problem: Problem) -> _EnvProcess:
        # The episodes of one problem share a process: a crash then fails few groups (a group
        # with a failed episode is dropped whole).
        if problem.id not in self._assigned:
            if len(self._assigned) > 100_000:
                self._assigned.clear()
            self._assigned[problem.id] = next(self._next)
        return self._live(self._assigned[problem.id])

    async def _in_process(self, op: str, problem: Problem, *args: Any) -> Any:
        """An agent env's ``op`` (``run_agent``, ``score_agent``) for one episode, in the
        problem's process; cancelled (the episode's time ran out, its batch was cancelled), it
        is cancelled there too."""
        process = self._process_of(problem)
        episode_id = next(self._ids)
        future = self._call(process, op, episode_id, problem, *args)
        try:
            return await asyncio.wrap_future(future)
        except asyncio.CancelledError:
            if not process.dead:
                self._call(process, "cancel_agent", episode_id)
            raise
        except RuntimeError as exc:  # the program's error there, or its process died
            from marin_rl_core.rollout.episode_state import EpisodeFailure

            where = f"in env process {process.index} (pid {process.process.pid})"
            raise EpisodeFailure("error", f"{exc} [{where}]") from exc

    async def _run_agent(self, problem: Problem, endpoint: Any) -> Any:
        """``run_agent`` of an agent env (see :attr:`agent`): the program runs in a process of
        the pool, concurrently with the others there; its result comes back (pickled over the
        pipe: it must pickle). An :class:`~marin_rl_core.types.AgentCommand` it returns is
        started by the rollout worker, as always."""
        return await self._in_process("run_agent", problem, endpoint)

    async def _score(self, problem: Problem, result: Any) -> Any:
        return await self._in_process("score_agent", problem, result)

    async def reset(self, problem: Problem) -> _RemoteEpisode:
        process = self._process_of(problem)
        episode_id = next(self._ids)
        try:
            await asyncio.wrap_future(self._call(process, "reset", episode_id, problem))
        except asyncio.CancelledError:
            # Cut off by a timeout, like a step: the process may be stuck in it. Replace it.
            self.replace(process, why="a reset was cut off")
            raise
        return _RemoteEpisode(self, process, episode_id)

    def close(self, episode: _RemoteEpisode) -> None:
        if not episode.process.dead:
            self._call(episode.process, "close", episode.episode_id)

    def shutdown(self) -> None:
        for process in self.processes:
            process.kill()

    @property
    def pids(self) -> list[int | None]:
        return [p.process.pid for p in self.processes]


__all__ = ["EnvProcessDied", "EnvProcessPool"]
