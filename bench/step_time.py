"""Learner step time and peak memory against a plain levanter cross-entropy step of the same
shape, and rollout tokens/s against a bare levanter ``InferenceEngine`` loop.

Targets (issues 3, 8 and 26): the RL step costs at most 1.3x a cross-entropy step of the same
batch shape (``ppo``, with its critic, 1.6x), plus one reference-model forward when the loss uses a KL penalty, and needs at most 1.2x
its peak memory. The cross-entropy step is levanter's own ``compute_next_token_loss`` (blockwise
over the vocabulary, 32,768 tokens a block, when the vocabulary is larger than that, as one would
train a Qwen-sized vocabulary). Everything is measured side by side in this one process with the
same optimizer and the same learner (``marin_rl_core.learner.step.Learner``: levanter's trainer
machinery with the run's mesh and precision policy); peak memory is XLA's own figure for each
compiled step (temporaries, arguments and outputs).

    python bench/step_time.py [--repeats 30] [--set trainer.batch_size=256 ...]
    python bench/step_time.py --losses rloo grpo ppo   # each loss against its own CE step
    # a small Qwen3-shaped checkpoint with Qwen's real 151,936-token vocabulary:
    python bench/step_time.py --hf-vocab 151936 --set trainer.batch_size=64

The rollout figures print first, then each loss's step figures as they are measured, in a child
process (bench/cells.py): a time limit or Ctrl-C stops it at once, what was printed standing.
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
    parser.add_argument(
        "--hf-vocab",
        type=int,
        default=0,
        help="bench a tiny Qwen3 checkpoint (written to a temporary directory) with this many "
        "vocabulary rows instead of the default model",
    )
    parser.add_argument("--hf-hidden", type=int, default=128)
    parser.add_argument(
        "--losses", nargs="+", default=[], help="bench each of these losses (default: the run's)"
    )
    args = parser.parse_args()
    import cells

    # In a child process (bench/cells.py): a time limit or Ctrl-C stops it at once, the figures
    # printed so far standing.
    cells.measure_in_child(measure, args)


def measure(args: argparse.Namespace) -> None:
    if args.hf_vocab:
        import tempfile

        from marin_rl_core.tiny_checkpoints import write_tiny_hf_checkpoint

        path = write_tiny_hf_checkpoint(
            tempfile.mkdtemp(prefix="marinrl-bench-"),
            "qwen3",
            vocab_size=args.hf_vocab,
            hidden_size=args.hf_hidden,
        )
        args.overrides = [
            f'model.checkpoint="{path}"',
            "model.max_seq_len=32",
            'curriculum.lessons=[{id = "add", env_config = {task = "add_1digit"}}]',
            *args.overrides,
        ]

    from marin_rl_core import build_registry
    from marin_rl_core.config import resolve_config
    from marin_rl_core.learner.loss import batch_options, loss_plan
    from marin_rl_core.learner.training_batch import training_batch_from_rollouts
    from marin_rl_core.models.build import initial_model
    from marin_rl_core.models.tokenizer import model_tokenizer
    from marin_rl_core.rollout.manager import RolloutManager

    registry = build_registry()
    # The rollout figure compares marinrl's wrapper of levanter's engine with a bare engine loop.
    config = resolve_config(
        registry,
        selections={"loss": args.losses[0]} if args.losses else {},
        overrides=['engine.name="paged"', *args.overrides],
    )
    tokenizer = model_tokenizer(config.model)
    model = initial_model(config, tokenizer)
    lesson = config.curriculum.lessons[0]
    sampling = config.sampling_for(lesson)
    manager = RolloutManager(config, registry, model=model, tokenizer=tokenizer)
    rollout_figures = compare_rollouts(manager, config, lesson.id)
    # Real rollouts from the inference engine, so the batch has realistic lengths.
    rollouts = rollout_figures.pop("batch").rollouts
    print_rollout_figures(config, lesson.id, rollout_figures)
    print()
    size = config.trainer.batch_size
    rollouts = (rollouts * (size // len(rollouts) + 1))[:size]
    advantages = np.random.default_rng(0).normal(size=len(rollouts)).astype(np.float32)
    for name in args.losses or [config.loss.name]:
        loss_config = resolve_config(
            registry,
            selections={"loss": name},
            overrides=['engine.name="paged"', *args.overrides],
        )
        module = registry.get("loss", name).build(loss_config.loss.config)
        tb = training_batch_from_rollouts(
            rollouts,
            advantages,
            config.model.max_seq_len,
            tokenizer.pad_id,
            temperature=sampling.temperature,
            batch_size=size,
            **batch_options(loss_plan(module)),
        )
        step_figures = compare_steps(loss_config, registry, model, tb, repeats=args.repeats)
        print_step_figures(loss_config, step_figures)
        print()


def compare_rollouts(manager, config, lesson_id: str, *, calls: int = 6) -> dict:
    """Generated tokens/s of ``manager.sample_batch`` (problems, prompts, generation, scoring)
    against a bare levanter ``InferenceEngine`` loop generating for the same prompts with the
    same engine config, interleaved so that drift hits both alike. The first call of each
    compiles and is not counted. Returns the figures and the last ``batch``."""
    import haliax as hax
    import jax
    import jax.numpy as jnp
    from levanter.inference.engine import InferenceEngine, Request
    from levanter.inference.jit_scheduler import SeqDecodingParams

    from marin_rl_core.models.tokenizer import response_stop_ids

    sampling = config.sampling_for(manager.lessons[lesson_id])
    tokenizer = manager.tokenizer
    engine = manager._engine
    bare = InferenceEngine.from_model_with_config(
        model=engine.model, tokenizer=None, config=engine._config
    )
    stops = list(response_stop_ids(tokenizer, sampling.stop_tokens))
    stop_array = hax.named(
        jnp.asarray([[t] for t in stops], dtype=jnp.int32), ("stop_seq", "position")
    )

    def bare_generate(prompts, seed):
        requests = [
            Request(
                prompt_tokens=[int(t) for t in p],
                request_id=j,
                decode_params=SeqDecodingParams(
                    max_num_tokens=jnp.asarray(
                        len(p) + min(sampling.max_tokens, config.model.max_seq_len - len(p)),
                        dtype=jnp.int32,
                    ),
                    stop_tokens=stop_array,
                    temperature=jnp.asarray(sampling.temperature, dtype=jnp.float32),
                    key=jax.random.PRNGKey(seed * 1000 + j),
                ),
                n_generations=sampling.n_generations_per_prompt,
                enable_logprobs=True,
            )
            for j, p in enumerate(prompts)
        ]
        out = bare.generate(requests)
        return sum(len(t) for t in out.tokens)

    # levanter's paged engine compiles its prefill twice: for the fresh cache of the first call,
    # and for the cache with the sharding that call gave it. Both before anything is timed.
    manager.sample_batch(
        lesson_id,
        n_examples=sampling.n_prompts,
        n_generations=sampling.n_generations_per_prompt,
        mode="train",
        seed=0,
        weight_step=0,
        worker_id="bench",
    )
    gen_times, gen_tokens, bare_times, bare_tokens = [], [], [], []
    for i in range(calls):
        start = time.perf_counter()
        batch, metrics = manager.sample_batch(
            lesson_id,
            n_examples=sampling.n_prompts,
            n_generations=sampling.n_generations_per_prompt,
            mode="train",
            seed=i + 1,
            weight_step=0,
            worker_id="bench",
        )
        elapsed = time.perf_counter() - start
        prompts = [g.rollouts[0].prompt_tokens for g in batch.groups]
        start = time.perf_counter()
        n_bare = bare_generate(prompts, i + 1)
        bare_elapsed = time.perf_counter() - start
        if i == 0:
            continue  # the first call of each compiles
        gen_times.append(elapsed)
        gen_tokens.append(metrics["generated_tokens"])
        bare_times.append(bare_elapsed)
        bare_tokens.append(n_bare)
    return {
        "batch": batch,
        "tokens_per_second": sum(gen_tokens) / sum(gen_times),
        "bare_tokens_per_second": sum(bare_tokens) / sum(bare_times),
        "seconds_per_batch": statistics.median(gen_times),
        "bare_seconds_per_batch": statistics.median(bare_times),
    }


def print_rollout_figures(config, lesson_id: str, figures: dict) -> None:
    sampling = config.sampling_for(
        next(lesson for lesson in config.curriculum.lessons if lesson.id == lesson_id)
    )
    tps, bare_tps = figures["tokens_per_second"], figures["bare_tokens_per_second"]
    print(
        f"rollouts via marinrl    {tps:8.0f} generated tokens/s "
        f"({sampling.n_prompts} prompts x {sampling.n_generations_per_prompt} samples, "
        f"{figures['seconds_per_batch'] * 1e3:.1f} ms per batch: problems, prompts, generation, "
        "scoring)"
    )
    print(
        f"bare levanter engine    {bare_tps:8.0f} generated tokens/s "
        f"({figures['bare_seconds_per_batch'] * 1e3:.1f} ms per batch, same prompts and engine "
        "config)"
    )
    print(f"marinrl / bare engine   {tps / bare_tps:8.2f}x   (target >= 0.90x)")


def compare_steps(config, registry, model, tb, *, repeats: int, rounds: int = 3) -> dict:
    """The learner's RL step (the run's loss plugin, as the trainer builds it) against levanter's
    cross-entropy step on the same batch ``tb``, each on its own ``Learner`` with a fresh state,
    interleaved ``rounds`` times so that drift hits both alike; a reference-model forward;
    XLA's peak memory of each compiled step; the RL step's constants; the loss of the RL
    step's first step. Times are medians in seconds."""
    import dataclasses

    import equinox as eqx
    import haliax as hax
    import jax
    import jax.numpy as jnp
    from levanter.models.lm_model import LmExample, compute_next_token_loss

    from marin_rl_core.learner.loss import loss_plan, with_loss_state
    from marin_rl_core.learner.step import Learner, plugin_loss_fn
    from marin_rl_core.models.logprobs import next_token_logprobs

    vocab = model.Vocab.size
    ce_block = 32_768 if vocab > 32_768 else None
    ce_model = (
        dataclasses.replace(
            model,
            transformer=dataclasses.replace(
                model.transformer,
                config=dataclasses.replace(model.config, cross_entropy_block_size=ce_block),
            ),
        )
        if ce_block
        else model
    )

    def ce_loss(m, b, *, key=None):
        # levanter's mask is on the token predicted; ours on the position predicting it.
        mask = hax.roll(b.loss_mask, 1, b.Pos).astype(jnp.int32)
        example = hax.vmap(lambda ids, lm: LmExample.causal(ids, loss_mask=lm), b.Batch)(
            b.input_ids, mask
        )
        per_token = compute_next_token_loss(m, example, key=key, reduction=None)
        # Unreduced (levanter's masked mean asks jnp.mean for a float `where`), then the mean
        # over response tokens, as the RL loss normalises.
        total = hax.sum(per_token * example.loss_mask).scalar()
        return total / jnp.maximum(hax.sum(example.loss_mask).scalar(), 1), {}

    def reference_forward(m, b):
        return hax.sum(next_token_logprobs(m, b.input_ids) * b.loss_mask).scalar()

    reference_forward = jax.jit(reference_forward)

    def copy(tree):
        return jax.tree.map(lambda x: x.copy() if eqx.is_array(x) else x, tree)

    first_loss = []

    def timed(learner, like, *, memory: list) -> list[float]:
        state = learner.init_state(copy(like), key=jax.random.PRNGKey(0))
        if not memory:  # XLA's figure, from the compiled step: nothing runs twice for it
            memory.append(learner.peak_memory_bytes(state, tb))
            if learner is rl_learner:
                constants.extend(learner.constant_bytes(state, tb))
        state, loss, _ = learner.step(state, tb)  # compile
        if learner is rl_learner and not first_loss:
            first_loss.append(loss)
        out = []
        for _ in range(repeats):
            start = time.perf_counter()
            state, _, _ = learner.step(state, tb)  # returns host floats: the step is done
            out.append(time.perf_counter() - start)
        return out

    def timed_forward() -> list[float]:
        jax.block_until_ready(reference_forward(model, tb))
        out = []
        for _ in range(repeats):
            start = time.perf_counter()
            jax.block_until_ready(reference_forward(model, tb))
            out.append(time.perf_counter() - start)
        return out

    # As the trainer does: a frozen copy of the initial model when the loss asks for one.
    loss_module = registry.get("loss", config.loss.name).build(config.loss.config)
    hf = bool(config.model.checkpoint)
    rl_learner = Learner(config.trainer, hf_checkpoint=hf)
    reference = None
    if loss_module.needs_reference_model:
        reference = rl_learner.shard(rl_learner.mp.cast_to_compute(copy(model)))
    loss_module = loss_module.build(reference)
    # A critic, when the loss has one, is trained with the policy.
    rl_model, state_lr = with_loss_state(
        loss_plan(loss_module),
        model,
        key=jax.random.PRNGKey(2),
        learning_rate=config.trainer.learning_rate,
    )
    rl_learner.set_loss(
        plugin_loss_fn(loss_module), reference=reference, state_learning_rate=state_lr
    )
    ce_learner = Learner(config.trainer, hf_checkpoint=hf)
    ce_learner.set_loss(ce_loss)

    rl_times, ce_times, ce_mem, rl_mem, constants = [], [], [], [], []
    for _ in range(rounds):
        ce_times += timed(ce_learner, ce_model, memory=ce_mem)
        rl_times += timed(rl_learner, rl_model, memory=rl_mem)
    fwd_times = timed_forward() if reference is not None else [0.0]
    return {
        "sizes": rl_learner.sizes,
        "precision": str(rl_learner.mp),
        "devices": jax.device_count(),
        "ce_seconds": statistics.median(ce_times),
        "rl_seconds": statistics.median(rl_times),
        "ce_steps": len(ce_times),
        "rl_steps": len(rl_times),
        "reference_forward_seconds": statistics.median(fwd_times),
        "kl": reference is not None,
        "ce_peak_bytes": ce_mem[0],
        "rl_peak_bytes": rl_mem[0],
        "rl_first_loss": first_loss[0],
        "largest_constant_bytes": max(constants, default=0),
        "constant_bytes": sum(constants),
        "ce_block": ce_block,
        "vocab": vocab,
        "tokens": int(tb.input_ids.array.size),
        "rows": tb.Batch.size,
        "positions": tb.Pos.size,
    }


