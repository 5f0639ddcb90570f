"""Checkpoints of a LoRA run: the adapters alone, naming the base they belong to.

A run with ``[model.lora]`` trains adapters on a frozen base (:mod:`marin_rl_core.models.lora`).
Its checkpoints hold what training changes (the adapters, a loss's own state such as ppo's
critic, their optimizer state, the step and key: levanter's ``TrainerState.saveable_state``),
not the base: an 8B base would otherwise be written again at every checkpoint. The base is read
again from ``model.checkpoint`` when a run resumes, is exported or evaluated, so a checkpoint's
``state.json`` names it (:data:`BASE_KEY`, :func:`base_identity`): the checkpoint path, a
SHA-256 of its ``config.json`` and one of its weight files sampled (names, sizes, and 16 blocks
of 64 KiB spread over each file, so an 8B base is fingerprinted in milliseconds yet a different
or further-trained model is told apart). A base that no longer matches is refused, naming what
changed (:func:`base_problem`). A LoRA run on the random default model names its seed and shape.

Checkpoints of LoRA runs written before adapters-only checkpoints held the whole model; they
have no :data:`BASE_KEY` and are read whole, as before.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from marin_rl_core.errors import ConfigError
from marin_rl_core.rundir import run_path

BASE_KEY = "lora_base"
"""The ``state.json`` entry of an adapters-only checkpoint: :func:`base_identity`."""

_BLOCKS, _BLOCK = 16, 64 * 1024


def _sampled_sha256(files: list[Path]) -> str:
    digest = hashlib.sha256()
    for path in files:
        size = path.stat().st_size
        digest.update(f"{path.name}:{size}\n".encode())
        with path.open("rb") as fh:
            for i in range(_BLOCKS):
                fh.seek(max(0, min(size - _BLOCK, i * size // _BLOCKS)))
                digest.update(fh.read(_BLOCK))
    return digest.hexdigest()


def base_identity(config: Any) -> dict[str, Any]:
    """What names the base of a LoRA run of ``config``: for a Hugging Face checkpoint its path
    (as configured), ``config_sha256`` and ``weights_sha256`` (sampled, see the module
    docstring); for the random default model its seed and shape."""
    from marin_rl_core.models.pretrained import checkpoint_dir

    model = config.model
    if not model.checkpoint:
        shape = ("hidden_dim", "intermediate_dim", "num_layers", "num_heads", "num_kv_heads")
        return {
            "random_init": {"seed": config.seed, **{k: getattr(model, k) for k in shape}},
        }
    path = checkpoint_dir(model.checkpoint)
    weights = sorted([*path.glob("*.safetensors"), *path.glob("*.bin")])
    return {
        "checkpoint": model.checkpoint,
        "config_sha256": hashlib.sha256((path / "config.json").read_bytes()).hexdigest(),
        "weights_sha256": _sampled_sha256(weights),
    }


def saved_base(checkpoint: str | Path) -> dict[str, Any] | None:
    """The base an adapters-only checkpoint names, or ``None`` for a checkpoint that holds its
    whole model (no LoRA, or written before adapters-only checkpoints)."""
    try:
        state = json.loads((run_path(checkpoint) / "state.json").read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return None  # damaged: reading the checkpoint says so
    base = state.get(BASE_KEY) if isinstance(state, dict) else None
    return base if isinstance(base, dict) else None


def base_problem(checkpoint: str | Path, config: Any) -> str | None:
    """Why the adapters of ``checkpoint`` do not belong on the base ``config`` names, or
    ``None`` when they do (or the checkpoint holds its whole model). One line, with the fix."""
    saved = saved_base(checkpoint)
    if saved is None:
        return None
    now = base_identity(config)
    if saved == now:
        return None
    name = Path(str(checkpoint)).name
    if "random_init" in saved or "random_init" in now:
        was = saved.get("random_init") or {"checkpoint": saved.get("checkpoint")}
        return (
            f"the adapters of {name} were trained on the base {_short(was)}, and this config "
            f"gives {_short(now.get('random_init') or {'checkpoint': now.get('checkpoint')})}; "
            "set the run's model and seed back (its config.toml has them)"
        )
    changed = [
        what
        for key, what in (("config_sha256", "config.json"), ("weights_sha256", "weights"))
        if saved.get(key) != now.get(key)
    ]
    where = str(config.model.checkpoint)
    return (
        f"model.checkpoint {where!r} is not the base the adapters of {name} were trained on "
        f"(it was {saved.get('checkpoint')!r}; now its {' and '.join(changed) or 'path'} "
        "differ): put the original base back there, or point model.checkpoint at it"
    )


def _short(fields: dict[str, Any]) -> str:
    return ", ".join(f"{k}={v}" for k, v in fields.items())


def check_base(checkpoint: str | Path, config: Any) -> None:
    """Raise :class:`ConfigError` with :func:`base_problem`'s line when there is one."""
    problem = base_problem(checkpoint, config)
    if problem is not None:
        raise ConfigError(problem)


def trained_policy(
    checkpoint: str | Path, config: Any, tokenizer: Any, *, like: Any = None, merge: bool = True
) -> Any:
    """The policy of a run's ``checkpoint``: for a LoRA run its base (read again from
    ``model.checkpoint``, refused when it is not the one the adapters name) with the adapters
    merged in, or with them apart when ``merge`` is false. ``like``: the run's initial policy
    (:func:`~marin_rl_core.models.lora.trained_policy_like`), when the caller has it already.

    Raises:
        ConfigError: the base changed (:func:`base_problem`).
    """
    from marin_rl_core.learner.checkpoint import load_model
    from marin_rl_core.models.lora import merged, saved_part, trainable_filter, trained_policy_like

    check_base(checkpoint, config)
    if like is None:
        like = trained_policy_like(config, tokenizer)
    only = None
    if saved_base(checkpoint) is not None:
        only = saved_part(like, trainable_filter(like))
    model = load_model(checkpoint, like, only=only)
    return merged(model) if merge else model


__all__ = [
    "BASE_KEY",
    "base_identity",
    "base_problem",
    "check_base",
    "saved_base",
    "trained_policy",
]
