"""The memory check before a job starts (issue 61): a job that cannot fit stops before anything
is written (exit 3) with the estimate and the settings that would fit; one that fits prints its
estimate. The parameters are counted from shapes only, as the trainer will hold them."""

from __future__ import annotations

import json
import re

import jax
import pytest

from marin_rl_core import build_registry
from marin_rl_core.config import resolve_config
from marin_rl_core.errors import ExitCode
from marin_rl_core.job import memory
from marin_rl_core.models.build import initial_model
from marin_rl_core.models.lora import adapter_parameter_count, add_adapters, parameter_count
from marin_rl_core.models.tokenizer import model_tokenizer
from marin_rl_core.testing import write_tiny_hf_checkpoint

QWEN3_1_7B = {
    "hidden_size": 2048, "intermediate_size": 6144, "num_hidden_layers": 28,
    "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128,
    "vocab_size": 151936, "max_position_embeddings": 40960, "tie_word_embeddings": True,
}  # fmt: skip
"""Qwen3-1.7B's ``config.json`` shape (1.72B parameters with tied embeddings)."""


@pytest.fixture
def qwen3_1_7b_config_only(tmp_path):
    """A checkpoint directory of Qwen3-1.7B's shape holding its config and tokenizer but tiny
    weights: the check reads the config alone, and stops the job before any weight is read."""
    path = write_tiny_hf_checkpoint(tmp_path / "qwen3-1.7b", "qwen3")
    config = json.loads((path / "config.json").read_text())
    config.update(QWEN3_1_7B)
    config.pop("layer_types", None)  # one per layer: transformers derives them again
    (path / "config.json").write_text(json.dumps(config))
    return path


@pytest.fixture
def machine_of_24_gib(monkeypatch):
    """This check's view of the machine: 24 GiB free (the 2-core CI machine's size), whatever
    the machine running the tests has."""
    monkeypatch.setattr(
        memory, "available_memory", lambda: ("the 24.0 GiB this machine has free", 24 * 2**30, 1)
    )


def test_full_fine_tuning_of_a_1_7b_model_is_stopped_before_it_starts_naming_lora(
    cli, tmp_path, qwen3_1_7b_config_only, machine_of_24_gib
):
    result = cli(
        "run", "--model", str(qwen3_1_7b_config_only), "--env", "math",
        "--set", "model.max_seq_len=256", "--set", f'run_dir="{tmp_path / "runs"}"',
    )  # fmt: skip
    assert result.exit_code == ExitCode.CONFIG, result.output
    out = " ".join(result.output.split())
    assert "does not fit" in out and "24.0 GiB" in out
    advice = re.search(r"LoRA, ((?:--set \S+ ?)+): about ([\d.]+) GiB", out)
    assert advice and "model.lora.rank=16" in advice.group(1) and "optimizer" in out, out
    assert "Traceback" not in result.output
    assert not (tmp_path / "runs").exists(), "nothing may be written before the check"
    # Following the advice, the job fits, at the estimate it said.
    registry = build_registry()
    settings = advice.group(1).replace("--set ", "").split()
    config = resolve_config(
        registry, selections={"env": "math"},
        overrides=[f'model.checkpoint="{qwen3_1_7b_config_only}"', "model.max_seq_len=256",
                   *settings],
    )  # fmt: skip
    line = memory.check_memory(config, registry)
    assert float(re.search(r"needs about ([\d.]+) GiB", line).group(1)) == pytest.approx(
        float(advice.group(2)), abs=0.2
    )


def test_with_lora_the_same_model_fits_and_its_estimate_is_said(
    qwen3_1_7b_config_only, machine_of_24_gib
):
    registry = build_registry()

    def config(*overrides):
        return resolve_config(
            registry,
            selections={"env": "math"},
            overrides=[
                f'model.checkpoint="{qwen3_1_7b_config_only}"', "model.max_seq_len=256",
                *overrides,
            ],
        )  # fmt: skip

    # LoRA in one process, as the job would run on one accelerator (the bar's layout).
    full, lora = config(), config("model.lora.rank=16", "resources.colocate=true")
    counts = memory.model_counts(full, registry)
    assert 1.70e9 < counts.total < 1.74e9 and counts.trainable == counts.total
    lora_counts = memory.model_counts(lora, registry)
    assert lora_counts.trainable < 0.02 * lora_counts.total
    # The suggestion's count of the adapters (from the shapes) is the built model's.
    assert memory._lora_adapters(counts, 16, lora.model.lora.targets) == lora_counts.trainable
    # On this CPU the default batch's KV cache (256 sequences at once) tips it over: the check
    # says so and names the budget that fits, and with it the job fits.
    with pytest.raises(memory.DoesNotFitError) as refused:
        memory.check_memory(lora, registry)
    fraction = re.search(r"--set model\.inference_memory_fraction=([\d.]+)", str(refused.value))
    assert fraction, str(refused.value)
    smaller = config(
        "model.lora.rank=16", "resources.colocate=true",
        f"model.inference_memory_fraction={fraction.group(1)}",
    )  # fmt: skip
    line = memory.check_memory(smaller, registry)
    assert line.startswith("memory: the job needs about") and "optimizer" in line
    assert "kv cache" in line and "decode copy" in line and "float32 matmuls" in line
    assert (
        memory.estimate(lora, lora_counts).trainer["optimizer"]
        < 0.02 * (memory.estimate(full, counts).trainer["optimizer"])
    )


