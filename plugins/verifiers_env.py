"""The ``verifiers`` env: an environment of the ``verifiers`` package (0.4.0, its ``verifiers.v1``
API) run as a marinrl agent env, its rubric as the reward.

``pip install 'marin-rl[verifiers]'``, then name a taskset by its id, the module name
verifiers imports it by (an environment from the hub: install its package, then name it)::

    marinrl run --model ./my-qwen3 --env verifiers --set env.taskset=my_taskset

* problems are the taskset's tasks by index (``Problem.id`` ``t<index>``, or ``e<index>`` for a
  task of ``eval_taskset``), so ids are stable across runs and workers;
* each episode is verifiers' own ``Env.run_episode`` of its task: the taskset's env (a plain
  taskset's single agent, or the ``Env`` class the taskset exports) plays it with the harness
  ``harness`` against the episode's own marinrl endpoint, and verifiers scores the trace with the
  task's ``@vf.reward`` functions;
* the reward is the trace's reward (the weighted sum of its rewards), and each reward and
  ``@vf.metric`` is a metric, logged as ``rollout/score/<name>``.

The default harness, ``marinrl_chat``, is marinrl's: it runs in the rollout worker's event loop
with ``openai.AsyncOpenAI`` and sends the task's conversation as one chat completion per segment
(an env that converses, with ``agents.agent.interaction(task)``, gets one per turn). verifiers'
own chat harnesses (``null``, ``bash`` ...) start a program through ``uv``, which downloads
packages when it first runs: name one with ``harness`` only where that is acceptable.

Without a ``taskset``, a built-in taskset (``marinrl_addition``: single-digit sums, reward
``correct``) is used, so ``marinrl run --env verifiers`` works with nothing else installed.
"""

from __future__ import annotations

import asyncio
import copy
import functools
import math
import sys
import types
import weakref
from collections.abc import Mapping
from typing import Any

import attrs

from marin_rl_core import AgentClients, AgentEndpoint, EnvPlugin, Problem, Score, hookimpl

INSTALL_HINT = "the verifiers env needs the verifiers package: pip install 'marin-rl[verifiers]'"
HARNESS_ID = "marinrl_chat"
DEFAULT_TASKSET = "marinrl_addition"
RESERVED_METRICS = ("reward", "n")
# verifiers reads its upstream API key from an environment variable named in the client config,
# once per episode's client. Many episodes run at once in one worker, so no per-episode value
# can go in one process-wide variable. marinrl's endpoint attributes a call by its URL path
# (/e/KEY/v1) before looking at the key, so each episode's client config carries its own
# base_url and this variable, never set, makes verifiers send the constant key "EMPTY".
KEY_VARIABLE = "MARINRL_VERIFIERS_UNUSED_KEY"


@attrs.frozen(kw_only=True)
class VerifiersEnvConfig:
    """Args:
    taskset: the verifiers taskset's id: the top-level module that exports its ``Taskset``
        subclass in ``__all__`` (a hub environment's installed package name).
    taskset_config: the taskset's config keys (its ``TasksetConfig`` fields), as a table.
    env_config: further keys of verifiers' env config (``timeout``, an agent seat's
        ``max_turns`` as ``{"agent": {"max_turns": 4}}``, ...).
    harness: the harness id each agent seat runs: ``marinrl_chat`` (in process, no tools) or
        any verifiers harness id.
    eval_fraction: the share of ``taskset``'s tasks held out for eval (none when 0: eval then
        draws from the training tasks); unused with ``eval_taskset``.
    eval_taskset: a taskset id whose tasks are the eval problems instead.
    eval_taskset_config: ``eval_taskset``'s config keys.
    """

    taskset: str = DEFAULT_TASKSET
    taskset_config: Mapping[str, Any] = attrs.field(factory=dict)
    env_config: Mapping[str, Any] = attrs.field(factory=dict)
    harness: str = HARNESS_ID
    eval_fraction: float = attrs.field(
        default=0.1, validator=[attrs.validators.ge(0.0), attrs.validators.lt(1.0)]
    )
    eval_taskset: str = ""
    eval_taskset_config: Mapping[str, Any] = attrs.field(factory=dict)


def _import_verifiers() -> Any:
    try:
        import verifiers.v1 as vf
    except ImportError as exc:
        raise ValueError(f"{INSTALL_HINT} ({exc})") from exc
    _register_builtins(vf)
    return vf


