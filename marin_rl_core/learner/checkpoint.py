"""Trainer checkpoints: levanter's sharded TensorStore checkpoints plus the run's own state.

Layout inside ``RUN_DIR/checkpoints/``::

    step-000050/  model/ opt_state/ step/ training_key/ ...   levanter's TensorStore arrays
                  metadata.json                                levanter's (step, time)
                  state.json                                   curriculum state, step
    latest        the name of the newest complete checkpoint

The trainer state (model, optimizer state, step, key: levanter's ``TrainerState``) is written with
:func:`levanter.checkpoint.save_checkpoint`, each device writing its own shards, and read back
with :func:`levanter.checkpoint.load_checkpoint` into whatever mesh the reader has: a checkpoint
saved on 4 devices resumes on 1 or 2, and ``marinrl export`` reads the model on one CPU. Arrays are
TensorStore data read into a template of the same structure (no pickle), so nothing executable
is ever loaded. A checkpoint counts once its ``state.json`` and levanter's ``metadata.json`` are
there: on a local disk it is written under a temporary name and renamed when complete; on a bucket
(``run_dir=gs://...``, :mod:`marin_rl_core.rundir`), where a rename copies every object, it is
written in place with ``state.json`` last. Either way a crash mid-write never leaves a checkpoint
that looks whole.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from marin_rl_core.errors import ExitCode, MarinRLError
from marin_rl_core.rundir import (
    absolute,
    is_remote,
    remove_tree,
    run_path,
    write_text,
)

CHECKPOINT_DIR = "checkpoints"
STATE_FILE = "state.json"
T = TypeVar("T")


class CheckpointError(MarinRLError):
    """A checkpoint that cannot be read (missing, of an older format, or damaged)."""

    exit_code = ExitCode.CONFIG


def _quiet_absent_leaves(record: logging.LogRecord) -> bool:
    """Drop levanter's "Unknown leaf type <class 'NoneType'>" warning: a model's absent parts
    (the ``lm_head`` of tied embeddings) are None leaves, read as nothing, and the warning only
    alarms users of ``marinrl export``."""
    return "Unknown leaf type <class 'NoneType'>" not in record.getMessage()


logging.getLogger("levanter.tensorstore_serialization").addFilter(_quiet_absent_leaves)


def run_config_file(run_dir: str | Path, *, what: str = "") -> Path:
    """``RUN_DIR/config.toml``, after checking that ``run_dir`` is a run directory.

    Raises:
        ConfigError: the directory does not exist, or is not a run (no ``config.toml``); the
            message says which and what to give instead. ``what`` prefixes it (``"--resume"``).
    """
    from marin_rl_core.errors import ConfigError

    run_dir = run_path(run_dir)
    prefix = f"{what} {run_dir}" if what else str(run_dir)
    hint = "give the directory `marinrl run` printed, e.g. runs/rl-20261122-101500"
    if not run_dir.exists():
        raise ConfigError(f"{prefix}: no such directory (looked in {absolute(run_dir)}); {hint}")
    saved = run_dir / "config.toml"
    if not saved.is_file():
        raise ConfigError(f"{prefix}: not a run directory (it has no config.toml); {hint}")
    return saved


def _root(run_dir: str | Path) -> Path:
    return run_path(run_dir) / CHECKPOINT_DIR


def save_checkpoint(
    run_dir: str | Path,
    step: int,
    *,
    trainer_state: Any,
    state: dict[str, Any] | None = None,
    files: dict[str, bytes] | None = None,
    keep: int = 2,
) -> Path:
    """Write checkpoint ``step`` (a levanter ``TrainerState``, the JSON-able ``state`` and
    ``files`` by name) and keep the newest ``keep`` of them. Returns its directory."""
    import levanter.checkpoint

    from marin_rl_core.learner.multihost import barrier, is_leader

    root = _root(run_dir)
    final = root / f"step-{step:06d}"
    # On a bucket a rename copies every object: write in place, state.json last (a checkpoint
    # without it is not complete, and a half-written one of the same step is cleared first).
    remote = is_remote(root)
    tmp = final if remote else root / f".step-{step:06d}.tmp"
    # In a trainer group every process writes its own shards; process 0 alone prepares the
    # directory and completes the checkpoint, between barriers.
    if is_leader():
        root.mkdir(parents=True, exist_ok=True)
        remove_tree(tmp)
    barrier(f"marinrl-checkpoint-{step}-begin")
    levanter.checkpoint.save_checkpoint(trainer_state, step, str(tmp), is_temporary=False)
    barrier(f"marinrl-checkpoint-{step}-written")
    if is_leader():
        for name, data in (files or {}).items():
            (tmp / name).write_bytes(data)
        (tmp / STATE_FILE).write_text(json.dumps({"step": step, **(state or {})}, indent=2))
        if not remote:
            remove_tree(final)
            os.replace(tmp, final)
        write_text(root / "latest", final.name)
        for old in sorted(root.glob("step-*"), key=lambda p: p.name)[:-keep]:
            remove_tree(old)
    barrier(f"marinrl-checkpoint-{step}-done")
    return final


def _complete(path: Path) -> bool:
    return (path / STATE_FILE).exists() and (path / "metadata.json").exists()


def checkpoints_newest_first(run_dir: str | Path) -> list[Path]:
    """A run's complete checkpoints, newest first (the ``latest`` marker's one leads)."""
    root = _root(run_dir)
    steps = sorted(root.glob("step-*"), key=lambda p: p.name, reverse=True)
    complete = [p for p in steps if _complete(p)]
    marker = root / "latest"
    try:
        named = root / marker.read_text().strip() if marker.exists() else None
    except (OSError, UnicodeDecodeError):
        named = None
    if named in complete:
        complete.remove(named)
        complete.insert(0, named)
    return complete


def latest_checkpoint(run_dir: str | Path) -> Path | None:
    """The newest complete checkpoint of a run, or ``None`` (not checked to be readable: see
    :func:`load_newest`)."""
    found = checkpoints_newest_first(run_dir)
    return found[0] if found else None


def load_newest(
    run_dir: str | Path, load: Callable[[Path], T], *, fallback: str = "resumed from {name}"
) -> tuple[Path, T, list[str]] | None:
    """``load`` the newest checkpoint of ``run_dir`` that ``load`` can read.

    A damaged checkpoint (a truncated array, a corrupt ``state.json``) is skipped for the one
    before it, and the returned warnings say so ("... is damaged and was skipped; " +
    ``fallback`` with the checkpoint used as ``{name}``); each failure's traceback goes to this
    module's logger at debug level (the run's log, not the console). Returns ``(checkpoint,
    loaded, warnings)``, or ``None`` when the run has no checkpoint.

    Raises:
        CheckpointError: every checkpoint is damaged; the message lists why.
    """
    candidates = checkpoints_newest_first(run_dir)
    if not candidates:
        return None
    problems: list[str] = []
    for path in candidates:
        try:
            loaded = load(path)
        except Exception as exc:  # noqa: BLE001 - any failure to read means "damaged"
            first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:300]
            problems.append(f"{path.name}: {type(exc).__name__}: {first}")
            logging.getLogger(__name__).info("checkpoint %s is damaged", path, exc_info=True)
            continue
        warnings = [
            f"checkpoint {problem} is damaged and was skipped; {fallback.format(name=path.name)}"
            for problem in problems
        ]
        return path, loaded, warnings
    raise CheckpointError(
        f"no checkpoint of {run_dir} can be read:\n"
        + "\n".join(f"  {p}" for p in problems)
        + f"\nStart a new run, or move the damaged ones out of {_root(run_dir)} if an older copy "
        "exists elsewhere."
    )


def resolve_checkpoint(path: str | Path) -> Path:
    """Accept a checkpoint directory or a run directory (meaning its latest checkpoint)."""
    path = run_path(path)
    if (path / "model.eqx").exists():
        raise CheckpointError(
            f"{path} is a checkpoint of an earlier marinrl (model.eqx), which this version cannot "
            "read; train again, or export it with the marinrl version that wrote it"
        )
    if _complete(path):
        return path
    found = latest_checkpoint(path)
    if found is None:
        raise CheckpointError(
            f"no checkpoint in {path} (expected {path}/{CHECKPOINT_DIR}/step-*/{STATE_FILE})"
        )
    return found


def read_state(checkpoint: str | Path) -> dict[str, Any]:
    """A checkpoint's ``state.json`` (``step``, ``curriculum``, ...).

    Raises:
        CheckpointError: the file is missing, not UTF-8 JSON, or has no integer ``step``.
    """
    path = run_path(checkpoint) / STATE_FILE
    try:
        state = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{path} cannot be read ({type(exc).__name__}: {exc})") from None
    if not isinstance(state, dict) or not isinstance(state.get("step"), int):
        raise CheckpointError(f"{path} has no integer 'step': it is damaged")
    return state


def load_trainer_state(
    checkpoint: str | Path,
    like: Any,
    *,
    axis_mapping: Any = None,
    mesh: Any = None,
    subpath: str | None = None,
) -> Any:
    """Read a checkpoint's trainer state (or its part at ``subpath``: ``"model"``, ``"step"``)
    into ``like`` (the state, or that part, or their shapes), sharded by ``axis_mapping`` over
    ``mesh`` (any number of devices)."""
    import levanter.checkpoint

    return levanter.checkpoint.load_checkpoint(
        like,
        str(checkpoint),
        subpath=subpath,
        discover_latest=False,
        axis_mapping=axis_mapping,
        mesh=mesh,
    )


def has_loss_state(checkpoint: str | Path) -> bool:
    """Whether a checkpoint holds a loss's trainable state beside the policy (``model/policy``
    and ``model/loss_state``) rather than the policy alone (``model``)."""
    return (run_path(checkpoint) / "model" / "policy").is_dir()


def load_model(checkpoint: str | Path, like: Any, *, only: Any = None) -> Any:
    """Read only a checkpoint's policy into ``like`` (a model of the same structure), replicated
    on this process's devices. A checkpoint of a loss with trainable state keeps the policy
    beside it (``model/policy``); the loss's state is not read. With ``only`` (a filter of
    ``like``: an adapters-only checkpoint, :mod:`~marin_rl_core.learner.lora_checkpoint`), that
    part is read and the rest is ``like``'s own values (the base)."""
    import equinox as eqx
    import haliax as hax
    import levanter.checkpoint

    from marin_rl_core.models.build import local_data_mesh

    if only is not None:
        read, kept = eqx.partition(like, only)
        return eqx.combine(load_model(checkpoint, read), kept)
    mesh = local_data_mesh()
    with hax.partitioning.set_mesh(mesh):
        return levanter.checkpoint.load_checkpoint(
            like,
            str(checkpoint),
            subpath="model/policy" if has_loss_state(checkpoint) else "model",
            discover_latest=False,
            axis_mapping={},
            mesh=mesh,
        )


