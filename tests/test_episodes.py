"""Multi-turn episodes through the real sampling engine: token-exact rollouts, logprobs the
trainer agrees with, concurrency, limits and failures."""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import shutil
import threading
import time

import attrs
import numpy as np
import pytest

from marin_rl_core import (
    Action,
    EnvPlugin,
    Problem,
    Rollout,
    RolloutGroup,
    Step,
    build_registry,
    hookimpl,
)
from marin_rl_core.config import resolve_config
from marin_rl_core.learner.replay_buffer import episode_advantages
from marin_rl_core.rollout.episode_state import as_multi_turn

# --- the game on its own -------------------------------------------------------------------------


def play(env, hidden: int, policy) -> tuple[float, int]:
    """Play one game with ``policy(history) -> guess text``; returns (reward, guesses)."""
    problem = Problem(id=f"hidden-{hidden}", prompt="?", info={"hidden": hidden})
    episode = env.reset(problem)
    history: list[tuple[int, str]] = []
    while True:
        text = policy(history)
        step = episode.step(Action(text=text, turn=len(history)))
        if step.done:
            return step.reward, int(step.metrics["guesses"])
        history.append((int(text[0]) if text[:1].isdigit() else -1, step.observation))


def test_the_game_rewards_using_the_feedback_and_caps_feedback_blind_play_at_40_percent():
    from marin_rl_plugins.guess_env import GuessEnv, GuessEnvConfig

    env = GuessEnv(GuessEnvConfig())

    def binary_search(history):
        low, high = 0, 9
        for guess, feedback in history:
            if feedback == "<":
                high = guess - 1
            elif feedback == ">":
                low = guess + 1
        return str((low + high + 1) // 2)

    results = [play(env, d, binary_search) for d in range(10)]
    assert [r for r, _ in results] == [1.0] * 10
    assert max(g for _, g in results) == 4

    # Any fixed sequence of guesses (what a feedback-blind greedy policy plays) finds at most 4
    # of the 10 digits; the best of them finds exactly 4.
    for fixed in (["0", "1", "2", "3"], ["5", "5", "5", "5"], ["9", "x", "37", "8"]):
        solved = sum(play(env, d, lambda h, f=fixed: f[len(h)])[0] for d in range(10))
        assert solved <= 4
    assert sum(play(env, d, lambda h: "0123"[len(h)])[0] for d in range(10)) == 4

    # Invalid guesses cost a guess and say so.
    episode = env.reset(Problem(id="h", prompt="?", info={"hidden": 3}))
    assert episode.step(Action(text="x")).observation == "?"
    assert episode.step(Action(text="37")).observation == "?"
    assert episode.step(Action(text="5<eos>")).observation == "<"
    # Eval poses every digit once.
    assert [p.info["hidden"] for p in env.sample_problems(30, mode="eval", seed=0)] == list(
        range(10)
    )


# --- episodes through the real engine ------------------------------------------------------------


def _manager(env_name: str, *, modules=(), overrides=()):
    from marin_rl_core.models.build import initial_model
    from marin_rl_core.models.tokenizer import model_tokenizer
    from marin_rl_core.rollout.manager import RolloutManager

    registry = build_registry(modules=list(modules))
    config = resolve_config(registry, selections={"env": env_name}, overrides=list(overrides))
    tokenizer = model_tokenizer(config.model)
    model = initial_model(config, tokenizer)
    return RolloutManager(config, registry, model=model, tokenizer=tokenizer), config


def test_multi_turn_rollouts_are_token_exact_and_the_trainer_agrees_with_the_sampler():
    from marin_rl_core.learner.training_batch import training_batch_from_rollouts
    from marin_rl_core.models.logprobs import next_token_logprobs
    from marin_rl_core.sample_rows import sample_turns

    manager, config = _manager("guess")
    tokenizer = manager.tokenizer
    batch, metrics = manager.sample_batch(
        "guess_digit", n_examples=8, n_generations=4, mode="train", seed=3, weight_step=0,
        worker_id="w",
    )  # fmt: skip
    rollouts = batch.rollouts
    assert len(rollouts) == 32 and metrics["env_errors"] == 0 and metrics["env_timeouts"] == 0
    multi = [r for r in rollouts if r.num_turns > 1]
    assert multi, "an untrained policy rarely finds the digit at once: most episodes go on"
    assert metrics["turns"] == pytest.approx(np.mean([r.num_turns for r in rollouts]))
    feedback_ids = {tokenizer.token_id(t) for t in "<>?"}
    for r in rollouts:
        # The prompt, then per turn: the sampled action, then the env's one-token feedback.
        assert r.tokens[:2].tolist() == tokenizer.encode("?", add_bos=True)
        spans = r.turn_spans()
        for i, (start, end) in enumerate(spans):
            action_len = int(r.loss_mask[start:end].sum())
            assert r.loss_mask[start : start + action_len].all()
            observation = r.tokens[start + action_len : end]
            if i < len(spans) - 1:
                assert len(observation) == 1 and int(observation[0]) in feedback_ids
            else:
                assert len(observation) == 0  # nothing is appended after the last turn
            assert not r.loss_mask[start + action_len : end].any()
        assert not r.loss_mask[: r.prompt_length].any()
        assert r.reward == float(r.turn_rewards.sum())
        assert np.all(r.logprobs[~r.loss_mask] == 0)
        turns = sample_turns(r, tokenizer)
        assert len(turns) == r.num_turns and turns[-1]["observation"] == ""

    # The trainer's logprobs of the policy's tokens equal the sampler's, in every turn.
    advantages = np.linspace(-1, 1, len(rollouts))
    train = training_batch_from_rollouts(
        rollouts, advantages, config.model.max_seq_len, tokenizer.pad_id,
        temperature=config.sampling_for(manager.lessons["guess_digit"]).temperature,
    )  # fmt: skip
    logprobs = np.asarray(
        next_token_logprobs(manager.model, train.input_ids, temperature=train.temperature).array
    )
    mask = np.asarray(train.loss_mask.array)
    assert mask.sum() == sum(r.num_policy_tokens for r in rollouts)
    np.testing.assert_allclose(
        logprobs * mask, np.asarray(train.behaviour_logprobs.array), atol=1e-4
    )
    # Positions that predict an observation token carry no loss and no advantage.
    predicts_feedback = np.zeros_like(mask, dtype=bool)
    for i, r in enumerate(rollouts):
        after_prompt = np.arange(1, r.num_tokens) >= r.prompt_length
        predicts_feedback[i, : r.num_tokens - 1] = after_prompt & ~r.loss_mask[1:]
    assert predicts_feedback.sum() == sum(r.num_turns - 1 for r in rollouts) > 0
    assert not mask[predicts_feedback].any()
    assert not np.asarray(train.advantages.array)[predicts_feedback].any()


def test_episodes_draw_the_same_tokens_from_the_same_seed():
    manager, _ = _manager("guess")
    kwargs = dict(n_examples=6, n_generations=4, mode="train", weight_step=0, worker_id="w")
    a, _ = manager.sample_batch("guess_digit", seed=11, **kwargs)
    b, _ = manager.sample_batch("guess_digit", seed=11, **kwargs)
    c, _ = manager.sample_batch("guess_digit", seed=12, **kwargs)
    assert [r.tokens.tolist() for r in a.rollouts] == [r.tokens.tolist() for r in b.rollouts]
    assert [r.tokens.tolist() for r in a.rollouts] != [r.tokens.tolist() for r in c.rollouts]


def test_the_tokens_of_a_seed_do_not_depend_on_the_generation_cohorts():
    """Lock-step turns (one cohort) or cohorts overlapping env steps: the same episodes, token
    for token (each action's key is its episode's own; issue 50). They used to differ."""
    kwargs = dict(n_examples=6, n_generations=4, mode="train", weight_step=0, worker_id="w")
    tokens = []
    for cohorts in (1, 2, 3):
        manager, _ = _manager("guess", overrides=[f"episodes.generation_cohorts={cohorts}"])
        batch, _ = manager.sample_batch("guess_digit", seed=11, **kwargs)
        tokens.append([r.tokens.tolist() for r in batch.rollouts])
        manager.shutdown()
    assert tokens[0] == tokens[1] == tokens[2]


# --- envs that wait, hang, raise, or never end ---------------------------------------------------


@attrs.frozen
class ProbeConfig:
    # async_wait | sync_hang | async_hang | raise | crash | endless | reset_hang | problems_hang
    # | build_fails
    behaviour: str = "async_wait"
    delay_s: float = 0.05
    hang_problem: str = "1"
    hang_s: float = 3600.0  # how long a "hung" plain step sleeps


class ProbeEpisode:
    def __init__(self, env: ProbeEnv, problem: Problem):
        self.env, self.problem, self.turn = env, problem, 0

    async def _async_step(self, action: Action) -> Step:
        c = self.env.config
        with self.env.lock:
            self.env.in_flight += 1
            self.env.most_in_flight = max(self.env.most_in_flight, self.env.in_flight)
        try:
            hang = c.behaviour == "async_hang" and self.problem.id == c.hang_problem
            await asyncio.sleep(3600 if hang else c.delay_s)
        finally:
            with self.env.lock:
                self.env.in_flight -= 1
        return self._next(action)

    def _next(self, action: Action) -> Step:
        self.turn += 1
        done = self.turn >= 3 and self.env.config.behaviour != "endless"
        return Step(
            observation="!", reward=0.5 if done else 0.0, done=done, metrics={"pid": os.getpid()}
        )

    def step(self, action: Action):
        c = self.env.config
        if c.behaviour in ("async_wait", "async_hang"):
            return self._async_step(action)
        if c.behaviour == "sync_hang" and self.problem.id == c.hang_problem:
            with self.env.lock:
                self.env.hang_starts.append(time.monotonic())
            time.sleep(c.hang_s)
        if c.behaviour == "raise" and self.problem.id == c.hang_problem:
            raise RuntimeError("the sandbox fell over")
        if c.behaviour == "crash" and self.problem.id == c.hang_problem:
            os._exit(3)  # a native library taking its process down
        return self._next(action)


class ProbeEnv:
    def __init__(self, config: ProbeConfig):
        if config.behaviour == "build_fails":
            raise ValueError("the probe's dataset is missing")
        self.config = config
        self.lock = threading.Lock()
        self.in_flight = self.most_in_flight = 0
        self.closed = 0
        self.hang_starts: list[float] = []

    def sample_problems(self, n, *, mode, seed):
        if self.config.behaviour == "problems_hang" and seed == 0:
            time.sleep(3600)
        first = 10 * seed if self.config.behaviour == "reset_hang" else 0  # new ids each seed
        return [Problem(id=str(i), prompt=f"{i}+{i}=") for i in range(first, first + n)]

    def reset(self, problem):
        if self.config.behaviour == "reset_hang" and problem.id == self.config.hang_problem:
            time.sleep(3600)
        return ProbeEpisode(self, problem)

    def close(self, episode):
        self.closed += 1


class ScoreProbeEnv:
    """A single-turn env whose ``score`` hangs or raises on problem 1 (``behaviour``: ``hang``
    or ``raise``) and counts its calls."""

    def __init__(self, config: ProbeConfig):
        self.config, self.calls = config, 0

    def sample_problems(self, n, *, mode, seed):
        return [Problem(id=str(i), prompt=f"{i}+{i}=", answer=str(2 * i)) for i in range(n)]

    def score(self, problem, response):
        self.calls += 1
        if problem.id == self.config.hang_problem:
            if self.config.behaviour == "hang":
                time.sleep(3600)
            if self.config.behaviour == "raise":
                raise RuntimeError("the grader fell over")
        return 0.25


class probe_plugin:
    @staticmethod
    @hookimpl
    def marinrl_register_envs():
        yield EnvPlugin(name="probe", summary="probe", config_class=ProbeConfig, build=ProbeEnv)
        yield EnvPlugin(
            name="score_probe", summary="probe", config_class=ProbeConfig, build=ScoreProbeEnv
        )


def _probe(behaviour: str, *overrides: str):
    manager, _ = _manager(
        "probe",
        modules=[probe_plugin],
        overrides=[f"env.behaviour={behaviour}", "model.max_seq_len=32", *overrides],
    )
    return manager, manager.env("probe")


def _sample(manager, **kwargs):
    args = dict(n_examples=4, n_generations=4, mode="train", seed=0, weight_step=0, worker_id="w")
    return manager.sample_batch("probe", **{**args, **kwargs})


def test_async_steps_run_concurrently_and_every_episode_is_closed():
    manager, env = _probe("async_wait")
    batch, metrics = _sample(manager)
    assert len(batch.rollouts) == 16 and all(r.num_turns == 3 for r in batch.rollouts)
    assert all(r.reward == 0.5 and r.turn_rewards.tolist() == [0, 0, 0.5] for r in batch.rollouts)
    assert env.most_in_flight == 16  # every episode's step waits at the same time
    assert env.closed == 16
    assert metrics["turns"] == 3 and metrics["env_step_seconds"] >= 0.05


@pytest.mark.parametrize("behaviour", ["sync_hang", "async_hang"])
def test_a_hanging_step_is_cut_off_counted_and_loses_only_its_group(behaviour, caplog):
    manager, env = _probe(behaviour, "episodes.step_timeout_s=1.0")
    batch, metrics = _sample(manager)
    assert metrics["env_timeouts"] == 4  # the 4 episodes of problem 1
    assert sorted({r.problem_id for r in batch.rollouts}) == ["0", "2", "3"]
    assert "did not return within 1.0 s" in caplog.text
    # The runner goes on: the next batch is served (a stuck env thread was replaced).
    again, metrics = _sample(manager, seed=1)
    assert metrics["env_timeouts"] == 4 and len(again.rollouts) == 12


def test_hung_plain_steps_time_out_together_and_stuck_threads_are_bounded(caplog, monkeypatch):
    """Four episodes whose plain ``step`` hangs: their timeouts run at once (not 4 x 1 s one
    after another), each stuck thread is counted, and once MAX_HUNG_THREADS are stuck the env
    is not called again: its episodes fail at once, saying why."""
    import marin_rl_core.rollout.env_calls as env_calls

    manager, env = _probe("sync_hang", "episodes.step_timeout_s=1.0")
    batch, metrics = _sample(manager)
    assert metrics["env_timeouts"] == 4 and metrics["env_hung_threads"] == 4
    assert len(env.hang_starts) == 4
    # Every hung call started before the first one was cut off: they waited together.
    assert max(env.hang_starts) - min(env.hang_starts) < 1.0
    assert sorted({r.problem_id for r in batch.rollouts}) == ["0", "2", "3"]
    # One thread (an env that is not thread-safe): the calls come one at a time.
    serial, serial_env = _probe(
        "sync_hang", "episodes.step_timeout_s=0.5", "episodes.env_threads=1"
    )
    _, metrics = _sample(serial, n_generations=2)
    gaps = np.diff(sorted(serial_env.hang_starts))
    assert len(serial_env.hang_starts) == 2 and gaps.min() >= 0.5
    # The bound: with 4 stuck threads allowed, the next batch fails without calling the env.
    monkeypatch.setattr(env_calls, "MAX_HUNG_THREADS", 4)
    batch, metrics = _sample(manager, seed=1)
    assert batch is None and metrics["env_errors"] == 4 and len(env.hang_starts) == 4
    assert "4 env threads are stuck in calls that never returned" in caplog.text
    assert "episodes.env_processes" in caplog.text


@pytest.mark.parametrize("behaviour", ["sync_hang", "async_hang"])
def test_a_stopping_worker_cancels_a_batch_stuck_in_env_steps(behaviour):
    """A batch waiting on hung steps (timeout 600 s) is cancelled from another thread, as a
    stopping worker does: sample_batch raises BatchCancelled at once, and the runner serves
    the next batch."""
    from marin_rl_core.rollout.episode_state import BatchCancelled

    manager, env = _probe(behaviour, "episodes.step_timeout_s=600")
    outcome: list[BaseException | object] = []

    def sample() -> None:
        try:
            outcome.append(_sample(manager))
        except BaseException as exc:  # noqa: BLE001 - what the test looks at
            outcome.append(exc)

    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and not (env.hang_starts or env.in_flight):
        time.sleep(0.05)  # until a step hangs
    manager.cancel()
    thread.join(60)
    assert not thread.is_alive(), "the cancelled batch still waits for its hung steps"
    assert isinstance(outcome[0], BatchCancelled), outcome
    env.config = attrs.evolve(env.config, behaviour="async_wait")  # the env recovered
    batch, _ = _sample(manager, seed=1)
    assert len(batch.rollouts) == 16


def test_a_step_that_was_only_slow_frees_its_thread_when_it_returns():
    """A plain step that overruns its timeout but returns later is no longer counted as
    stuck: only calls that never return use up MAX_HUNG_THREADS."""
    # (hang_s well past the timeout: the calls must still be hung when the batch is counted,
    # however slowly a loaded machine samples it)
    manager, env = _probe("sync_hang", "episodes.step_timeout_s=0.5", "env.hang_s=4.0")
    _, metrics = _sample(manager)
    assert metrics["env_timeouts"] == 4 and metrics["env_hung_threads"] == 4
    deadline = time.monotonic() + 30
    while manager._runner.hung_threads and time.monotonic() < deadline:
        time.sleep(0.1)
    assert manager._runner.hung_threads == 0
    _, metrics = _sample(manager, seed=1)
    assert metrics["env_hung_threads"] == 4  # this batch's four, not eight


@pytest.mark.parametrize("behaviour", ["hang", "raise"])
def test_a_single_turn_score_that_hangs_or_raises_loses_only_its_group(behaviour, caplog):
    """A single-turn batch is scored in one job on the env thread; a hanging ``score`` is still
    cut off after ``step_timeout_s`` and the calls after it go on, on a new thread."""
    manager, _ = _manager(
        "score_probe",
        modules=[probe_plugin],
        overrides=[f"env.behaviour={behaviour!r}", "episodes.step_timeout_s=1.0"],
    )
    env = manager.env("score_probe").env
    args = dict(n_examples=4, n_generations=4, mode="train", weight_step=0, worker_id="w")
    batch, metrics = manager.sample_batch("score_probe", seed=0, **args)
    assert sorted({r.problem_id for r in batch.rollouts}) == ["0", "2", "3"]
    assert {r.reward for r in batch.rollouts} == {0.25} and len(batch.rollouts) == 12
    if behaviour == "hang":
        # Each of problem 1's four calls hangs and is cut off; the other twelve are scored.
        assert metrics["env_timeouts"] == 4 and metrics["env_errors"] == 0
        assert "did not return within 1.0 s" in caplog.text
        assert manager._runner.hung_threads == 4
    else:
        assert metrics["env_timeouts"] == 0 and metrics["env_errors"] == 1
        assert "the grader fell over" in caplog.text
    assert env.calls == 16
    again, _ = manager.sample_batch("score_probe", seed=1, **args)
    assert len(again.rollouts) == 12


def test_a_step_that_raises_fails_its_problem_group():
    manager, env = _probe("raise")
    batch, metrics = _sample(manager)
    assert metrics["env_errors"] == 1 and metrics["env_timeouts"] == 0
    assert sorted({r.problem_id for r in batch.rollouts}) == ["0", "2", "3"]
    assert env.closed == 16


def test_an_endless_episode_stops_at_max_turns_truncated():
    manager, _ = _probe("endless", "episodes.max_turns=5")
    batch, metrics = _sample(manager)
    assert {r.num_turns for r in batch.rollouts} <= {5} | set(range(1, 5))
    # Unless the sequence filled model.max_seq_len first, each ran exactly 5 turns.
    for r in batch.rollouts:
        assert r.truncated
        assert r.num_turns == 5 or r.num_tokens >= 32 - 1


def test_envs_in_processes_of_their_own_serve_episodes():
    manager, _ = _probe("async_wait", "episodes.env_processes=2")
    batch, metrics = _sample(manager)
    assert len(batch.rollouts) == 16 and {r.reward for r in batch.rollouts} == {0.5}
    assert metrics["score/pid"] not in (0, os.getpid())  # the steps ran elsewhere
    assert metrics["env_process_restarts"] == 0
    manager.shutdown()


def test_an_env_that_cannot_be_built_in_its_processes_says_why():
    """The env's own error reaches the rollout worker (not only "env process 0 died"), and the
    pool's processes are stopped."""
    with pytest.raises(RuntimeError) as raised:
        _probe("build_fails", "episodes.env_processes=2")
    assert (
        "building the env in its process failed: ValueError: the probe's dataset is missing "
        in (str(raised.value))
    )
    assert "(test_episodes.py:" in str(raised.value)
    assert not [p for p in multiprocessing.active_children() if p.name.startswith("marinrl-env")]


def test_a_crashing_env_process_fails_its_episodes_and_is_replaced(caplog):
    manager, _ = _probe("crash", "episodes.env_processes=2")
    batch, metrics = _sample(manager)
    # Problem 1's episodes took their process down (with any episode of problem 3, which it
    # also held, still running there); the other process's problems finished.
    survivors = {r.problem_id for r in batch.rollouts}
    assert "1" not in survivors and {"0", "2"} <= survivors
    assert metrics["env_errors"] == 4 - len(survivors)
    assert "env process 1" in caplog.text and "died" in caplog.text
    again, metrics = _sample(manager, seed=1)
    # The dead process was started again (on the next episode it was given, at the latest).
    assert metrics["env_process_restarts"] >= 1
    assert "is replaced (exit code 3); its episodes failed" in caplog.text
    assert {"0", "2"} <= {r.problem_id for r in again.rollouts} <= {"0", "2", "3"}
    manager.shutdown()


def test_a_step_hanging_in_an_env_process_is_cut_off_and_the_process_replaced():
    # (3 s: a healthy step's round trip to its process must not reach it on a loaded machine)
    manager, _ = _probe("sync_hang", "episodes.env_processes=2", "episodes.step_timeout_s=3.0")
    batch, metrics = _sample(manager)
    assert metrics["env_timeouts"] >= 1 and metrics["env_process_restarts"] >= 1
    assert batch is None or "1" not in {r.problem_id for r in batch.rollouts}
    manager.shutdown()


@pytest.mark.parametrize("behaviour", ["reset_hang", "problems_hang"])
def test_a_reset_or_sample_problems_hanging_in_an_env_process_replaces_the_process(behaviour):
    """A process stuck in ``reset`` or ``sample_problems`` is replaced like one stuck in a step:
    left stuck, every later call to it waited out its timeout and failed."""
    manager, env = _probe(
        behaviour, "episodes.env_processes=2", "episodes.step_timeout_s=3.0", "env.delay_s=0.0"
    )
    env.timeout = 3.0  # sample_problems' bound (120 s by default)
    pids = list(env.pids)
    start = time.monotonic()
    batch, metrics = _sample(manager)
    assert time.monotonic() - start < 60  # cut off at the bounds, not left to hang
    if behaviour == "reset_hang":  # problem 1's process: problems 1 and 3 time out
        assert metrics["env_timeouts"] >= 1 and {r.problem_id for r in batch.rollouts} == {"0", "2"}
    else:
        assert batch is None and metrics["env_errors"] == 4
    assert env.restarts == 1 and env.pids != pids
    # The next batch (other problems, another seed) is served at once, with no timeout. (The
    # new process's start is not held to 3 s: on a loaded 2-core machine it can take longer;
    # one stuck again would still time out, failing the batch.)
    env.timeout = 30.0
    start = time.monotonic()
    again, metrics = _sample(manager, seed=1)
    assert len(again.rollouts) == 16 and metrics["env_timeouts"] == 0
    assert time.monotonic() - start < 60  # (no timeout waited out: env_timeouts says so)
    manager.shutdown()


# --- the single-turn adapter and split episodes -------------------------------------------------


def test_a_single_turn_env_is_a_one_step_episode():
    from marin_rl_plugins.mock_env import MockEnv, MockEnvConfig

    env = as_multi_turn(MockEnv(MockEnvConfig()))
    problem = env.sample_problems(1, mode="train", seed=0)[0]
    step = env.reset(problem).step(Action(text=problem.answer))
    assert step == Step(reward=1.0, done=True)
    assert as_multi_turn(env) is env
    with pytest.raises(TypeError, match="neither score"):
        as_multi_turn(object())


def test_split_episodes_share_their_episode_advantage():
    from marin_rl_plugins.rloo import RLOOConfig, RLOOLoss

    def part(reward: float, part: int) -> Rollout:
        return Rollout(
            env_name="e", lesson_id="l", problem_id="p", tokens=[1, 2, 3], loss_mask=[0, 0, 1],
            logprobs=[0, 0, -1], reward=reward, turn_starts=[2], turn_rewards=[reward], part=part,
        )  # fmt: skip

    # Three episodes; the second was split in two parts. RLOO sees three episodes, not four.
    group = RolloutGroup(rollouts=[part(1, 0), part(0, 0), part(0, 1), part(0.5, 0)])
    loss = RLOOLoss(RLOOConfig())
    heads = loss.compute_advantages(RolloutGroup(rollouts=[group.rollouts[i] for i in (0, 1, 3)]))
    got = episode_advantages(loss, group)
    np.testing.assert_allclose(got, [heads[0], heads[1], heads[1], heads[2]])


# --- chat templates: observations extend the tokens, or the episode goes on in a new part --------

# ChatML that drops the content of every assistant turn but the last, as templates that strip
# past reasoning do: rendering the conversation again never extends the tokens sampled so far.
FORGETFUL_CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['role'] == 'assistant' and not loop.last %}{% else %}{{ m['content'] }}{% endif %}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@pytest.fixture(scope="module")
def tiny_qwen3(tmp_path_factory):
    pytest.importorskip("torch")
    from transformers import AutoTokenizer

    from marin_rl_core.testing import write_tiny_hf_checkpoint

    root = tmp_path_factory.mktemp("chat")
    checkpoint = write_tiny_hf_checkpoint(root / "qwen3", "qwen3")
    # The same checkpoint with the forgetful template as its own.
    forgetful = shutil.copytree(checkpoint, root / "forgetful")
    tokenizer = AutoTokenizer.from_pretrained(str(forgetful))
    tokenizer.chat_template = FORGETFUL_CHATML
    tokenizer.save_pretrained(str(forgetful))
    return checkpoint, forgetful


