"""Run marinrl's ``Trainer`` (its whole loop: rollout storage, replay buffer, steps, publishing,
checkpoints) in one process or as one process of a trainer group; used by
tests/test_trainer_group.py.

    python tests/group_trainer.py DEVICES STEPS --run RUN_DIR,ROLLOUTS_DIR,OUT.json,LORA_RANK
                                  [--run ...] [--group COORDINATOR,PROCESSES,PROCESS_ID]

Each ``--run`` is one training run, one after the other in the same process (or group: a process
start and ``jax.distributed``'s join paid once). The rollouts are read from the ``gcs`` storage
on the local directory ROLLOUTS_DIR (written by the test before). Process 0 reads them, serves
weights with ``arrow_flight`` and, after the run, receives them back as a rollout worker would;
the others follow it. Process 0 writes OUT.json: the step reached, each step's loss, the final
parameters (a checksum per leaf) and those of the weights received. With a LORA_RANK above 0 the
policy trains LoRA adapters, and what is published and received is the adapters alone.
"""

from __future__ import annotations

import argparse
import json
import os
import sys


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("devices", type=int)
    parser.add_argument("steps", type=int)
    parser.add_argument("--run", action="append", required=True)
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

    import faulthandler

    for run in args.run:
        run_dir, rollouts, out, lora = run.split(",")
        faulthandler.dump_traceback_later(
            int(os.environ.get("GROUP_TRAINER_HANG_S", "240")), exit=True
        )  # a hang shows where, then exits
        train(run_dir, rollouts, args.steps, out, int(lora))
    faulthandler.cancel_dump_traceback_later()


def train(run_dir: str, rollouts: str, steps: int, out: str, lora: int) -> None:
    import equinox as eqx
    import jax
    import numpy as np

    from marin_rl_core import build_registry
    from marin_rl_core.config import resolve_config
    from marin_rl_core.learner import multihost
    from marin_rl_core.learner.trainer import Trainer
    from marin_rl_core.types import RunInfo

    registry = build_registry()
    config = resolve_config(
        registry,
        selections={"env": "mock", "loss": "rloo", "storage": "gcs"},
        overrides=[
            "trainer.batch_size=8",
            f"trainer.num_train_steps={steps}",
            "trainer.checkpoint_interval_steps=2",
            "trainer.warmup_steps=0",
            "trainer.adam_eps=0.01",
            "logging.log_every=1",
            "replay_buffer.max_rollout_step_delay=1000",
            "loss.kl_coef=0.1",
            "sampling.n_generations_per_prompt=2",
            f'storage.url="{rollouts}"',
            f"model.lora.rank={lora}",
            *(["trainer.learning_rate=0.01"] if lora else []),
        ],
    )
    leader = multihost.is_leader()
    storage = server = None
    if leader:
        record = registry.get("storage", "gcs")
        storage = record.build(config.storage.config, RunInfo(run_id="r", run_dir=run_dir))
        transfer = registry.get("weight_transfer", "arrow_flight")
        server = transfer.build(transfer.config_class()).server()
    losses: dict[int, float] = {}
    trainer = Trainer(
        config,
        registry,
        run_dir=run_dir,
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
    if lora:  # a LoRA policy publishes its adapters alone
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
    with open(out, "w") as f:
        json.dump(got, f)
    server.close()


if __name__ == "__main__":
    sys.exit(main())
