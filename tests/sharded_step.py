"""Run marinrl's learner (levanter's trainer machinery) on N simulated CPU devices; used by
tests/test_sharding.py, one process per device count (XLA fixes it when JAX starts).

    python tests/sharded_step.py DEVICES OUT.npz [--layout NAME=OVERRIDE,...] [--save DIR] [--load DIR]
                                 [--group COORDINATOR,PROCESSES,PROCESS_ID]

For each layout (a name and ``--set``-style overrides of ``[trainer]``), two RL steps on fixed
batches from the same initial weights; OUT.npz holds each layout's losses, gradient norms and
parameters after each step. ``--save DIR`` writes the first layout's checkpoint after step 1;
``--load DIR`` restores that checkpoint into this process's mesh and takes step 2 from it.
``--group`` makes this process one of a trainer group (``jax.distributed`` on CPU with gloo):
DEVICES simulated devices in each process, one mesh over all of them; process 0 writes OUT.npz.
"""

from __future__ import annotations

import argparse
import os
import sys


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("devices", type=int)
    parser.add_argument("out")
    parser.add_argument("--layout", action="append", default=[])
    parser.add_argument("--save")
    parser.add_argument("--load")
    parser.add_argument("--group", default="")
    args = parser.parse_args()
    # After the XLA flags this process inherits (the suite's quick compile): the last
    # value of a flag wins.
    flags = os.environ.get("XLA_FLAGS", "")
    os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={args.devices}"
    from marin_rl_core.deferred_imports import defer

    defer()  # as in marinrl's own processes: what levanter imports and these need not
    os.environ["JAX_PLATFORMS"] = "cpu"
    from marin_rl_core.learner import multihost

    if args.group:
        coordinator, processes, process_id = args.group.split(",")
        multihost.join(coordinator, int(processes), int(process_id), timeout_s=120)
        args.devices *= int(processes)

    from types import SimpleNamespace

    import jax
    import numpy as np

    from marin_rl_core import build_registry
    from marin_rl_core.config import resolve_config
    from marin_rl_core.learner.checkpoint import save_checkpoint
    from marin_rl_core.learner.step import Learner, plugin_loss_fn
    from marin_rl_core.learner.training_batch import training_batch_from_rollouts
    from marin_rl_core.models.build import initial_model
    from marin_rl_core.models.tokenizer import model_tokenizer
    from marin_rl_core.types import Rollout

    assert jax.device_count() == args.devices, jax.devices()
    registry = build_registry()
    # A large Adam epsilon makes each update proportional to its gradient where the gradient is
    # small, so rounding noise in a near-zero gradient (summed in another order on another mesh)
    # cannot flip a whole +-learning_rate step.
    base = [
        "trainer.batch_size=8",
        "trainer.warmup_steps=0",
        "trainer.adam_eps=0.01",
        "loss.kl_coef=0.1",
    ]

    def batch(step: int, config) -> object:  # type: ignore[no-untyped-def]
        rng = np.random.default_rng(step)
        # Equal response lengths: every micro-batch then holds as many loss tokens as any other,
        # so accumulating micro-batch means equals the mean over the whole batch.
        rollouts = [
            Rollout.single_turn(
                env_name="math",
                lesson_id="add_1digit",
                problem_id=str(i),
                prompt_tokens=rng.integers(3, 100, size=int(rng.integers(3, 6))).astype(np.int32),
                response_tokens=rng.integers(3, 100, size=4).astype(np.int32),
                response_logprobs=-rng.uniform(3.0, 6.0, size=4).astype(np.float32),
                reward=float(i % 2),
            )
            for i in range(8)
        ]
        advantages = rng.normal(size=8).astype(np.float32)
        return training_batch_from_rollouts(
            rollouts, advantages, config.model.max_seq_len, 0, temperature=1.5
        )

    def flat(model) -> list[np.ndarray]:  # type: ignore[no-untyped-def]
        import equinox as eqx

        # Gathered from every process of a group (all of them take part).
        return jax.tree.leaves(multihost.host_copy(eqx.filter(model, eqx.is_array)))

    out: dict[str, np.ndarray] = {}
    layouts = [x.split("=", 1) for x in args.layout] or [["default", ""]]
    for i, (name, overrides) in enumerate(layouts):
        extra = [f"trainer.{o}" for o in overrides.split(",") if o]
        config = resolve_config(registry, overrides=base + extra)
        # 168 rows of LM head (the tokenizer's 167, padded): divisible by the devices, so the
        # FSDP layouts compute log-probabilities vocabulary-parallel, as a real vocabulary does.
        model = initial_model(
            config, SimpleNamespace(vocab_size=model_tokenizer(config.model).vocab_size + 1)
        )
        loss = registry.get("loss", "rloo").build(config.loss.config)
        learner = Learner(config.trainer)
        reference = learner.shard(
            jax.tree.map(lambda x: x.copy() if hasattr(x, "copy") else x, model)
        )
        # As the trainer does: the reference model is an argument of the step, not a constant
        # (a group cannot compile in arrays spread over other processes' devices).
        learner.set_loss(plugin_loss_fn(loss.build(reference)), reference=reference)
        state = learner.init_state(model, key=jax.random.PRNGKey(1))
        out[f"{name}/sizes"] = np.asarray(
            [learner.sizes[k] for k in ("data_parallel", "fsdp", "tensor_parallel")]
        )
        if args.load and i == 0:
            from marin_rl_core.learner.checkpoint import resolve_checkpoint

            state = learner.restore(resolve_checkpoint(args.load), state)
            first = 2
        else:
            first = 1
        layout = [
            (x.sharding, x.ndim) for x in jax.tree.leaves(state.model) if hasattr(x, "sharding")
        ]
        for step in range(first, 3):
            state, loss_value, metrics = learner.step(state, batch(step, config))
            out[f"{name}/loss{step}"] = np.asarray(loss_value)
            out[f"{name}/grad_norm{step}"] = np.asarray(metrics["grad_norm"])
            for j, leaf in enumerate(flat(state.model)):
                out[f"{name}/params{step}/{j}"] = leaf
            if args.save and i == 0 and step == 1:
                save_checkpoint(args.save, 1, trainer_state=state, state={})
        # The parameters' sharding, for the record: FSDP and TP split them, DP does not.
        shards = {
            len(x.sharding.device_set)
            for x in jax.tree.leaves(state.model)
            if hasattr(x, "sharding")
        }
        # A step gives the parameters back placed as they came in (a mesh axis of size 1 may
        # drop out of a sharding's spec: the same placement, and no new compile).
        after = [x.sharding for x in jax.tree.leaves(state.model) if hasattr(x, "sharding")]
        out[f"{name}/same_layout"] = np.asarray(
            len(after) == len(layout)
            and all(a.is_equivalent_to(b, ndim) for a, (b, ndim) in zip(after, layout, strict=True))
        )
        out[f"{name}/max_devices_per_leaf"] = np.asarray(max(shards))
        out[f"{name}/sharded"] = np.asarray(
            any(
                not x.sharding.is_fully_replicated
                for x in jax.tree.leaves(state.model)
                if hasattr(x, "sharding")
            )
        )
    if multihost.is_leader():
        np.savez(args.out, **out)


if __name__ == "__main__":
    sys.exit(main())
