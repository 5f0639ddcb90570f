"""Test helpers for plugin authors: an opt-in pytest plugin.

Enable it in your ``conftest.py``::

    pytest_plugins = ["marin_rl_core.testing"]

and use the ``plugin_registry`` fixture plus the contract checks::

    import my_plugin
    from marin_rl_core.testing import check_plugin

    def test_my_env_honours_the_contract(plugin_registry):
        registry = plugin_registry(my_plugin)  # only this plugin, no entry points
        check_plugin(registry.get("env", "my-env"))

The checks assert what marinrl relies on: the record's config class has defaults that structure
and unstructure through the run-config converter, ``build`` returns an object satisfying the
kind's protocol, and for envs, losses, curricula and engines a tiny call works.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from marin_rl_core import protocols
from marin_rl_core.config.converter import check_config_class

# The engine and storage contracts and tiny Hugging Face checkpoints, in modules of their own,
# re-exported.
from marin_rl_core.engine_contract import check_engine
from marin_rl_core.hookspecs import (
    CurriculumPlugin,
    EnvPlugin,
    LossPlugin,
    PluginRecord,
    RewardPlugin,
    WeightTransferPlugin,
)
from marin_rl_core.registry import Registry, build_registry
from marin_rl_core.storage_contract import check_storage
from marin_rl_core.tiny_checkpoints import (
    CHAT_TEMPLATES,
    as_transformers5_layout,
    tiny_chat_tokenizer,
    write_tiny_hf_checkpoint,
)
from marin_rl_core.types import (
    Action,
    LessonConfig,
    LessonDependency,
    LessonStats,
    Problem,
    RewardInput,
    Rollout,
    RolloutGroup,
    Score,
    Step,
)


@pytest.fixture
def plugin_registry() -> Callable[..., Registry]:
    """A factory: ``plugin_registry(module, ...)`` builds a fresh registry holding only the
    given plugin modules (no installed entry points), as the CLI would load them."""

    def make(*modules: Any) -> Registry:
        return build_registry(autoload=False, modules=modules)

    return make


def _protocol(record: PluginRecord) -> type:
    return getattr(protocols, record.protocol_name)


CALL_TIMEOUT_S = 60.0
"""How long one call into a plugin may take in the contract checks before they fail."""


def _within(timeout_s: float, what: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``fn(*args, **kwargs)`` on a daemon thread, failing the check when it has not returned
    within ``timeout_s`` (a hung env would otherwise hang the test run; the thread is left
    behind, as a job leaves a hung env thread)."""
    import threading

    out: dict[str, Any] = {}

    def call() -> None:
        try:
            out["value"] = fn(*args, **kwargs)
        except BaseException as exc:  # noqa: BLE001 - re-raised in the caller
            out["error"] = exc

    thread = threading.Thread(target=call, name=f"check: {what}", daemon=True)
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        raise AssertionError(
            f"{what} did not return within {timeout_s:g} s. In a job a call that hangs holds "
            "its episode until episodes.step_timeout_s and a thread for good: make it return "
            "(bound the env's own waits), or pass a larger timeout_s to the check if it is "
            "only slow"
        )
    if "error" in out:
        raise out["error"]
    return out.get("value")


