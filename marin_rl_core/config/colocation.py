"""``resources.colocate``: whether the trainer and the sampler share one process and its devices.

``"auto"`` is decided when the config is resolved, from what this machine has (read without
starting JAX): colocated for a local job (no ``ray_address``) on a machine with exactly one
accelerator, one rollout worker and one trainer host; apart otherwise. The resolved config holds
``true`` or ``false``, so a saved ``config.toml`` (and every worker reading it) keeps the choice.
A colocated job that sets no ``replay_buffer.max_rollout_step_delay`` is on-policy (0): the
sampler generates each step's batch with the weights the trainer has just published, and the
two take turns on the devices. A colocated local job on a machine with accelerators whose
``resources.trainer`` names none asks Ray for all of them (Ray shows an actor that asks for no
GPU none).
"""

from __future__ import annotations

import glob
import os
from collections.abc import Mapping
from typing import Any

import attrs

from marin_rl_core.config.schema import RLJobConfig
from marin_rl_core.errors import ConfigError


def local_accelerators() -> tuple[str, int]:
    """``("GPU", n)``, ``("TPU chip", n)`` or ``("", 0)``: this machine's accelerators, as device
    files and ``CUDA_VISIBLE_DEVICES`` show them (JAX is not started for this)."""
    gpus = [p for p in glob.glob("/dev/nvidia*") if p[len("/dev/nvidia") :].isdigit()]
    if gpus:
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        if visible is not None:
            return "GPU", len([d for d in visible.split(",") if d.strip() and d.strip() != "-1"])
        return "GPU", len(gpus)
    chips = [p for p in glob.glob("/dev/accel*") if p[len("/dev/accel") :].isdigit()]
    if chips:
        return "TPU chip", len(chips)
    return "", 0


def _asks_for_devices(given: Mapping[str, Any]) -> bool:
    """Whether the user set the trainer's GPUs or custom resources (a TPU count)."""
    resources = given.get("resources")
    trainer = resources.get("trainer") if isinstance(resources, Mapping) else None
    return isinstance(trainer, Mapping) and ("num_gpus" in trainer or "custom" in trainer)


def resolve_colocation(
    config: RLJobConfig,
    given: Mapping[str, Any],
    notes: list[str] | None,
    accelerators: tuple[str, int] | None = None,
) -> RLJobConfig:
    """``config`` with ``resources.colocate`` decided (see the module docstring).

    Args:
        given: the config's data as the user gave it (files, ``--set``), to tell a setting
            left to its default from one set.
        notes: sentences about what was chosen, appended (the CLI prints them).
        accelerators: what :func:`local_accelerators` would say (tests pass their own).

    Raises:
        ConfigError: colocation asked for with more than one rollout worker or trainer host.
    """
    resources = config.resources
    colocate = resources.colocate
    said: list[str] = []
    kind, count = local_accelerators() if accelerators is None else accelerators
    if colocate == "auto":
        colocate = bool(
            count == 1
            and not config.ray_address
            and config.num_rollout_workers == 1
            and resources.trainer_hosts == 1
        )
        if colocate:
            said.append(
                f"resources.colocate = true: this machine has one {kind}, so the trainer and the "
                "sampler share it in one process (set resources.colocate=false to run them apart)"
            )
    elif colocate:
        wrong = []
        if config.num_rollout_workers != 1:
            wrong.append(f"num_rollout_workers = {config.num_rollout_workers}")
        if resources.trainer_hosts != 1:
            wrong.append(f"resources.trainer_hosts = {resources.trainer_hosts}")
        if wrong:
            raise ConfigError(
                f"$.resources.colocate: a colocated job runs one sampler inside the trainer's one "
                f"process, but {' and '.join(wrong)}: set them to 1, or resources.colocate=false "
                "to run the trainer and rollout workers apart"
            )
    resources = attrs.evolve(resources, colocate=colocate)
    if colocate and count and not config.ray_address and not _asks_for_devices(given):
        # Ray shows an actor that asks for no GPU none of them: the process asks for them all.
        if kind == "GPU":
            trainer = attrs.evolve(resources.trainer, num_gpus=float(count))
        else:
            trainer = attrs.evolve(
                resources.trainer, custom={**resources.trainer.custom, "TPU": float(count)}
            )
        resources = attrs.evolve(resources, trainer=trainer)
        said.append(
            f"resources.trainer asks Ray for this machine's {count} {kind}(s): the colocated "
            "process trains and samples on them"
        )
    config = attrs.evolve(config, resources=resources)
    replay = given.get("replay_buffer")
    if colocate and not (isinstance(replay, Mapping) and "max_rollout_step_delay" in replay):
        config = attrs.evolve(
            config, replay_buffer=attrs.evolve(config.replay_buffer, max_rollout_step_delay=0)
        )
        said.append(
            "replay_buffer.max_rollout_step_delay = 0: a colocated job generates each step's "
            "batch with the weights just trained (on-policy), generation and training taking turns"
        )
    if notes is not None:
        notes.extend(said)
    return config
