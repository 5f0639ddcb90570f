"""Run marinrl's ``Trainer`` (its whole loop: rollout storage, replay buffer, steps, publishing,
checkpoints) in one process or as one process of a trainer group; used by
tests/test_trainer_group.py.

    python tests/group_trainer.py DEVICES RUN_DIR ROLLOUTS_DIR STEPS OUT.json
                                  [--group COORDINATOR,PROCESSES,PROCESS_ID] [--lora RANK]

The rollouts are read from the ``gcs`` storage on the local directory ROLLOUTS_DIR (written by
the test before). Process 0 reads them, serves weights with ``arrow_flight`` and, after the
run, receives them back as a rollout worker would; the others follow it. Process 0 writes
OUT.json: the step reached, each step's loss, the final parameters (a checksum per leaf) and
those of the weights received. With ``--lora RANK`` the policy trains LoRA adapters, and what
is published and received is the adapters alone.
"""

from __future__ import annotations

import argparse
import json
import os
import sys


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("devices", type=int)
    parser.add_argument("run_dir")
    parser.add_argument("rollouts")
    parser.add_argument("steps", type=int)
    parser.add_argument("out")
    parser.add_argument("--group", default="")
    parser.add_argument("--lora", type=int, default=0)
    args = parser.parse_args()
    import faulthandler

    faulthandler.dump_traceback_later(
        int(os.environ.get("GROUP_TRAINER_HANG_S", "240")), exit=True
    )  # a hang shows where, then exits
    # After the XLA flags this process inherits (the suite's quick compile): the last
    # value of a flag wins.
    flags = os.environ.get("XLA_FLAGS", "")
    os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={args.devices}"
    os.environ["JAX_PLATFORMS"] = "cpu"
    from marin_rl_core.learner import multihost

    if args.group:
        coordinator, processes, process_id = args.group.split(",")
        multihost.join(coordinator, int(processes), int(process_id), timeout_s=120)

    import equinox as eqx
    import jax
    import numpy as np

    from marin_rl_core import build_registry
    from marin_rl_core.config import resolve_config
    from marin_rl_core.learner.trainer import Trainer
    from marin_rl_core.types import RunInfo

    registry = build_registry()
    config = resolve_config(
        registry,
        selections={"env": "mock", "loss": "rloo", "storage": "gcs"},
        overrides=[
            "trainer.batch_size=8",
            f"trainer.num_train_steps={args.steps}",
            "trainer.checkpoint_interval_steps=2",
            "trainer.warmup_steps=0",
            "trainer.adam_eps=0.01",
            "logging.log_every=1",
            "replay_buffer.max_rollout_step_delay=1000",
            "loss.kl_coef=0.1",
            "sampling.n_generations_per_prompt=2",
            f'storage.url="{args.rollouts}"',
            f"model.lora.rank={args.lora}",
            *(["trainer.learning_rate=0.01"] if args.lora else []),
        ],
    )
    leader = multihost.is_leader()
    storage = server = None
    if leader:
        record = registry.get("storage", "gcs")
        storage = record.build(config.storage.config, RunInfo(run_id="r", run_dir=args.run_dir))
        transfer = registry.get("weight_transfer", "arrow_flight")
        server = transfer.build(transfer.config_class()).server()
    losses: dict[int, float] = {}
    trainer = Trainer(
        config,
        registry,
        run_dir=args.run_dir,
        storage=storage,
        weight_server=server,
        log=lambda metrics, *, step, source: losses.__setitem__(step, metrics["loss"]),
    )
    started = trainer.step
    step = trainer.run() if leader else trainer.follow()

    def sums(model) -> list[float]:  # type: ignore[no-untyped-def]
        arrays = multihost.host_copy(eqx.filter(model, eqx.is_array))
        return [float(np.abs(x.astype(np.float64)).sum()) for x in jax.tree.leaves(arrays)]

    final = sums(trainer.model)
    # The trained model gathered whole on every process (collective): the leader's client
    # receives into this local copy (a model spread over the group would make its placing of
    # the received arrays a collective the followers, gone by then, never join).
    like = multihost.host_copy(trainer.model)
    if args.lora:  # a LoRA policy publishes its adapters alone
        from marin_rl_core.models.lora import adapters_of

        like = adapters_of(like)
    if not leader:
        return
    import time

    deadline = time.monotonic() + 60
    while server.served_step() != step and time.monotonic() < deadline:
        time.sleep(0.05)
    client = transfer.build(transfer.config_class()).client(server.address)
    received = client.receive(like)
    got = {
        "started": started,
        "step": step,
        "processes": jax.process_count(),
        "devices": jax.device_count(),
        "losses": {str(k): v for k, v in losses.items()},
        "params": final,
        "received_step": received.weight_step,
        "received": sums(received.model),
        "served": sums(like),
    }
    with open(args.out, "w") as f:
        json.dump(got, f)
    server.close()


if __name__ == "__main__":
    sys.exit(main())