def check_env(record: EnvPlugin, config: Any = None, *, timeout_s: float = CALL_TIMEOUT_S) -> None:
    """Contract of an env (built with ``config``, default: its config class's defaults):
    problems per mode and seed, determinism, and grading: ``score`` returns a float or
    ``Score`` (single-turn), or ``reset`` returns an episode whose ``step`` returns a ``Step``
    (multi-turn; stepped once with the reference answer). Every call into the env must return
    within ``timeout_s``."""
    import asyncio
    import inspect

    name = f"env {record.name!r}"
    env = _within(timeout_s, f"{name}: build()", record.build, check_config_class(record, config))
    multi_turn = isinstance(env, protocols.MultiTurnEnv)
    agent = protocols.is_agent_env(env)  # its episodes need a policy: only problems are checked
    assert multi_turn or agent or isinstance(env, protocols.Env), (
        f"{name}: build() must return an Env (sample_problems + score), a MultiTurnEnv "
        "(sample_problems + reset) or an AgentEnv (sample_problems + run_agent)"
    )
    for mode in ("train", "eval"):
        what = f"{name}: sample_problems(3, mode={mode!r}, seed=0)"
        problems = _within(timeout_s, what, env.sample_problems, 3, mode=mode, seed=0)
        assert len(problems) == 3 and all(isinstance(p, Problem) for p in problems)
        again = _within(timeout_s, what, env.sample_problems, 3, mode=mode, seed=0)
        assert [p.id for p in problems] == [p.id for p in again], "same seed, same problems"
        for problem in problems:
            assert isinstance(problem.prompt, str) and (problem.prompt or problem.messages)
            if agent:
                continue
            if multi_turn:
                episode = _within(timeout_s, f"{name}: reset({problem.id!r})", env.reset, problem)
                assert isinstance(episode, protocols.Episode), (
                    f"{name}: reset() must return an episode with a step() method"
                )

                def step_once(episode: Any = episode, problem: Problem = problem) -> Any:
                    step = episode.step(Action(text=problem.answer))
                    if inspect.isawaitable(step):
                        step = asyncio.run(_awaited(step))
                    return step

                what = f"{name}: step() of problem {problem.id!r} with its answer"
                step = _within(timeout_s, what, step_once)
                assert isinstance(step, Step), f"{name}: step() must return a Step, got {step!r}"
                close = getattr(env, "close", None)
                if close is not None:
                    _within(timeout_s, f"{name}: close()", close, episode)
                continue
            what = f"{name}: score() of problem {problem.id!r}"
            score = _within(timeout_s, what, env.score, problem, problem.answer)
            assert isinstance(score, float | Score), (
                f"{name}: score() must return a float or a Score, got {score!r}"
            )
    if record.default_lessons is not None:
        check_default_lessons(record, timeout_s=timeout_s)


async def _awaited(awaitable: Any) -> Any:
    return await awaitable


def check_default_lessons(record: EnvPlugin, *, timeout_s: float = CALL_TIMEOUT_S) -> None:
    """An env's ``default_lessons`` make a curriculum a run accepts: lessons with unique ids,
    dependencies on lessons that exist and no cycle, and ``env_config`` overrides that
    structure into the env's config class and build an env that poses problems."""
    from marin_rl_core.config.converter import make_converter
    from marin_rl_core.config.validation import _find_cycle

    assert record.default_lessons is not None
    lessons = list(record.default_lessons(record.config_class()))
    name = f"env {record.name!r}: default_lessons"
    assert lessons, f"{name} returned no lesson"
    assert all(isinstance(lesson, LessonConfig) for lesson in lessons), (
        f"{name} must return LessonConfig objects, got {lessons!r}"
    )
    ids = [lesson.id for lesson in lessons]
    assert len(set(ids)) == len(ids), f"{name}: lesson ids repeat: {ids}"
    for lesson in lessons:
        missing = [d.lesson for d in lesson.dependencies if d.lesson not in ids]
        assert not missing, f"{name}: lesson {lesson.id!r} depends on unknown lessons {missing}"
    cycle = _find_cycle({lesson.id: [d.lesson for d in lesson.dependencies] for lesson in lessons})
    assert not cycle, f"{name}: dependencies form a cycle: {' -> '.join(cycle)}"
    converter = make_converter(build_registry(autoload=False))
    base = converter.unstructure(record.config_class())
    for lesson in lessons:
        if lesson.env not in ("", record.name):
            continue  # another env's lesson: that env's checks cover it
        try:
            config = converter.structure({**base, **dict(lesson.env_config)}, record.config_class)
        except Exception as exc:
            raise AssertionError(
                f"{name}: lesson {lesson.id!r}'s env_config {dict(lesson.env_config)!r} is not a "
                f"valid {record.config_class.__name__}: {exc}"
            ) from exc
        what = f"{name}: lesson {lesson.id!r}: build() and sample_problems(2)"
        problems = _within(
            timeout_s,
            what,
            lambda c=config: record.build(c).sample_problems(2, mode="train", seed=0),
        )
        assert problems, f"{name}: lesson {lesson.id!r} poses no problem"


