"""How much of a training batch is padding, with and without packing, on a mix of short and long
rollouts; and the RL loss's forward+backward time on each layout, side by side.

    python bench/packing.py [--rollouts 256] [--max-seq-len 128] [--repeats 5]

The mix: a third short single-turn rollouts (a 4-6 token prompt, a 2-token answer, like the
default task), a third mid-length multi-turn episodes (10-40 tokens, like the guess game or a
short tool call), a third long ones (60 tokens up to ``max_seq_len``). Without packing every
rollout takes a row of ``max_seq_len`` positions; with ``trainer.pack_rollouts`` rollouts share
rows (first fit decreasing) and the row count is rounded up to an eighth of the batch.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np


def make_rollouts(n: int, max_seq_len: int, seed: int) -> list:
    from marin_rl_core import Rollout

    rng = np.random.default_rng(seed)
    rollouts = []
    for i in range(n):
        kind = i % 3
        if kind == 0:
            prompt, length = int(rng.integers(4, 7)), None
            length = prompt + 2
        elif kind == 1:
            length = int(rng.integers(10, 41))
            prompt = 3
        else:
            length = int(rng.integers(60, max_seq_len + 1))
            prompt = int(rng.integers(10, 30))
        mask = np.zeros(length, bool)
        mask[prompt:] = True
        if kind == 1:  # observations between actions: every fourth token after the prompt
            mask[prompt + 3 :: 4] = False
        starts = [j for j in range(1, length) if mask[j] and not mask[j - 1]]
        rollouts.append(
            Rollout(
                env_name="mix",
                lesson_id="mix",
                problem_id=str(i),
                tokens=rng.integers(4, 100, length),
                loss_mask=mask,
                logprobs=np.where(mask, -2.0, 0.0),
                reward=float(rng.random()),
                turn_starts=starts,
                turn_rewards=[0.0] * len(starts),
            )  # fmt: skip
        )
    return rollouts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rollouts", type=int, default=256)
    parser.add_argument("--max-seq-len", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()

    import equinox as eqx
    import jax
    from marin_rl_plugins.rloo import RLOOConfig, RLOOLoss

    from marin_rl_core.config import ModelConfig
    from marin_rl_core.learner.loss import step_loss
    from marin_rl_core.learner.training_batch import padded_fraction, training_batch_from_rollouts
    from marin_rl_core.models.build import build_model
    from marin_rl_core.models.tokenizer import ArithmeticTokenizer

    rollouts = make_rollouts(args.rollouts, args.max_seq_len, seed=0)
    advantages = np.random.default_rng(1).normal(size=len(rollouts))
    tokenizer = ArithmeticTokenizer()
    model = build_model(
        ModelConfig(max_seq_len=args.max_seq_len), tokenizer, key=jax.random.PRNGKey(0)
    )
    loss_fn = RLOOLoss(RLOOConfig(kl_coef=0.0)).create_loss_fn(None, model)
    step = eqx.filter_jit(eqx.filter_value_and_grad(lambda m, b: step_loss(loss_fn, m, b)[0]))

    results = {}
    for name, pack in (("one rollout per row", False), ("packed", True)):
        batch = training_batch_from_rollouts(
            rollouts, advantages, args.max_seq_len, tokenizer.pad_id, pack=pack,
            row_multiple=max(1, args.rollouts // 8),
        )  # fmt: skip
        jax.block_until_ready(step(model, batch))  # compile
        times = []
        for _ in range(args.repeats):
            start = time.perf_counter()
            jax.block_until_ready(step(model, batch))
            times.append(time.perf_counter() - start)
        results[name] = (
            batch.Batch.size,
            padded_fraction(batch, rollouts),
            statistics.median(times),
        )

    tokens = sum(min(r.num_tokens, args.max_seq_len) for r in rollouts)
    print(f"{len(rollouts)} rollouts, {tokens} tokens, rows of {args.max_seq_len} positions")
    print(f"{'layout':>20} {'rows':>5} {'padded positions':>17} {'loss fwd+bwd':>13}")
    for name, (rows, padded, seconds) in results.items():
        print(f"{name:>20} {rows:>5} {padded:>16.1%} {seconds * 1000:>11.1f}ms")
    plain, packed = results["one rollout per row"], results["packed"]
    print(f"packed / unpacked step time: {packed[2] / plain[2]:.2f}")


if __name__ == "__main__":
    main()
