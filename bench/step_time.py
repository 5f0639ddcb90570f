"""Learner step time against a plain cross-entropy step of the same shape, and rollout tokens/s.

Target (issue 3): the RL step costs at most 1.3x a cross-entropy step of the same batch shape,
plus one reference-model forward when the loss uses a KL penalty. Everything is measured side by
side in this one process, on the default run config, with the same optimizer and the same jitted
step wrapper (``marin_rl_core.trainer.make_train_step``).

    python bench/step_time.py [--repeats 30] [--set trainer.batch_size=256 ...]
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--set", dest="overrides", action="append", default=[])
    args = parser.parse_args()

    import equinox as eqx
    import haliax as hax
    import jax
    import jax.numpy as jnp

    from marin_rl_core import build_registry
    from marin_rl_core.config import resolve_config
    from marin_rl_core.model import next_token_logprobs
    from marin_rl_core.rollout_manager import RolloutManager
    from marin_rl_core.tokenizer import model_tokenizer
    from marin_rl_core.trainer import initial_model, make_optimizer, make_train_step
    from marin_rl_core.training_batch import training_batch_from_rollouts

    registry = build_registry()
    config = resolve_config(registry, overrides=args.overrides)
    tokenizer = model_tokenizer(config.model)
    model = initial_model(config, tokenizer)
    lesson = config.curriculum.lessons[0]
    sampling = config.sampling_for(lesson)

    # Real rollouts from the inference engine, so the batch has realistic lengths.
    manager = RolloutManager(config, registry, model=model, tokenizer=tokenizer)
    manager.sample_batch(
        lesson.id,
        n_examples=sampling.n_prompts,
        n_generations=sampling.n_generations_per_prompt,
        mode="train",
        seed=0,
        weight_step=0,
        worker_id="bench",
    )  # compile
    gen_times, gen_tokens = [], []
    for i in range(5):
        batch, metrics = manager.sample_batch(
            lesson.id,
            n_examples=sampling.n_prompts,
            n_generations=sampling.n_generations_per_prompt,
            mode="train",
            seed=i + 1,
            weight_step=0,
            worker_id="bench",
        )
        gen_times.append(metrics["seconds"])
        gen_tokens.append(metrics["generated_tokens"])
    rollouts = batch.rollouts
    size = config.trainer.batch_size
    rollouts = (rollouts * (size // len(rollouts) + 1))[:size]
    advantages = np.random.default_rng(0).normal(size=len(rollouts)).astype(np.float32)
    tb = training_batch_from_rollouts(
        rollouts,
        advantages,
        config.model.max_seq_len,
        tokenizer.pad_id,
        temperature=sampling.temperature,
        batch_size=size,
    )

    def ce_loss(m, b, *, key=None):
        logp = next_token_logprobs(m, b.input_ids)
        loss = -hax.sum(logp * b.loss_mask).scalar() / jnp.maximum(
            hax.sum(b.loss_mask).scalar(), 1.0
        )
        return loss, {}

    def reference_forward(m, b):
        return hax.sum(next_token_logprobs(m, b.input_ids) * b.loss_mask).scalar()

    reference_forward = jax.jit(reference_forward)
    optimizer = make_optimizer(config.trainer)

    def timed(step_fn) -> list[float]:
        m = jax.tree.map(lambda x: x.copy() if eqx.is_array(x) else x, model)
        opt_state = optimizer.init(eqx.filter(m, eqx.is_inexact_array))
        key = jax.random.PRNGKey(0)
        m, opt_state, loss, _ = step_fn(tb, m, opt_state, key)  # compile
        jax.block_until_ready(loss)
        out = []
        for _ in range(args.repeats):
            start = time.perf_counter()
            m, opt_state, loss, _ = step_fn(tb, m, opt_state, key)
            jax.block_until_ready(loss)
            out.append(time.perf_counter() - start)
        return out

    def timed_forward() -> list[float]:
        jax.block_until_ready(reference_forward(model, tb))
        out = []
        for _ in range(args.repeats):
            start = time.perf_counter()
            jax.block_until_ready(reference_forward(model, tb))
            out.append(time.perf_counter() - start)
        return out

    # As the trainer does: a frozen copy of the initial model when the loss asks for one.
    loss_record = registry.get("loss", config.loss.name)
    loss_module = loss_record.build(config.loss.config)
    reference = None
    if loss_module.needs_reference_model:
        reference = jax.tree.map(lambda x: x.copy() if eqx.is_array(x) else x, model)
    rl_loss = loss_module.build(reference)
    rl_step = make_train_step(rl_loss.create_loss_fn(reference, model), optimizer)
    ce_step = make_train_step(ce_loss, optimizer)

    # Interleave the two so drift on a shared machine hits both alike.
    rl_times, ce_times = [], []
    for _ in range(3):
        ce_times += timed(ce_step)
        rl_times += timed(rl_step)
    fwd_times = timed_forward()
    rl, ce, fwd = (statistics.median(t) for t in (rl_times, ce_times, fwd_times))
    print(
        f"batch {size} x {config.model.max_seq_len} tokens, model {config.model.hidden_dim}d x "
        f"{config.model.num_layers} layers, loss {config.loss.name} (kl_coef={getattr(config.loss.config, 'kl_coef', '-')})"
    )
    print(f"cross-entropy step      {ce * 1e3:8.2f} ms (median of {len(ce_times)})")
    print(f"RL step                 {rl * 1e3:8.2f} ms (median of {len(rl_times)})")
    print(f"reference forward       {fwd * 1e3:8.2f} ms")
    if reference is None:
        print(f"RL / CE                 {rl / ce:8.2f}x   (target <= 1.30x)")
    else:
        print(f"RL / CE                 {rl / ce:8.2f}x")
        print(
            f"(RL - ref forward) / CE {(rl - fwd) / ce:8.2f}x   "
            "(target <= 1.30x: the loss needs one reference forward)"
        )
    tps = sum(gen_tokens) / sum(gen_times)
    print(
        f"rollout generation      {tps:8.0f} generated tokens/s "
        f"({sampling.n_prompts} prompts x {sampling.n_generations_per_prompt} samples, "
        f"{statistics.median(gen_times) * 1e3:.1f} ms per batch)"
    )


if __name__ == "__main__":
    main()
