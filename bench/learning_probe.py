"""Learning probe: does RLOO teach the tiny model add_1digit, and how fast? (single process, no Ray)

Trains a freshly initialised tiny levanter Llama with the ``rloo`` loss plugin on the ``math``
env's ``add_1digit`` lesson, sampling with marinrl's :class:`SamplingEngine` (levanter's
InferenceEngine), and evaluates greedy exact-match accuracy on the held-out split every few
steps. Prints one line per eval and a summary per seed (steps/seconds to the target accuracy,
the lowest accuracy after reaching it).

    python bench/learning_probe.py --seeds 0 1 2

Its defaults mirror the embedded job defaults (docs/default-task.md), so a change can be tried
here in a minute or two before a full ``bench/time_to_accuracy.py`` run.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
import cells  # noqa: E402


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--task", default="add_1digit")
    p.add_argument("--lead-in", default="", help="an easier task trained first (e.g. add_small)")
    p.add_argument("--lead-in-steps", type=int, default=0)
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--time-limit", type=float, default=540.0, help="training seconds per seed")
    p.add_argument(
        "--total-time-limit", type=float, default=570.0, help="seconds for the whole invocation"
    )
    p.add_argument("--n-prompts", type=int, default=32)
    p.add_argument("--n-samples", type=int, default=8)
    p.add_argument("--temperature", type=float, default=1.5)
    p.add_argument("--max-tokens", type=int, default=2)
    p.add_argument("--eval-max-tokens", type=int, default=8)
    p.add_argument("--partial-credit", type=float, default=0.5)
    p.add_argument("--split", default="swap", choices=["swap", "hash"])
    p.add_argument("--eval-fraction", type=float, default=0.3)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--lr-schedule", default="constant", choices=["cosine", "linear", "constant"])
    p.add_argument("--min-lr-ratio", type=float, default=0.1)
    p.add_argument("--max-grad-norm", type=float, default=1.0)
    p.add_argument("--weight-decay", type=float, default=0.5)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--intermediate", type=int, default=256)
    p.add_argument("--layers", type=int, default=1)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--max-seq-len", type=int, default=16)
    p.add_argument("--clip-epsilon", type=float, default=0.2)
    p.add_argument("--kl-coef", type=float, default=0.01)
    p.add_argument("--normalize-std", action="store_true")
    p.add_argument(
        "--updates-per-batch",
        type=int,
        default=1,
        help="optimizer steps on each batch (>1 reuses rollouts off-policy; the ratio is clipped)",
    )
    p.add_argument("--eval-every", type=int, default=25)
    p.add_argument("--target", type=float, default=0.8)
    p.add_argument(
        "--stop-after-target", type=int, default=100, help="steps to keep training after the target"
    )
    p.add_argument("--show", action="store_true", help="print a few greedy answers at each eval")
    p.add_argument("--json", default="", help="append per-seed summaries to this JSONL file")
    return p.parse_args()


def run_seed(args: argparse.Namespace, seed: int, deadline: float) -> dict:
    import equinox as eqx
    import jax
    from marin_rl_plugins.math_env import MathEnv, MathEnvConfig
    from marin_rl_plugins.rloo import RLOOConfig, RLOOLoss

    from marin_rl_core import Rollout, RolloutGroup
    from marin_rl_core.config import ModelConfig, TrainerConfig
    from marin_rl_core.learner.loss import step_loss
    from marin_rl_core.learner.optimizer import make_optimizer
    from marin_rl_core.learner.training_batch import training_batch_from_rollouts
    from marin_rl_core.models.build import build_model
    from marin_rl_core.models.tokenizer import ArithmeticTokenizer
    from marin_rl_core.rollout.inference import SamplingEngine, sample_prompts

    t_start = time.perf_counter()
    tok = ArithmeticTokenizer()
    model_config = ModelConfig(
        hidden_dim=args.hidden,
        intermediate_dim=args.intermediate,
        num_layers=args.layers,
        num_heads=args.heads,
        num_kv_heads=args.heads,
        max_seq_len=args.max_seq_len,
    )
    model = build_model(model_config, tok, key=jax.random.PRNGKey(seed))
    engine = SamplingEngine(model, max_seq_len=args.max_seq_len, eos_id=tok.eos_id)

    def env_for(task: str) -> MathEnv:
        return MathEnv(
            MathEnvConfig(
                task=task,
                eval_fraction=args.eval_fraction,
                partial_credit=args.partial_credit,
                split=args.split,
            )
        )

    env = env_for(args.task)
    lead_env = env_for(args.lead_in) if args.lead_in else None
    eval_problems = env.problems("eval")
    eval_prompts = [tok.encode(p.prompt, add_bos=True) for p in eval_problems]

    loss_module = RLOOLoss(
        RLOOConfig(
            kl_coef=args.kl_coef, clip_epsilon=args.clip_epsilon, normalize_std=args.normalize_std
        )
    )
    reference = model if loss_module.needs_reference_model else None
    loss_fn = loss_module.create_loss_fn(reference, model)
    optimizer = make_optimizer(
        TrainerConfig(
            num_train_steps=args.steps,
            learning_rate=args.lr,
            warmup_steps=args.warmup,
            lr_schedule=args.lr_schedule,
            min_lr_ratio=args.min_lr_ratio,
            weight_decay=args.weight_decay,
            max_grad_norm=args.max_grad_norm,
        )
    )
    opt_state = optimizer.init(eqx.filter(model, eqx.is_inexact_array))

    @eqx.filter_jit
    def train_step(model, opt_state, batch, key):
        (loss, metrics), grads = eqx.filter_value_and_grad(
            lambda m: step_loss(loss_fn, m, batch, key=key), has_aux=True
        )(model)
        updates, opt_state = optimizer.update(
            grads, opt_state, eqx.filter(model, eqx.is_inexact_array)
        )
        return eqx.apply_updates(model, updates), opt_state, metrics

    def response_text(sample) -> str:
        """The decoded response without its stop token (what the rollout side hands the env)."""
        return tok.decode(t for t in sample.tokens if t != tok.eos_id)

    train_problems = env.problems("train")
    train_prompts = [tok.encode(p.prompt, add_bos=True) for p in train_problems]

    def evaluate(problems=eval_problems, prompts=eval_prompts) -> float:
        """Greedy exact-match accuracy (how ``env.score`` grades eval problems)."""
        samples = sample_prompts(
            engine, prompts, n=1, temperature=0.0, max_tokens=args.eval_max_tokens
        )
        correct = [float(response_text(s[0]) == p.answer) for p, s in zip(problems, samples)]
        if args.show:
            shown = [
                f"{p.prompt}{tok.decode(s[0].tokens)!r}" for p, s in zip(problems[:4], samples)
            ]
            print("    greedy: " + " | ".join(shown))
        return float(np.mean(correct))

    key = jax.random.PRNGKey(10_000 + seed)
    history: list[tuple[int, float, float]] = []
    reached_step = reached_seconds = None
    train_seconds = 0.0
    setup_seconds = time.perf_counter() - t_start
    acc = evaluate()
    history.append((0, 0.0, acc))
    print(f"  seed {seed} step 0 eval_acc {acc:.3f} (setup {setup_seconds:.1f}s)", flush=True)
    step = 0
    t0 = time.perf_counter()
    metrics_log: dict[str, float] = {}
    timing = {"generate": 0.0, "train": 0.0}
    while (
        step < args.steps
        and time.perf_counter() - t0 < args.time_limit
        and time.perf_counter() < deadline
    ):
        step += 1
        use_lead = lead_env is not None and step <= args.lead_in_steps
        cur_env = lead_env if use_lead else env
        problems = cur_env.sample_problems(
            args.n_prompts, mode="train", seed=seed * 1_000_003 + step
        )
        prompts = [tok.encode(p.prompt, add_bos=True) for p in problems]
        t_gen = time.perf_counter()
        samples = sample_prompts(
            engine,
            prompts,
            n=args.n_samples,
            temperature=args.temperature,
            max_tokens=args.max_tokens,
            seed=step,
        )
        timing["generate"] += time.perf_counter() - t_gen
        rollouts, advantages = [], []
        rewards_all, exact_all, zero_var = [], [], 0
        for problem, prompt, group_samples in zip(problems, prompts, samples):
            group = []
            for s in group_samples:
                text = response_text(s)
                reward = cur_env.score(problem, text)
                exact_all.append(float(text == problem.answer))
                group.append(
                    Rollout.single_turn(
                        env_name="math",
                        lesson_id=args.task,
                        problem_id=problem.id,
                        prompt_tokens=prompt,
                        response_tokens=s.tokens,
                        response_logprobs=s.logprobs,
                        reward=reward,
                        truncated=not s.stopped,
                    )
                )
            g = RolloutGroup(rollouts=group)
            rewards_all.extend(g.rewards)
            zero_var += int(np.all(g.rewards == g.rewards[0]))
            rollouts.extend(group)
            advantages.extend(loss_module.compute_advantages(g))
        batch = training_batch_from_rollouts(
            rollouts, advantages, args.max_seq_len, tok.pad_id, temperature=args.temperature
        )
        key, sub = jax.random.split(key)
        t_train = time.perf_counter()
        for _ in range(args.updates_per_batch):
            model, opt_state, metrics = train_step(model, opt_state, batch, sub)
        engine.update_model(model)
        metrics_log = {k: float(v) for k, v in metrics.items()}
        timing["train"] += time.perf_counter() - t_train
        metrics_log.update(
            reward=float(np.mean(rewards_all)),
            exact=float(np.mean(exact_all)),
            zero_var_frac=zero_var / len(problems),
        )
        if step % args.eval_every == 0:
            acc = evaluate()
            train_acc = evaluate(train_problems, train_prompts)
            elapsed = time.perf_counter() - t0
            history.append((step, elapsed, acc))
            print(
                f"  seed {seed} step {step:4d} t {elapsed:6.1f}s eval_acc {acc:.3f} train_acc {train_acc:.3f} "
                f"train_reward {metrics_log['reward']:.3f} exact {metrics_log['exact']:.3f} "
                f"entropy {metrics_log['entropy']:.3f} zero_var {metrics_log['zero_var_frac']:.2f} "
                f"clip {metrics_log['clip_fraction']:.3f} ratio {metrics_log['ratio_mean']:.3f}"
                + (" [lead-in]" if use_lead else ""),
                flush=True,
            )
            if reached_step is None and acc >= args.target:
                reached_step, reached_seconds = step, elapsed
            if reached_step is not None and step - reached_step >= args.stop_after_target:
                break
    train_seconds = time.perf_counter() - t0
    if args.show:
        for name, problems in (("train", train_problems), ("eval", eval_problems)):
            prompts = [tok.encode(p.prompt, add_bos=True) for p in problems]
            samples = sample_prompts(
                engine, prompts, n=1, temperature=0.0, max_tokens=args.eval_max_tokens
            )
            wrong = [
                f"{p.prompt}{tok.decode(s[0].tokens)!r}"
                for p, s in zip(problems, samples)
                if response_text(s[0]) != p.answer
            ]
            print(f"  wrong {name} ({len(wrong)}): " + " ".join(wrong))
    after = [a for s, _, a in history if reached_step is not None and s >= reached_step]
    summary = {
        "seed": seed,
        "reached_step": reached_step,
        "reached_seconds": reached_seconds,
        "min_acc_after": min(after) if after else None,
        "final_acc": history[-1][2],
        "best_acc": max(a for _, _, a in history),
        "steps": step,
        "train_seconds": round(train_seconds, 1),
        "setup_seconds": round(setup_seconds, 1),
        "n_eval_problems": len(eval_problems),
        "generate_seconds": round(timing["generate"], 1),
        "train_step_seconds": round(timing["train"], 1),
    }
    print("  summary " + json.dumps(summary), flush=True)
    return summary


def main() -> None:
    # Measured in a child process (bench/cells.py): a time limit or Ctrl-C stops it at once,
    # mid-step too, the lines printed so far standing.
    if cells.measure_in_child(probe, parse_args()):
        sys.exit(1)


def probe(args: argparse.Namespace) -> None:
    print("settings " + json.dumps(vars(args)), flush=True)
    deadline = time.perf_counter() + args.total_time_limit
    summaries = []
    for seed in args.seeds:
        if time.perf_counter() >= deadline:
            print(f"  seed {seed} skipped: --total-time-limit reached", flush=True)
            continue
        summaries.append(run_seed(args, seed, deadline))
    if args.json:
        with open(args.json, "a") as f:
            for s in summaries:
                f.write(json.dumps({"settings": vars(args), **s}) + "\n")
    reached = [s for s in summaries if s["reached_step"] is not None]
    print(
        f"reached {args.target} on {len(reached)}/{len(summaries)} seeds; "
        + ", ".join(
            f"seed {s['seed']}: step {s['reached_step']} ({s['reached_seconds']:.0f}s), min after {s['min_acc_after']:.2f}"
            for s in reached
        ),
        flush=True,
    )


if __name__ == "__main__":
    main()