@functools.cache
def _register_builtins(vf: Any) -> None:
    """Make ``marinrl_chat`` and ``marinrl_addition`` importable by id: verifiers loads a harness
    or taskset by importing a top-level module that exports its class in ``__all__``, and this
    module cannot define classes that subclass verifiers' at import (it must import fast)."""
    from verifiers.v1.runtimes import ProgramResult

    # An async client's connections belong to the event loop that opened them: one set of
    # clients per loop (a worker has one; a process that runs several managers has more).
    clients: weakref.WeakKeyDictionary[Any, AgentClients] = weakref.WeakKeyDictionary()

    class MarinrlChatHarnessConfig(vf.HarnessConfig):
        pass

    class MarinrlChatHarness(vf.Harness[MarinrlChatHarnessConfig]):
        """The conversation so far as one chat completion, in the rollout worker's event loop,
        through verifiers' interception server (which records the trace)."""

        APPENDS_SYSTEM_PROMPT = True
        SUPPORTS_RESUME = True
        EXECUTES_CODE = False
        NEEDS_CONTAINER = False

        async def launch(self, ctx, trace, runtime, endpoint, secret, mcp_urls, data, **_):
            system, prompt = self.resolve_prompt(data)
            messages = [{"role": "system", "content": system}] if system else []
            if isinstance(prompt, str):
                messages.append({"role": "user", "content": prompt})
            else:
                messages += [m.model_dump(exclude_none=True) for m in prompt or []]
            pool = clients.setdefault(asyncio.get_running_loop(), AgentClients())
            client = pool.asynchronous(AgentEndpoint(base_url=endpoint, api_key=secret))
            await client.chat.completions.create(model=ctx.model, messages=messages)
            return ProgramResult(exit_code=0, stdout="", stderr="")

    class AdditionData(vf.TaskData):
        answer: str

    class AdditionTask(vf.Task[AdditionData]):
        @vf.reward(weight=1.0)
        async def correct(self, trace) -> float:
            return float(trace.last_reply.strip() == self.data.answer)

    class AdditionTaskset(vf.Taskset[AdditionTask, vf.TasksetConfig]):
        def load(self):
            return [
                AdditionTask(AdditionData(prompt=f"{a}+{b}=", answer=str(a + b)), self.config.task)
                for a in range(10)
                for b in range(10)
            ]

    for name, cls in ((HARNESS_ID, MarinrlChatHarness), (DEFAULT_TASKSET, AdditionTaskset)):
        module = types.ModuleType(name, cls.__doc__)
        cls.__module__ = name
        setattr(module, cls.__name__, cls)
        module.__all__ = [cls.__name__]
        sys.modules.setdefault(name, module)
    harness_module = sys.modules[HARNESS_ID]
    harness_module.MarinrlChatHarnessConfig = MarinrlChatHarnessConfig
    MarinrlChatHarnessConfig.__module__ = HARNESS_ID


def _seat_names(config_class: Any, vf: Any) -> list[str]:
    """The env config's agent seats (``agent`` for a plain taskset)."""
    return [
        name
        for name, field in config_class.model_fields.items()
        if isinstance(field.annotation, type) and issubclass(field.annotation, vf.AgentConfig)
    ]


def load_env(
    vf: Any, taskset: str, taskset_config: Mapping, config: VerifiersEnvConfig, key: str
) -> tuple[Any, list[Any]]:
    """verifiers' env for ``taskset`` (every seat on ``config.harness`` in the local runtime)
    and its tasks; ``key`` names the config key in errors."""
    data = copy.deepcopy(dict(config.env_config))
    data["taskset"] = {**copy.deepcopy(dict(taskset_config)), "id": taskset}
    try:
        config_class = vf.env_config_type(taskset, str(data.get("id") or ""))
        for seat in _seat_names(config_class, vf):
            spec = dict(data.get(seat) or {})
            spec.setdefault("harness", {"id": config.harness})
            spec.setdefault("runtime", {"type": "subprocess"})
            data[seat] = spec
        env = vf.load_environment(vf.resolve_env_config(data))
    except ModuleNotFoundError as exc:
        raise ValueError(
            f"env.{key}: verifiers cannot import the taskset {taskset!r} ({exc}). A taskset id "
            "is the top-level module that exports its Taskset subclass in __all__: install the "
            "package that provides it (a hub environment: pip install its package) or put its "
            f"module on PYTHONPATH, then set env.{key} to the module's name"
        ) from exc
    except Exception as exc:  # pydantic's ValidationError and the taskset's own errors
        raise ValueError(
            f"env.{key}: verifiers cannot load the taskset {taskset!r} with "
            f"env.{key}_config={dict(taskset_config)!r} and env.env_config="
            f"{dict(config.env_config)!r}: {type(exc).__name__}: {exc}"
        ) from exc
    tasks = list(env.taskset)
    if not tasks:
        raise ValueError(
            f"env.{key}: the verifiers taskset {taskset!r} has no tasks (with env.{key}_config="
            f"{dict(taskset_config)!r}); give it a config under which it loads some"
        )
    return env, tasks


