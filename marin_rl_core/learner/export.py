"""From a finished (or stopped) run to a Hugging Face checkpoint: ``marinrl export``.

The run's ``config.toml`` says which model was trained (the embedded tiny Llama or a Hugging Face
checkpoint) and with which tokenizer; a trainer checkpoint of the run holds the trained weights.
The export is a directory ``transformers`` loads with ``AutoModelForCausalLM.from_pretrained``
and ``AutoTokenizer.from_pretrained``: safetensors weights, the config of the model's own
architecture, the tokenizer with its chat template, and a ``generation_config.json`` whose EOS
ids are the stop tokens the run sampled with.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from marin_rl_core.config.loading import resolve_config
from marin_rl_core.errors import ConfigError
from marin_rl_core.learner.checkpoint import CHECKPOINT_DIR, latest_checkpoint, run_config_file
from marin_rl_core.registry import Registry
from marin_rl_core.rundir import run_path


def run_checkpoint(run_dir: str | Path, step: int | None = None) -> Path:
    """The trainer checkpoint of ``run_dir`` at ``step`` (the newest when ``None``).

    Raises:
        ConfigError: no such run, no checkpoint, or no checkpoint at ``step`` (the message lists
            the steps there are).
    """
    run_dir = run_path(run_dir)
    root = run_dir / CHECKPOINT_DIR
    run_config_file(run_dir)
    steps = sorted(
        int(p.name.removeprefix("step-"))
        for p in root.glob("step-*")
        if (p / "state.json").is_file()
    )
    if step is None:
        found = latest_checkpoint(run_dir)
        if found is None:
            raise ConfigError(f"{run_dir} has no checkpoint yet (nothing in {root})")
        return found
    if step not in steps:
        raise ConfigError(
            f"{run_dir} has no checkpoint at step {step}; it has "
            f"{', '.join(map(str, steps)) if steps else 'none'} (trainer.checkpoint_interval_steps "
            "sets how often they are written)"
        )
    return root / f"step-{step:06d}"


def trained_model(
    run_dir: str | Path, registry: Registry, *, step: int | None = None
) -> tuple[Any, Any, int]:
    """``(model, tokenizer, step)``: the policy of ``run_dir``'s checkpoint at ``step`` (newest
    by default), with the tokenizer the run used."""
    import json

    from marin_rl_core.learner.checkpoint import load_model
    from marin_rl_core.models.lora import merged, trained_policy_like
    from marin_rl_core.models.tokenizer import model_tokenizer

    checkpoint = run_checkpoint(run_dir, step)
    config = resolve_config(registry, files=[run_path(run_dir) / "config.toml"])
    tokenizer = model_tokenizer(config.model)
    # A LoRA run's policy is its base with the adapters merged in.
    model = merged(load_model(checkpoint, trained_policy_like(config, tokenizer)))
    return model, tokenizer, int(json.loads((checkpoint / "state.json").read_text())["step"])


def export_hf(
    run_dir: str | Path, out_dir: str | Path, registry: Registry, *, step: int | None = None
) -> tuple[Path, int]:
    """Write the policy of ``run_dir`` (at ``step``, newest by default) to ``out_dir`` as a
    Hugging Face checkpoint; returns ``(out_dir, step)``.

    Raises:
        ConfigError: as :func:`run_checkpoint`, or an ``out_dir`` that is a file or a non-empty
            directory that is not an earlier export.
    """
    from marin_rl_core.models.build import save_hf_checkpoint

    out = Path(out_dir).expanduser()
    if out.exists() and (
        not out.is_dir() or (any(out.iterdir()) and not (out / "config.json").exists())
    ):
        raise ConfigError(
            f"{out} exists and is not an empty directory or an earlier export; choose a new OUT_DIR"
        )
    model, tokenizer, trained_step = trained_model(run_dir, registry, step=step)
    save_hf_checkpoint(model, out, tokenizer=tokenizer)
    return out, trained_step


__all__ = ["export_hf", "run_checkpoint", "trained_model"]