def _chat_batch(checkpoint, *extra):
    manager, config = _manager(
        "probe",
        modules=[probe_plugin],
        overrides=[
            f'model.checkpoint="{checkpoint}"',
            "model.max_seq_len=96",
            'model.inference_dtype="float32"',
            "env.delay_s=0.0",
            "sampling.max_tokens=4",
            "eval.sampling.max_tokens=4",
            *extra,
        ],
    )
    batch, metrics = _sample(manager, n_examples=3, n_generations=4)
    return manager, config, batch, metrics


def _episodes(batch):
    """The rollouts of each episode: a part 0 and the parts after it."""
    episodes: list[list[Rollout]] = []
    for r in batch.rollouts:
        if r.part == 0:
            episodes.append([])
        episodes[-1].append(r)
    return episodes


TURN_END = "<|im_start|>user\n!<|im_end|>\n<|im_start|>assistant\n"


def test_chat_observations_are_rendered_by_the_template_and_appended(tiny_qwen3):
    from marin_rl_core.learner.training_batch import training_batch_from_rollouts
    from marin_rl_core.models.logprobs import next_token_logprobs
    from marin_rl_core.models.tokenizer import encode_prompt

    manager, config, batch, metrics = _chat_batch(tiny_qwen3[0])
    tokenizer = manager.tokenizer
    episodes = _episodes(batch)
    assert len(episodes) == 12
    assert metrics["episode_splits"] == sum(len(e) - 1 for e in episodes)
    whole = [e[0] for e in episodes if len(e) == 1]
    # An untrained model also samples ids of the checkpoint's padded vocabulary rows, which
    # decode to nothing: such an action's text does not re-encode to its tokens, and its episode
    # goes on in a new part (the next test). The others stay one sample.
    assert len(whole) >= 3, "the template extends the tokens: episodes stay in one sample"
    split = [e for e in episodes if len(e) > 1]
    for parts in split:
        assert sum(p.num_turns for p in parts) == 3
    for r in whole:
        problem = Problem(id=r.problem_id, prompt=f"{r.problem_id}+{r.problem_id}=")
        assert r.tokens[: r.prompt_length].tolist() == encode_prompt(tokenizer, problem)
        assert r.num_turns == 3
        for start, end in r.turn_spans()[:-1]:
            action = int(r.loss_mask[start:end].sum())
            observation = tokenizer.decode(r.tokens[start + action : end].tolist())
            # The template closes the assistant turn (unless the action already did), then the
            # user's observation, then it opens the next assistant turn.
            assert observation.endswith(TURN_END), observation
            assert observation in (TURN_END, "\n" + TURN_END, "<|im_end|>\n" + TURN_END)

    # The trainer's logprobs of the sampled tokens equal the sampler's.
    train = training_batch_from_rollouts(
        batch.rollouts, np.ones(len(batch.rollouts)), config.model.max_seq_len, tokenizer.pad_id,
        temperature=config.sampling.temperature,
    )  # fmt: skip
    logprobs = next_token_logprobs(manager.model, train.input_ids, temperature=train.temperature)
    mask = np.asarray(train.loss_mask.array)
    np.testing.assert_allclose(
        np.asarray(logprobs.array) * mask, np.asarray(train.behaviour_logprobs.array), atol=1e-4
    )