class VerifiersEnv:
    """Implements :class:`marin_rl_core.AgentEnv`; see the module docstring."""

    def __init__(self, config: VerifiersEnvConfig):
        self.config = config
        self._vf = vf = _import_verifiers()
        self._env, self._tasks = load_env(
            vf, config.taskset, config.taskset_config, config, "taskset"
        )
        indices = list(range(len(self._tasks)))
        if config.eval_taskset:
            self._eval_env, self._eval_tasks = load_env(
                vf, config.eval_taskset, config.eval_taskset_config, config, "eval_taskset"
            )
            self._pools = {"train": indices, "eval": list(range(len(self._eval_tasks)))}
        else:
            held = _held_out(len(indices), config.eval_fraction)
            train = [i for i in indices if i not in held] or indices
            self._pools = {"train": train, "eval": sorted(held) or train}

    def sample_problems(self, n: int, *, mode: str, seed: int) -> list[Problem]:
        import numpy as np

        pool = self._pools["eval" if mode == "eval" else "train"]
        rng = np.random.default_rng(seed)
        picks = rng.choice(len(pool), size=n, replace=n > len(pool))
        from_eval = mode == "eval" and bool(self.config.eval_taskset)
        tasks = self._eval_tasks if from_eval else self._tasks
        problems = []
        for pick in picks:
            index = pool[int(pick)]
            prompt = tasks[index].data.prompt_text or f"task {index}"
            problems.append(
                Problem(
                    id=f"{'e' if from_eval else 't'}{index}",
                    prompt=prompt,
                    info={"index": index, "eval_taskset": from_eval},
                )
            )
        return problems

    async def run_agent(self, problem: Problem, endpoint: AgentEndpoint) -> Score:
        vf = self._vf
        from_eval = bool(problem.info["eval_taskset"])
        env = self._eval_env if from_eval else self._env
        task = (self._eval_tasks if from_eval else self._tasks)[int(problem.info["index"])]
        ctx = vf.ModelContext(
            model=endpoint.model,
            client=vf.EvalClientConfig(base_url=endpoint.base_url, api_key_var=KEY_VARIABLE),
            sampling=vf.SamplingConfig(
                temperature=endpoint.temperature, max_tokens=endpoint.max_tokens
            ),
        )
        # Outside `env.serving()`, each rollout brings up verifiers' interception server of its
        # own and closes it, with the upstream client built from this episode's config; a
        # server shared by every episode would keep one client per episode's base URL.
        episode = await env.run_episode(task, ctx)
        traces = [t for t in episode.traces if t.agent.trainable] or list(episode.traces)
        if not episode.ok or not traces:
            errors = [e.message for e in episode.errors] + [
                e.message for t in episode.traces for e in t.errors
            ]
            raise RuntimeError(
                f"verifiers episode of task {problem.id} failed: "
                + ("; ".join(errors) or "it ran no agent")
            )
        return _score(traces)


def _held_out(n: int, fraction: float) -> set[int]:
    """``round(n * fraction)`` task indices, at least one and never all of them (none when
    ``fraction`` is 0 or there is one task), spread over the taskset by a fixed seed."""
    import numpy as np

    if fraction == 0 or n < 2:
        return set()
    k = min(max(1, math.floor(n * fraction + 0.5)), n - 1)
    return {int(i) for i in np.random.default_rng(0).permutation(n)[:k]}


def _score(traces: list[Any]) -> Score:
    """The traces' mean reward; each reward and metric averaged over them."""
    values: dict[str, list[float]] = {}
    for trace in traces:
        named = {name: r.value for name, r in trace.rewards.items() if r is not None}
        named.update({name: v for name, v in trace.metrics.items() if v is not None})
        for name, value in named.items():
            name = f"vf_{name}" if name in RESERVED_METRICS else name
            values.setdefault(name, []).append(float(value))
    reward = sum(float(t.reward) for t in traces) / len(traces)
    return Score(reward, {name: sum(v) / len(v) for name, v in values.items()})


@hookimpl
def marinrl_register_envs():
    yield EnvPlugin(
        name="verifiers",
        summary="Agent: an environment of the verifiers package, its rubric as the reward.",
        config_class=VerifiersEnvConfig,
        build=VerifiersEnv,
    )