def restore_policy_only(
    learner: Any, plan: Any, config: Any, path: Path, like: Any, *, adapters_only: bool = False
) -> tuple[Any, str]:
    """The trainer state from checkpoint ``path`` written by a loss with trainable state when
    this run's loss (its :class:`~marin_rl_core.protocols.LossPlan`, ``plan``) has none, or
    the other way round (a run switched from ``rloo`` to ``ppo``): the policy and the step resume; the loss's state starts fresh (a new critic) or is
    left behind, and so does the optimizer's state, whose structure differs (its counters go on
    from the checkpoint's step, so the learning-rate schedule continues). Returns the state and
    a note for the user saying so. ``adapters_only``: the checkpoint holds a LoRA policy's
    adapters alone (:mod:`~marin_rl_core.learner.lora_checkpoint`); ``like`` has the base."""
    import jax

    from marin_rl_core.learner.loss import TrainedModel, policy_of, with_loss_state
    from marin_rl_core.models.lora import saved_part, trainable_filter

    policy_like = policy_of(like.model)
    only = None  # an adapters-only checkpoint (a LoRA run): the base stays as it is
    if adapters_only:
        only = saved_part(policy_like, trainable_filter(policy_like))
    policy = learner.restore(
        path, policy_like, subpath="model/policy" if has_loss_state(path) else "model", only=only
    )
    step = learner.restore(path, like.step, subpath="step")
    model, _ = with_loss_state(
        plan, policy, key=jax.random.PRNGKey(config.seed + 2),
        learning_rate=config.trainer.learning_rate,
    )  # fmt: skip
    fresh = learner.init_state(model, key=jax.random.PRNGKey(config.seed + 1))
    if isinstance(model, TrainedModel):
        what = f"the {config.loss.name} loss's trainable state (its critic) starts fresh"
    else:
        what = "the trainable state of the loss that wrote it (a critic) is left behind"
    note = (
        f"checkpoint {path.name} was written by a loss "
        f"{'with' if has_loss_state(path) else 'without'} trainable state: the policy and "
        f"the step resume from it, {what}, and the optimizer's moments start fresh"
    )
    return learner.with_step(fresh, step), note