def test_a_template_that_rewrites_the_past_splits_the_episode_into_parts(tiny_qwen3):
    manager, config, batch, metrics = _chat_batch(tiny_qwen3[1])
    tokenizer = manager.tokenizer
    episodes = _episodes(batch)
    assert len(episodes) == 12
    assert sum(len(e) > 1 for e in episodes) >= 9, "most actions have text the template drops"
    # Each part after the first is counted, as the rollout metrics show it.
    assert metrics["episode_splits"] == sum(len(e) - 1 for e in episodes) >= 9
    for parts in episodes:
        assert sum(p.num_turns for p in parts) == 3  # every turn is in exactly one part
        assert {p.reward for p in parts} == {0.5}  # each part carries the episode's reward
        assert [p.part for p in parts] == list(range(len(parts)))
        for later in parts[1:]:
            # A later part's prompt is the fresh rendering of the conversation so far.
            prompt = tokenizer.decode(later.tokens[: later.prompt_length].tolist())
            assert prompt.startswith("<|im_start|>user\n") and prompt.endswith(TURN_END)
            assert not later.loss_mask[: later.prompt_length].any()
    # The parts of an episode count once in its group's advantages.
    from marin_rl_plugins.rloo import RLOOConfig, RLOOLoss

    group = batch.groups[0]
    advantages = episode_advantages(RLOOLoss(RLOOConfig()), group)
    assert advantages.shape == (len(group.rollouts),)
    np.testing.assert_allclose(advantages, 0.0)  # every episode earned 0.5