def print_step_figures(config, f: dict) -> None:
    print(f"learner: {f['sizes']} on {f['devices']} device(s), precision {f['precision']}")
    print(
        f"batch {f['rows']} x {f['positions']} tokens, loss {config.loss.name} "
        f"(kl_coef={getattr(config.loss.config, 'kl_coef', '-')})"
    )
    rl, ce, fwd = f["rl_seconds"], f["ce_seconds"], f["reference_forward_seconds"]
    print(f"cross-entropy step      {ce * 1e3:8.2f} ms (median of {f['ce_steps']})")
    print(f"RL step                 {rl * 1e3:8.2f} ms (median of {f['rl_steps']})")
    print(f"reference forward       {fwd * 1e3:8.2f} ms")
    full_logits = f["tokens"] * f["vocab"] * 4
    ce_mem, rl_mem = f["ce_peak_bytes"], f["rl_peak_bytes"]
    print(
        f"peak memory             CE {ce_mem / 2**20:8.1f} MiB, RL {rl_mem / 2**20:8.1f} MiB: "
        f"RL / CE {rl_mem / ce_mem:.2f}x (target <= 1.20x; one fp32 [batch, position, vocab] "
        f"array would be {full_logits / 2**20:.0f} MiB, vocab {f['vocab']}"
        + (f", levanter CE blocks of {f['ce_block']}" if f["ce_block"] else "")
        + ")"
    )
    print(
        f"step constants          {f['constant_bytes']} bytes in all, the largest "
        f"{f['largest_constant_bytes']} bytes (frozen models are arguments, never constants)"
    )
    if not f["kl"]:
        print(f"RL / CE                 {rl / ce:8.2f}x   (target <= 1.30x)")
    else:
        print(f"RL / CE                 {rl / ce:8.2f}x")
        print(
            f"(RL - ref forward) / CE {(rl - fwd) / ce:8.2f}x   "
            "(target <= 1.30x: the loss needs one reference forward)"
        )


if __name__ == "__main__":
    main()
