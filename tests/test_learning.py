"""The product's promise: the default job learns. Slow (minutes): run with `nox -s slow`."""

from __future__ import annotations

import pytest

from marin_rl_core import build_registry
from marin_rl_core.config import resolve_config
from marin_rl_core.job.driver import RLJob
from marin_rl_core.metrics import read_metrics

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("loss", ["rloo", "grpo"])
def test_default_job_learns_single_digit_addition_on_held_out_problems(tmp_path, loss):
    """`marinrl run --loss LOSS --env math` on the embedded defaults: held-out exact-match
    accuracy on add_1digit starts near chance and ends at or above 0.8."""
    registry = build_registry()
    config = resolve_config(
        registry,
        selections={"loss": loss, "env": "math"},
        overrides=[f'run_dir="{tmp_path}"', 'run_id="learn"'],
    )
    result = RLJob(config, registry).run(progress=False)
    evals = [r for r in read_metrics(result.run_dir) if r["source"] == "eval"]
    curve = [r["eval/add_1digit/reward"] for r in evals]
    assert curve[0] <= 0.2, f"step-0 accuracy should be near chance, got {curve[0]}"
    assert curve[-1] >= 0.8, f"held-out accuracy curve: {curve}"
    train = [r for r in read_metrics(result.run_dir) if r["source"] == "train"]
    assert train[-1]["reward"] > train[0]["reward"]