# --- stop ids: the sampler ends a response where the chat template ends the turn -----------------


@pytest.fixture(scope="module")
def uniform_qwen2(tmp_path_factory):
    """A Qwen2 checkpoint whose EOS (``<eos>``) is not its template's end of turn
    (``<|im_end|>``), as in Qwen2.5/Qwen3, with a zero LM head: every token is equally likely, so
    the end of turn is sampled now and then and nothing else stops a response early."""
    torch = pytest.importorskip("torch")
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    from marin_rl_core.testing import write_tiny_hf_checkpoint

    path = write_tiny_hf_checkpoint(tmp_path_factory.mktemp("uniform") / "qwen2", "qwen2")
    model = AutoModelForCausalLM.from_pretrained(str(path))
    with torch.no_grad():
        model.lm_head.weight.zero_()
    model.save_pretrained(str(path), safe_serialization=True)
    eos = AutoTokenizer.from_pretrained(str(path)).eos_token_id
    GenerationConfig(eos_token_id=eos).save_pretrained(
        str(path)
    )  # the end of turn only in the template
    return path


@pytest.mark.parametrize("engine", ["dense", "paged", "kv"])
def test_responses_end_at_the_templates_end_of_turn_when_eos_is_another_token(
    uniform_qwen2, engine
):
    manager, _ = _manager(
        "math",
        overrides=[
            f'model.checkpoint="{uniform_qwen2}"',
            'model.inference_dtype="float32"',
            f'engine.name="{engine}"',
            "model.max_seq_len=64",
            "sampling.max_tokens=32",
            "eval.sampling.max_tokens=32",
            'curriculum.lessons=[{id = "add", env_config = {task = "add_1digit"}}]',
        ],
    )
    tokenizer = manager.tokenizer
    end_of_turn = tokenizer.to_hf().convert_tokens_to_ids("<|im_end|>")
    assert end_of_turn != tokenizer.eos_id and end_of_turn in tokenizer.stop_ids
    batch, _ = manager.sample_batch(
        "add", n_examples=8, n_generations=8, mode="train", seed=0, weight_step=0, worker_id="w"
    )
    stops = set(tokenizer.stop_ids)
    ended_at_end_of_turn = 0
    for rollout in batch.rollouts:
        response = rollout.response_tokens.tolist()
        # A stop id may only be a response's last token; a response that ends at one is complete.
        assert not stops & set(response[:-1]), tokenizer.decode(response)
        if response and response[-1] in stops:
            assert not rollout.truncated
            ended_at_end_of_turn += response[-1] == end_of_turn
        else:
            assert rollout.truncated and len(response) == 32
    assert ended_at_end_of_turn >= 3, "the uniform policy samples <|im_end|> now and then"