def _tiny_group(rewards: list[float]) -> RolloutGroup:
    return RolloutGroup(
        rollouts=[
            Rollout.single_turn(
                env_name="check",
                lesson_id="check",
                problem_id="p0",
                prompt_tokens=[1, 2],
                response_tokens=[3],
                response_logprobs=[-0.5],
                reward=r,
            )
            for r in rewards
        ]
    )


def check_loss(record: LossPlugin, config: Any = None) -> None:
    """Contract of a loss (built with ``config``, default: its config class's defaults):
    protocol, ``build``, one finite (or NaN: dropped) advantage per rollout, a higher reward
    never a lower advantage and equal rewards equal advantages, a valid
    :class:`~marin_rl_core.protocols.LossPlan` (no members the plan replaced), and a loss
    function that runs on a tiny model and batch and gives a finite loss and gradient (a
    :class:`~marin_rl_core.learner.loss.TokenLoss` of the batch's shape), after the plan's
    preparation when it has one."""
    loss = record.build(check_config_class(record, config))
    assert isinstance(loss, protocols.RLLossModule), f"loss {record.name!r}: not an RLLossModule"
    assert isinstance(loss.needs_reference_model, bool)
    group = _tiny_group([0.0, 1.0, 1.0, 0.0])
    adv = np.asarray(loss.compute_advantages(group), dtype=np.float64)
    assert adv.shape == (4,) and np.all(np.isfinite(adv)), f"advantages {adv}"
    assert adv[1] > adv[0], "a higher reward must get a higher advantage"
    assert adv[1] == adv[2] and adv[0] == adv[3], "equal rewards of one prompt, equal advantages"
    flat = np.asarray(loss.compute_advantages(_tiny_group([1.0, 1.0])), dtype=np.float64)
    assert flat.shape == (2,) and (np.all(np.isnan(flat)) or flat[0] == flat[1])
    try:
        protocols.loss_plan(loss)  # valid, and no member it replaced
    except (TypeError, ValueError) as exc:
        raise AssertionError(f"loss {record.name!r}: {exc}") from exc
    _check_loss_fn(record.name, loss, group, adv)


def _check_loss_fn(name: str, loss: Any, group: RolloutGroup, advantages: Any) -> None:
    import equinox as eqx
    import jax

    from marin_rl_core.config import ModelConfig
    from marin_rl_core.learner.loss import (
        TokenLoss,
        batch_options,
        loss_plan,
        step_loss,
        with_loss_state,
    )
    from marin_rl_core.learner.training_batch import training_batch_from_rollouts
    from marin_rl_core.models.build import build_model
    from marin_rl_core.models.tokenizer import ArithmeticTokenizer

    config = ModelConfig(hidden_dim=16, intermediate_dim=32, num_layers=1, num_heads=2,
                         num_kv_heads=2, max_seq_len=8)  # fmt: skip
    model = build_model(config, ArithmeticTokenizer(), key=jax.random.PRNGKey(0))
    reference = model if loss.needs_reference_model else None
    module = loss.build(reference)
    plan = loss_plan(module)
    # What the trainer trains: the policy, with the loss's own state when it has some.
    model, _ = with_loss_state(plan, model, key=jax.random.PRNGKey(2), learning_rate=1e-3)
    batch = training_batch_from_rollouts(
        group.rollouts, advantages, config.max_seq_len, 0, **batch_options(plan)
    )
    create_prepare = plan.create_prepare_fn
    if create_prepare is not None:  # what the trainer runs before a step's updates
        prepared = create_prepare(reference, model)(model, (batch,))
        assert len(prepared) == 1, f"loss {name!r}: prepare gives one dict per minibatch"
        for key, value in prepared[0].items():
            shape = batch.loss_mask.array.shape
            assert value.array.shape == shape, f"loss {name!r}: prepared {key!r} is not per token"
        batch = eqx.tree_at(
            lambda b: b.prepared, batch, dict(prepared[0]), is_leaf=lambda x: x is None
        )
    out = module.create_loss_fn(reference, model)(model, batch, key=jax.random.PRNGKey(1))
    assert isinstance(out, TokenLoss), (
        f"loss {name!r}: loss_fn returned a {type(out).__name__}, not a TokenLoss "
        "(docs/losses.md, 'Migrating a loss')"
    )
    shape = batch.loss_mask.array.shape
    assert out.loss.array.shape == shape, f"loss {name!r}: per-token loss of shape {shape}"
    for metric, value in out.metrics.items():
        assert value.array.shape == shape, f"loss {name!r}: metric {metric!r} is not per token"

    def value(m: Any) -> Any:
        loss_fn = module.create_loss_fn(reference, m)
        return step_loss(loss_fn, m, batch, key=jax.random.PRNGKey(1))[0]

    total, grads = eqx.filter_value_and_grad(value)(model)
    assert np.isfinite(float(total)), f"loss {name!r}: the loss is {float(total)}"
    leaves = jax.tree.leaves(eqx.filter(grads, eqx.is_inexact_array))
    assert all(np.all(np.isfinite(np.asarray(g))) for g in leaves), f"loss {name!r}: gradient"
    assert any(np.any(np.asarray(g) != 0) for g in leaves), f"loss {name!r}: zero gradient"


