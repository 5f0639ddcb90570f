"""How well can the default model generalise to the held-out split at all? (supervised, no RL)

Trains the embedded tiny Llama with plain cross-entropy, full batch, on every training problem
of a math lesson (prompt -> answer + EOS) and prints exact-match accuracy (greedy, whole
response) on the training and held-out problems at a few steps. It separates "the RL loop does
not learn" from "this architecture cannot infer the held-out answers from the training ones":
on ``add_1digit`` with the swap split every shape fits the training problems perfectly, but the
two-layer model generalises to the swapped pairs only with weight decay, while the one-layer
default does without it (docs/default-task.md).

    python bench/supervised_generalization.py --seeds 0 1 2 --layers 2 1 --weight-decay 0 1.0
"""

from __future__ import annotations

import argparse
import itertools


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--layers", type=int, nargs="+", default=[2, 1])
    parser.add_argument("--weight-decay", type=float, nargs="+", default=[0.0, 1.0])
    parser.add_argument("--task", default="add_1digit")
    parser.add_argument("--eval-fraction", type=float, default=0.3)
    parser.add_argument("--split", default="swap")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--report-at", type=int, nargs="+", default=[300, 1000, 2000])
    args = parser.parse_args()

    import equinox as eqx
    import haliax as hax
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax
    from levanter.layers.attention import AttentionMask
    from marin_rl_plugins.math_env import MathEnv, MathEnvConfig

    from marin_rl_core import Rollout
    from marin_rl_core.config import ModelConfig
    from marin_rl_core.learner.training_batch import training_batch_from_rollouts
    from marin_rl_core.models.build import build_model
    from marin_rl_core.models.logprobs import next_token_logprobs
    from marin_rl_core.models.tokenizer import ArithmeticTokenizer

    tok = ArithmeticTokenizer()
    env = MathEnv(MathEnvConfig(task=args.task, eval_fraction=args.eval_fraction, split=args.split))

    def batch_of(mode: str, max_seq_len: int):
        rollouts = []
        for p in env.problems(mode):
            answer = tok.encode(p.answer) + [tok.eos_id]
            rollouts.append(
                Rollout.single_turn(
                    env_name="math",
                    lesson_id=args.task,
                    problem_id=p.id,
                    prompt_tokens=tok.encode(p.prompt, add_bos=True),
                    response_tokens=answer,
                    response_logprobs=np.zeros(len(answer)),
                    reward=1.0,
                )
            )
        n = len(rollouts)
        return training_batch_from_rollouts(rollouts, np.ones(n), max_seq_len, tok.pad_id)

    max_seq_len = ModelConfig().max_seq_len
    train, held_out = batch_of("train", max_seq_len), batch_of("eval", max_seq_len)

    @eqx.filter_jit
    def accuracy(model, batch):
        logits = model(batch.input_ids, attn_mask=AttentionMask.causal())
        target = hax.roll(batch.input_ids, -1, "position")
        right = (hax.argmax(logits, model.Vocab) == target) | (batch.loss_mask == 0)
        return jnp.mean(jnp.all(right.array, axis=1))

    print(
        f"{args.task}, split {args.split}: {train.Batch.size} training, {held_out.Batch.size} held-out problems"
    )
    for layers, wd, seed in itertools.product(args.layers, args.weight_decay, args.seeds):
        model_config = ModelConfig(num_layers=layers)
        model = build_model(model_config, tok, key=jax.random.PRNGKey(seed))
        optimizer = optax.adamw(args.lr, weight_decay=wd)
        opt_state = optimizer.init(eqx.filter(model, eqx.is_inexact_array))

        @eqx.filter_jit
        def step(model, opt_state, optimizer=optimizer):
            def loss(m):
                logprobs = next_token_logprobs(m, train.input_ids)
                return -hax.sum(logprobs * train.loss_mask).array / hax.sum(train.loss_mask).array

            grads = eqx.filter_grad(loss)(model)
            params = eqx.filter(model, eqx.is_inexact_array)
            updates, opt_state = optimizer.update(grads, opt_state, params)
            return eqx.apply_updates(model, updates), opt_state

        points = []
        for i in range(1, args.steps + 1):
            model, opt_state = step(model, opt_state)
            if i in args.report_at:
                points.append(
                    f"step {i}: train {float(accuracy(model, train)):.2f} "
                    f"held-out {float(accuracy(model, held_out)):.2f}"
                )
        print(f"{layers} layers, weight_decay {wd}, seed {seed}: " + "; ".join(points), flush=True)


if __name__ == "__main__":
    main()
