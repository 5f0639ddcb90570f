"""From a finished (or stopped) run to a Hugging Face checkpoint: ``marinrl export``.

The run's ``config.toml`` says which model was trained (the embedded tiny Llama or a Hugging Face
checkpoint) and with which tokenizer; a trainer checkpoint of the run holds the trained weights.
The export is a directory ``transformers`` loads with ``AutoModelForCausalLM.from_pretrained``
and ``AutoTokenizer.from_pretrained``: safetensors weights, the config of the model's own
architecture, the tokenizer with its chat template, and a ``generation_config.json`` whose EOS
ids are the stop tokens the run sampled with.
"""

from __future__ import annotations

import json
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
    from marin_rl_core.learner.lora_checkpoint import trained_policy
    from marin_rl_core.models.tokenizer import model_tokenizer

    checkpoint = run_checkpoint(run_dir, step)
    config = resolve_config(registry, files=[run_path(run_dir) / "config.toml"])
    tokenizer = model_tokenizer(config.model)
    # A LoRA run's policy is its base with the adapters merged in.
    model = trained_policy(checkpoint, config, tokenizer)
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


def export_adapter(
    run_dir: str | Path, out_dir: str | Path, registry: Registry, *, step: int | None = None
) -> tuple[Path, int, str]:
    """Write the LoRA adapters of ``run_dir``'s checkpoint (at ``step``, newest by default) to
    ``out_dir`` as a PEFT adapter folder (``adapter_config.json``, ``adapter_model.safetensors``)
    that ``peft.PeftModel.from_pretrained`` loads onto the run's base checkpoint; returns
    ``(out_dir, step, base)``, ``base`` the checkpoint it belongs on.

    Raises:
        ConfigError: as :func:`run_checkpoint`; a run without LoRA or on the random default
            model (no base checkpoint to load adapters onto); an ``out_dir`` in the way; a base
            that changed since training.
    """
    import haliax as hax
    import levanter.lora

    from marin_rl_core.learner.lora_checkpoint import trained_policy
    from marin_rl_core.models.build import local_data_mesh
    from marin_rl_core.models.pretrained import checkpoint_dir, is_hub_id
    from marin_rl_core.models.tokenizer import model_tokenizer

    run_dir = run_path(run_dir)
    checkpoint = run_checkpoint(run_dir, step)
    config = resolve_config(registry, files=[run_dir / "config.toml"])
    lora = config.model.lora
    if not lora.enabled:
        raise ConfigError(
            f"{run_dir} was trained without LoRA (model.lora.rank is 0): it has no adapters. "
            "Export the whole model instead: drop --adapter."
        )
    if not config.model.checkpoint:
        raise ConfigError(
            f"{run_dir} trained adapters on marinrl's random default model, which no other tool "
            "can load as a base: export the merged model instead (drop --adapter)."
        )
    out = Path(out_dir).expanduser()
    if out.exists() and (
        not out.is_dir() or (any(out.iterdir()) and not (out / "adapter_config.json").exists())
    ):
        raise ConfigError(
            f"{out} exists and is not an empty directory or an earlier adapter export; choose a "
            "new OUT_DIR"
        )
    tokenizer = model_tokenizer(config.model)
    model = trained_policy(checkpoint, config, tokenizer, merge=False)
    spec = config.model.checkpoint
    base = spec if is_hub_id(spec) else str(checkpoint_dir(spec))
    levanter_config = levanter.lora.LoraConfig(
        target_modules=list(lora.targets), r=lora.rank, alpha=lora.scale * lora.rank
    )
    with hax.partitioning.set_mesh(local_data_mesh()):
        levanter.lora.save_peft_pretrained(
            model, levanter_config, base, str(out), prefix="base_model.model"
        )
    trained_step = int(json.loads((checkpoint / "state.json").read_text())["step"])
    return out, trained_step, base


__all__ = ["export_adapter", "export_hf", "run_checkpoint", "trained_model"]