def check_weight_transfer(record: WeightTransferPlugin, config: Any = None) -> None:
    """Contract of a weight transfer (built with ``config``, default: its config class's
    defaults): on loopback, a published version arrives bit for bit as
    a ``ReceivedWeights`` (within 30 s: publishing is served in the background), and nothing
    newer gives ``None``."""
    import jax.numpy as jnp

    from marin_rl_core.types import ReceivedWeights

    transfer = record.build(check_config_class(record, config))
    assert isinstance(transfer, protocols.WeightTransfer), f"weight_transfer {record.name!r}"
    server = transfer.server()
    try:
        sent = {"w": jnp.arange(6, dtype=jnp.bfloat16), "b": jnp.ones((2, 3), jnp.float32)}
        server.publish(sent, weight_step=1)
        client, got, deadline = transfer.client(server.address), None, time.monotonic() + 30
        while got is None and time.monotonic() < deadline:
            got = client.receive({"w": jnp.zeros(6, jnp.bfloat16), "b": jnp.zeros((2, 3))})
        assert isinstance(got, ReceivedWeights) and got.weight_step == 1, f"{record.name}: {got}"
        assert all((got.model[k] == sent[k]).all() for k in sent), f"{record.name}: not bit-exact"
        assert client.receive(got.model) is None, f"{record.name}: nothing newer must give None"
        client.close()
    finally:
        server.close()


def check_curriculum(record: CurriculumPlugin, config: Any = None) -> None:
    """Contract of a curriculum (built with ``config``, default: its config class's defaults):
    samples only unlocked lessons, unlocks on eval, state round-trips through JSON."""
    lessons = [
        LessonConfig(id="easy", stop_threshold=0.9),
        LessonConfig(
            id="hard", dependencies=[LessonDependency(lesson="easy", reward_threshold=0.5)]
        ),
    ]
    config = check_config_class(record, config)
    policy = record.build(config, lessons)
    assert isinstance(policy, protocols.CurriculumPolicy), f"curriculum {record.name!r}"
    assert {policy.sample_lesson(seed=s) for s in range(20)} == {"easy"}
    assert policy.lesson_states()["hard"] == "locked"
    policy.update_training(LessonStats(lesson_id="easy", mean_reward=0.6, n_rollouts=8, step=1))
    policy.update_eval(LessonStats(lesson_id="easy", mean_reward=0.95, n_rollouts=8, step=1))
    assert policy.lesson_states()["hard"] == "active"
    assert "hard" in {policy.sample_lesson(seed=s) for s in range(50)}
    state = json.loads(json.dumps(policy.state_dict()))
    fresh = record.build(config, lessons)
    fresh.load_state_dict(state)
    assert fresh.lesson_states() == policy.lesson_states()


# --- servers on loopback ----------------------------------------------------------------------------


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def serve_on_loopback(argv: list[str], port: int, *, timeout_s: float = 60.0) -> Any:
    """Start the server ``argv`` (a storage emulator, say) and return its ``Popen`` once it
    accepts connections on ``127.0.0.1:port``; ``None`` when it is not installed, exits, or does
    not listen within ``timeout_s`` (the process is killed then)."""
    import socket
    import subprocess
    import time

    try:
        proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    except FileNotFoundError:
        return None
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
            return proc
        except OSError:
            time.sleep(0.2)
    proc.kill()
    return None


