"""The ``verifiers`` env (issue 31): an environment written against the verifiers package (0.4.0)
runs as a marinrl agent env, its episodes sampled from the policy through the rollout worker's
OpenAI endpoint and recorded token for token, its rubric the reward.

The tasksets are modules of their own, which verifiers imports by name and which only this file's
tests import (collection of the suite does not import verifiers): the single-turn one is
``tests/verifiers_sum_taskset.py``, the multi-turn one ``tests/verifiers_guess_taskset.py``."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from test_episodes import _manager

from marin_rl_core import build_registry
from marin_rl_core.config import resolve_config

TESTS = Path(__file__).parent


@pytest.fixture(scope="module", autouse=True)
def _verifiers():
    pytest.importorskip("verifiers")


def _checkpoint(path: Path) -> Path:
    from marin_rl_core.testing import tiny_chat_tokenizer, write_tiny_hf_checkpoint

    return write_tiny_hf_checkpoint(
        path, "qwen3", vocab_size=len(tiny_chat_tokenizer("chatml")), max_position_embeddings=256
    )


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    pytest.importorskip("torch")
    return _checkpoint(tmp_path_factory.mktemp("vf") / "qwen3")


def _verifiers_manager(checkpoint, taskset, *extra):
    return _manager(
        "verifiers",
        overrides=[
            f'model.checkpoint="{checkpoint}"', "model.max_seq_len=256",
            'model.inference_dtype="float32"', f'env.taskset="{taskset}"',
            # Short replies (a random tiny model's 128-token ones would run a 3-turn game out
            # of its 256 positions): the settings these tests were written with.
            "sampling.max_tokens=2", "sampling.temperature=1.5", *extra,
        ],
    )  # fmt: skip


def test_a_verifiers_taskset_runs_through_the_endpoint_and_its_rubric_is_the_reward(checkpoint):
    from verifiers_sum_taskset import REPLIES

    REPLIES.clear()
    manager, config = _verifiers_manager(checkpoint, "verifiers_sum_taskset")
    try:
        batch, metrics = manager.sample_batch(
            "verifiers", n_examples=4, n_generations=2, mode="train", seed=0, weight_step=3,
            worker_id="w",
        )  # fmt: skip
    finally:
        manager.shutdown()
    rollouts = batch.rollouts
    assert metrics["env_errors"] == 0 and len(rollouts) == 8
    tokenizer = manager.tokenizer
    stops = set(tokenizer.stop_ids)
    replies = [reply for texts in REPLIES.values() for reply in texts]
    assert len(replies) == 8  # one chat completion per episode, each scored by the rubric
    for r in rollouts:
        # The policy's tokens are exactly one reply the rubric graded ...
        sampled = r.tokens[r.loss_mask].tolist()
        assert sampled and r.logprobs[r.loss_mask].max() <= 0
        text = tokenizer.decode([t for t in sampled if t not in stops])
        assert text.strip() in [reply.strip() for reply in replies]
        # ... after the task's prompt, rendered by the model's chat template.
        prompt = tokenizer.decode(r.tokens[: r.prompt_length].tolist())
        assert "what is the sum of" in prompt and r.prompt_length == int(r.turn_starts[0])
        # The rubric's reward is the episode's reward: the sum of its (weight 1) rewards.
        a, b = divmod(int(r.problem_id[1:]), 4)  # problem t<index>: the taskset's task <index>
        has_digit = float(re.search(r"\d", text) is not None)
        assert r.reward == has_digit + float(text.strip() == str(a + b))
        assert r.metadata.weight_step == 3
    assert metrics["score/has_digit"] + metrics["score/exact"] == pytest.approx(
        sum(r.reward for r in rollouts) / 8
    )


def test_a_multi_turn_verifiers_env_is_one_episode_per_conversation(checkpoint):
    manager, config = _verifiers_manager(
        checkpoint, "verifiers_guess_taskset", "episodes.max_turns=3"
    )
    try:
        batch, metrics = manager.sample_batch(
            "verifiers", n_examples=4, n_generations=2, mode="train", seed=1, weight_step=0,
            worker_id="w",
        )  # fmt: skip
    finally:
        manager.shutdown()
    assert metrics["env_errors"] == 0
    # The env's feedback is a user turn between the policy's guesses, all in one episode.
    assert metrics["turns"] == pytest.approx(metrics["score/guesses"])
    assert 1 < metrics["turns"] <= 3
    for r in batch.rollouts:
        text = manager.tokenizer.decode(r.tokens.tolist())
        assert "guess the digit" in text
        assert r.reward in (0.0, 1.0)


def test_a_taskset_that_cannot_be_loaded_names_the_setting_and_the_fix():
    registry = build_registry()
    for settings, message in [
        (['env.taskset="no_such_taskset"'], r"env\.taskset: verifiers cannot import"),
        (
            ['env.taskset="verifiers_sum_taskset"', "env.taskset_config.color=1"],
            r"env\.taskset: verifiers cannot load .*color",
        ),
    ]:
        config = resolve_config(registry, selections={"env": "verifiers"}, overrides=settings)
        build = registry.get("env", "verifiers").build
        with pytest.raises(ValueError, match=message):
            build(config.env.config)


@pytest.mark.slow  # 80-115 s here; the endpoint tests above cover the env in the default run
def test_a_verifiers_run_trains_and_logs_the_rubric(tmp_path, checkpoint):
    """``marinrl run --env verifiers`` on a tiny Qwen3 checkpoint, 2 steps: each episode is a
    verifiers episode of tests/verifiers_sum_taskset.py's taskset, in the Ray rollout worker."""
    from marin_rl_core.metrics import read_metrics

    settings = [
        f'model.checkpoint="{checkpoint}"', "model.max_seq_len=256", "trainer.num_train_steps=2",
        "trainer.batch_size=8", "eval.n_examples=2", "eval.frequency=100", f'run_dir="{tmp_path}"',
        'env.taskset="verifiers_sum_taskset"',
    ]  # fmt: skip
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(TESTS), env.get("PYTHONPATH", "")])
    result = subprocess.run(
        [sys.executable, "-m", "marin_rl_core", "run", "--env", "verifiers", "--run-id", "vf",
         *[arg for setting in settings for arg in ("--set", setting)]],
        capture_output=True, text=True, env=env, timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    rows = read_metrics(tmp_path / "vf")
    assert [r["step"] for r in rows if r["source"] == "train"] == [1, 2]
    batches = [r for r in rows if r["source"] == "rollout" and "rollout/turns" in r]
    assert batches and all(r["rollout/env_errors"] == 0 for r in batches), rows
    for r in batches:
        assert 0.0 <= r["rollout/score/has_digit"] <= 1.0 and r["rollout/score/exact"] == 0.0
        assert r["rollout/turns"] == 1 and r["rollout/generated_tokens"] > 0
