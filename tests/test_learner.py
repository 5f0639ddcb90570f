"""The learner's train step warm-up: the first step on a batch of the warmed-up shapes does not
trace the step again, and the warm-up traces the shapes the first batch will have (issue 11: tracing it after the first rollouts arrived cost ~1 s of
start-up on a 2-core machine)."""

from __future__ import annotations

import time

import jax
import numpy as np

from marin_rl_core import build_registry
from marin_rl_core.config import resolve_config
from marin_rl_core.learner.step import Learner, plugin_loss_fn
from marin_rl_core.learner.training_batch import training_batch_from_rollouts
from marin_rl_core.models.build import initial_model
from marin_rl_core.models.tokenizer import model_tokenizer
from marin_rl_core.types import Rollout


def short_rollouts(n: int, tok, response_len: int) -> list[Rollout]:
    rng = np.random.default_rng(0)
    prompt = np.asarray(tok.encode("3+4=", add_bos=True), np.int32)
    return [
        Rollout.single_turn(
            env_name="math",
            lesson_id="add_1digit",
            problem_id=str(i),
            prompt_tokens=prompt,
            response_tokens=rng.integers(3, 12, size=response_len).astype(np.int32),
            response_logprobs=-rng.uniform(1.0, 3.0, size=response_len).astype(np.float32),
            reward=float(i % 2),
        )
        for i in range(n)
    ]


def counted_learner(max_seq_len: int):
    """An rloo learner on batches of 8 whose step appends its batch's shape to ``traces`` each
    time JAX traces it: ``(config, tok, learner, state, traces)``."""
    registry = build_registry()
    config = resolve_config(
        registry,
        selections={"env": "math", "loss": "rloo"},
        overrides=["trainer.batch_size=8", f"model.max_seq_len={max_seq_len}", "loss.kl_coef=0.0"],
    )
    tok = model_tokenizer(config.model)
    learner = Learner(config.trainer)
    inner = plugin_loss_fn(registry.get("loss", "rloo").build(config.loss.config).build(None))
    traces = []

    def counted(model, batch, *, key):  # runs in Python only while JAX traces the step
        traces.append(batch.input_ids.array.shape)
        return inner(model, batch, key=key)

    learner.set_loss(counted)
    state = learner.init_state(initial_model(config, tok), key=jax.random.PRNGKey(0))
    return config, tok, learner, state, traces


def test_a_warmed_up_step_is_not_traced_again_when_the_first_batch_comes():
    config, tok, learner, state, traces = counted_learner(16)

    def batch_of(rollouts):
        return training_batch_from_rollouts(
            rollouts, np.linspace(-1, 1, len(rollouts)), config.model.max_seq_len, tok.pad_id,
            batch_size=8, trim=True,
        )  # fmt: skip

    # What the trainer warms up with: a batch of no rollouts, the shapes of short ones.
    learner.warm_up(state, batch_of([]))
    assert traces == [(8, 8)]
    state, loss_value, _ = learner.step(state, batch_of(short_rollouts(8, tok, 3)))
    assert np.isfinite(loss_value)
    assert traces == [(8, 8)], "the first step traced its step again"
    # Longer rollouts make rows of 16 positions: a step of new shapes traces (the counter works).
    learner.step(state, batch_of(short_rollouts(8, tok, 8)))
    assert traces == [(8, 8), (8, 16)]


def test_the_step_warms_up_for_rows_as_long_as_the_first_rollouts_will_be():
    """The trainer's warm-up traces the step for the rows the rollout workers' warm-up batch
    says the first rollouts will fill (a mock job's 16 positions, not the 8 of short answers,
    which it traced for nothing); without word, short rows; and a first batch that comes
    while it still waits for word starts it no more (that step traces itself)."""
    from marin_rl_core.learner.step_updates import StepUpdates

    config, tok, learner, state, traces = counted_learner(32)
    updates = StepUpdates(config, learner.plan, learner, pad_id=tok.pad_id)
    updates.start_warm_up(state, lambda cancelled: None).finish()
    assert traces == [(8, 8)]
    updates.start_warm_up(state, lambda cancelled: 12).finish()
    assert traces == [(8, 8), (8, 16)]
    waiting = updates.start_warm_up(state, lambda cancelled: cancelled.wait(60) and None)
    start = time.monotonic()
    waiting.finish()
    assert time.monotonic() - start < 30 and not waiting.thread.is_alive()
    assert traces == [(8, 8), (8, 16)]
    # What it traced is the step a batch of such rollouts takes: not traced again.
    learner.step(state, updates.training_batch(short_rollouts(8, tok, 9), np.zeros(8)))
    assert traces == [(8, 8), (8, 16)]


def rloo_job(*, kl_coef: float):
    registry = build_registry()
    config = resolve_config(
        registry,
        selections={"env": "math", "loss": "rloo"},
        overrides=["trainer.batch_size=8", f"loss.kl_coef={kl_coef}"],
    )
    return registry, config


def test_the_kl_reference_model_enters_the_step_as_an_argument_not_as_constants(tmp_path):
    """With a KL penalty (the default), the frozen reference model is an argument of the compiled
    step. Closed over by the loss, all of its weights were compiled into the step as constants:
    gigabytes for a real model, in every compiled shape and in the compile cache's key."""
    from marin_rl_core.learner.trainer import Trainer

    registry, config = rloo_job(kl_coef=0.01)
    trainer = Trainer(config, registry, run_dir=tmp_path, storage=None)
    batch = trainer.updates.training_batch(
        short_rollouts(8, trainer.tokenizer, 3), np.linspace(-1, 1, 8).astype(np.float32)
    )
    embedding = config.model.hidden_dim * trainer.tokenizer.vocab_size * 4
    constants = trainer.learner.constant_bytes(trainer.state, batch)
    assert constants and constants[0] <= 1024 < embedding, constants[:5]
    # The step trains with the reference: the KL term is there, and zero before any update.
    _, loss, metrics = trainer.learner.step(trainer.state, batch)
    assert np.isfinite(loss) and abs(metrics["kl"]) < 1e-6


def test_a_resumed_trainer_reads_its_checkpoint_with_no_other_state_alive(tmp_path, monkeypatch):
    """Resume builds the trainer state's shapes, not a fresh state to load into: when the
    checkpoint is read, neither a second state nor the base model is alive beside it (for a
    0.6B model a fresh state alone is ~10 GB: the resume of a run that fit ran out of memory)."""
    import gc

    from marin_rl_core.learner.step import Learner
    from marin_rl_core.learner.trainer import Trainer

    registry, config = rloo_job(kl_coef=0.0)
    first = Trainer(config, registry, run_dir=tmp_path, storage=None)
    first.checkpoint()
    state_bytes = sum(x.nbytes for x in jax.tree.leaves(first.state) if hasattr(x, "nbytes"))
    del first
    gc.collect()
    before = sum(a.nbytes for a in jax.live_arrays())  # what this process holds anyway

    alive_when_read = []
    restore = Learner.restore

    def watched(self, checkpoint, like, **kwargs):
        gc.collect()
        alive_when_read.append(sum(a.nbytes for a in jax.live_arrays()))
        return restore(self, checkpoint, like, **kwargs)

    monkeypatch.setattr(Learner, "restore", watched)
    resumed = Trainer(config, registry, run_dir=tmp_path, storage=None)
    assert resumed.step == 0 and len(alive_when_read) == 1
    assert alive_when_read[0] - before < 0.25 * state_bytes, (alive_when_read, before, state_bytes)
    restored = sum(x.nbytes for x in jax.tree.leaves(resumed.state) if hasattr(x, "nbytes"))
    assert restored == state_bytes