def check_reward(record: RewardPlugin, config: Any = None) -> None:
    """Contract of a reward function (built with ``config``, default: its config class's
    defaults): a :class:`~marin_rl_core.protocols.RewardFunction` whose ``score`` returns one
    finite number (or ``None``: could not grade) per episode, in order, for a batch of varied
    episodes and for an empty one."""
    config = check_config_class(record, config)
    function = record.build(config)
    name = f"reward {record.name!r}"
    assert isinstance(function, protocols.RewardFunction), f"{name}: no score(items) method"
    problem = Problem(id="p1", prompt="What is 2 + 3?", answer="5")
    items = [
        RewardInput(problem=problem, response="5", response_tokens=2, env_reward=1.0),
        RewardInput(problem=problem, response="It is 6.", response_tokens=5, env_reward=0.0),
        RewardInput(
            problem=Problem(id="p2", prompt="Say hi", messages=[{"role": "user", "content": "hi"}]),
            response="",
            response_tokens=0,
            env_reward=0.0,
            truncated=True,
            mode="eval",
        ),  # fmt: skip
    ]
    got = list(function.score(items))
    assert len(got) == len(items), f"{name}: {len(got)} values for {len(items)} episodes"
    finite = [v is None or isinstance(v, int | float | np.floating) and np.isfinite(v) for v in got]
    assert all(finite), f"{name}: {got} holds what is neither a finite number nor None"
    assert list(function.score([])) == [], f"{name}: an empty batch must give no values"


CHECKS: dict[str, Callable[..., None]] = {
    "env": check_env,
    "loss": check_loss,
    "storage": check_storage,
    "weight_transfer": check_weight_transfer,
    "curriculum": check_curriculum,
    "engine": check_engine,
    "reward": check_reward,
}


def check_plugin(
    record: PluginRecord,
    config: Any = None,
    *,
    timeout_s: float = CALL_TIMEOUT_S,
    round_trip: bool = True,
) -> None:
    """Run the contract checks for ``record``'s kind, on the plugin built with ``config`` (an
    instance of its config class; default: the class's defaults, so call it again with each
    setting that changes what the plugin does: ``check_plugin(record, MyConfig(critic="model"))``).
    An env call that takes longer than ``timeout_s`` fails the check instead of hanging it; a
    storage is checked with a round trip through it unless ``round_trip=False``."""
    if record.kind == "env":
        check_env(record, config, timeout_s=timeout_s)
    elif record.kind == "storage":
        check_storage(record, config, round_trip=round_trip)
    else:
        CHECKS[record.kind](record, config)


_TINY_MODEL = {
    "ArithmeticTokenizer": ("marin_rl_core.models.tokenizer", "ArithmeticTokenizer"),
    "ModelConfig": ("marin_rl_core.config", "ModelConfig"),
    "build_model": ("marin_rl_core.models.build", "build_model"),
}
"""What a plugin's tests build a tiny policy with (the default task's tokenizer, a model's shape,
the model), imported on first use: ``build_model(ModelConfig(...), ArithmeticTokenizer(),
key=...)``."""


def __getattr__(name: str) -> Any:
    if name not in _TINY_MODEL:
        raise AttributeError(f"module 'marin_rl_core.testing' has no attribute {name!r}")
    import importlib

    module, attribute = _TINY_MODEL[name]
    return getattr(importlib.import_module(module), attribute)


__all__ = [
    *_TINY_MODEL,
    "CALL_TIMEOUT_S",
    "CHAT_TEMPLATES",
    "as_transformers5_layout",
    "CHECKS",
    "check_config_class",
    "check_curriculum",
    "check_default_lessons",
    "check_engine",
    "check_env",
    "check_loss",
    "check_plugin",
    "check_reward",
    "check_storage",
    "check_weight_transfer",
    "plugin_registry",
    "tiny_chat_tokenizer",
    "write_tiny_hf_checkpoint",
]