def test_the_counts_are_the_built_models(tmp_path):
    """Shapes only, yet the same numbers as the model the trainer builds (adapters too)."""
    registry = build_registry()
    config = resolve_config(registry, overrides=["model.lora.rank=4", "model.num_layers=2"])
    model = initial_model(config, model_tokenizer(config.model))
    adapted = add_adapters(model, config.model.lora, key=jax.random.PRNGKey(0))
    counts = memory.model_counts(config, registry)
    assert counts.total == parameter_count(adapted)
    assert counts.trainable == adapter_parameter_count(adapted)
    assert counts.frozen == parameter_count(model)


COUNT_IN_A_NEW_PROCESS = """
import json, sys
from marin_rl_core import build_registry
from marin_rl_core.config import resolve_config
from marin_rl_core.job import memory
registry = build_registry()
config = resolve_config(registry, selections={"env": "math"}, overrides=sys.argv[1:])
counts = memory.model_counts(config, registry)
print(json.dumps({"total": counts.total, "layers": counts.layers,
                  "imported": sorted({"jax", "levanter", "transformers"} & set(sys.modules))}))
"""


def test_a_models_counts_are_kept_so_the_next_start_skips_levanter(
    tmp_path, monkeypatch, qwen3_1_7b_config_only
):
    """Counting imports levanter and traces the model (~5 s of `marinrl run`'s start): the next
    start of the same model reads the kept counts and imports neither levanter nor JAX; a
    checkpoint whose config changed is counted again, and so is a damaged cache entry."""
    import subprocess
    import sys

    monkeypatch.setenv("MARINRL_CACHE_DIR", str(tmp_path / "cache"))
    registry = build_registry()
    overrides = [f'model.checkpoint="{qwen3_1_7b_config_only}"', "model.max_seq_len=256"]
    config = resolve_config(registry, selections={"env": "math"}, overrides=overrides)
    counts = memory.model_counts(config, registry)
    (kept,) = (tmp_path / "cache" / "model-counts").iterdir()

    def in_a_new_process() -> dict:
        done = subprocess.run(
            [sys.executable, "-c", COUNT_IN_A_NEW_PROCESS, *overrides],
            capture_output=True, text=True, timeout=300,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr[-3000:]
        return json.loads(done.stdout.splitlines()[-1])

    again = in_a_new_process()
    assert (again["total"], again["layers"]) == (counts.total, 28)
    assert again["imported"] == [], "the kept counts were not used"

    kept.write_text('{"total": "1.7B"')  # damaged: counted again, and kept again
    assert memory.model_counts(config, registry) == counts
    assert json.loads(kept.read_text())["total"] == counts.total

    shape = json.loads((qwen3_1_7b_config_only / "config.json").read_text())
    shape["num_hidden_layers"] = 2  # the checkpoint changed in place: not its old counts
    (qwen3_1_7b_config_only / "config.json").write_text(json.dumps(shape))
    changed = memory.model_counts(config, registry)
    assert changed.layers == 2 and changed.total < counts.total


def test_the_named_precisions_bytes_are_their_jmp_policies():
    """The memory check reads a precision's bytes without importing JAX: the same as jmp's."""
    import numpy as np

    from marin_rl_core.config.schema import PRECISIONS, TrainerConfig

    for name in [*PRECISIONS, "auto", "p=bfloat16,c=float32"]:
        for hf in (False, True):
            t = TrainerConfig(precision=name)
            mp = t.mp_policy(hf_checkpoint=hf)
            want = (np.dtype(mp.param_dtype).itemsize, np.dtype(mp.compute_dtype).itemsize)
            assert t.dtype_bytes(hf_checkpoint=hf) == want, (name, hf)
