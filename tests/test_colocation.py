"""One accelerator is enough (issue 49): a colocated job (``resources.colocate``: the trainer
and the sampler in one process, the sampler reading the trainer's weights in place; ``auto``
decided from the machine's accelerators; on-policy, stops on Ctrl-C and resumes), and defaults
that fit a pretrained chat model (``--model``)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import attrs
import jax.numpy as jnp
import pytest

from marin_rl_core import ExitCode, build_registry
from marin_rl_core.config import resolve_config
from marin_rl_core.config.checkpoint_defaults import checkpoint_defaults
from marin_rl_core.config.colocation import resolve_colocation
from marin_rl_core.errors import ConfigError, WeightMismatchError
from marin_rl_core.job.colocated import LocalTransfer
from marin_rl_core.learner.checkpoint import latest_checkpoint
from marin_rl_core.metrics import read_metrics


@pytest.fixture(scope="module")
def registry():
    return build_registry()


def _decide(registry, accelerators, *overrides, given=None):
    notes: list[str] = []
    config = resolve_config(registry, overrides=list(overrides))  # decided for this machine
    auto = attrs.evolve(config.resources, colocate="auto")
    config = attrs.evolve(config, resources=auto)
    config = resolve_colocation(config, given or {}, notes, accelerators=accelerators)
    return config, notes


def test_auto_colocates_on_a_machine_with_one_accelerator_and_says_so(registry):
    config, notes = _decide(registry, ("GPU", 1))
    assert config.resources.colocate is True
    assert config.replay_buffer.max_rollout_step_delay == 0  # on-policy by default
    assert any("this machine has one GPU" in n for n in notes)
    assert any("max_rollout_step_delay = 0" in n for n in notes)
    # Ray shows an actor that asks for no GPU none: the one process asks for the machine's.
    assert config.resources.trainer.num_gpus == 1.0
    assert any("asks Ray for this machine's 1 GPU(s)" in n for n in notes)
    given = {"resources": {"trainer": {"num_gpus": 0.5}}}
    config, _ = _decide(registry, ("GPU", 1), "resources.trainer.num_gpus=0.5", given=given)
    assert config.resources.colocate is True and config.resources.trainer.num_gpus == 0.5


@pytest.mark.parametrize(
    ("accelerators", "overrides"),
    [
        (("", 0), ()),  # a CPU machine: the default task runs as before
        (("GPU", 2), ()),
        (("GPU", 1), ('ray_address="127.0.0.1:6379"',)),  # a cluster: not this machine's GPU
        (("GPU", 1), ("num_rollout_workers=2",)),
    ],
)
def test_auto_runs_apart_otherwise(registry, accelerators, overrides):
    config, notes = _decide(registry, accelerators, *overrides)
    assert config.resources.colocate is False
    assert config.replay_buffer.max_rollout_step_delay == 1 and not notes


def test_a_staleness_the_user_set_is_kept(registry):
    config, _ = _decide(
        registry,
        ("GPU", 1),
        "replay_buffer.max_rollout_step_delay=2",
        given={"replay_buffer": {"max_rollout_step_delay": 2}},
    )
    assert config.resources.colocate is True and config.replay_buffer.max_rollout_step_delay == 2


def test_colocation_with_several_workers_is_refused_naming_the_settings(registry):
    with pytest.raises(ConfigError) as info:
        resolve_config(registry, overrides=["resources.colocate=true", "num_rollout_workers=2"])
    assert "$.resources.colocate" in str(info.value)
    assert "num_rollout_workers = 2" in str(info.value)
    with pytest.raises(ConfigError, match="expected true, false or"):
        resolve_config(registry, overrides=['resources.colocate="yes"'])


def test_the_in_process_transfer_hands_over_the_published_arrays_once():
    transfer = LocalTransfer()
    server = transfer.server()
    client = transfer.client(server.address)
    like = {"w": jnp.zeros((2, 3)), "b": jnp.zeros(3)}
    assert client.receive(like) is None  # nothing published yet
    published = {"w": jnp.ones((2, 3)), "b": jnp.full(3, 2.0)}
    server.publish(published, weight_step=4)
    received = client.receive(like)
    assert received is not None and received.weight_step == 4
    assert received.model["w"] is published["w"]  # the same buffers: nothing copied
    assert received.nbytes == 0
    assert client.receive(like) is None  # nothing newer
    server.publish({"w": jnp.ones((3, 3)), "b": jnp.zeros(3)}, weight_step=5)
    with pytest.raises(WeightMismatchError, match="do not fit like_model"):
        client.receive(like)


def _marinrl(tmp_path, *args: str, **popen) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "marin_rl_core", "run", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=tmp_path,
        **popen,
    )


def test_a_colocated_job_trains_on_policy_stops_on_ctrl_c_and_resumes(tmp_path, tiny_mock_job):
    from test_faults import _sigint_as_in_a_terminal, _train_steps, _wait_for

    run_dir = tmp_path / "colocated"
    common = [*tiny_mock_job, "--set", f'run_dir="{tmp_path}"', "--run-id", "colocated"]
    proc = _marinrl(
        tmp_path,
        *common,
        "--set",
        "resources.colocate=true",
        "--set",
        "trainer.num_train_steps=1000",
        "--set",
        "trainer.checkpoint_interval_steps=1000",
        preexec_fn=_sigint_as_in_a_terminal,
    )
    _wait_for(proc, "step 3", lambda: len(_train_steps(run_dir)) >= 3)
    os.kill(proc.pid, signal.SIGINT)
    _, stderr = proc.communicate(timeout=300)
    assert proc.returncode == ExitCode.INTERRUPTED, stderr
    assert "max_rollout_step_delay = 0" in stderr  # what it chose, said
    checkpoint = latest_checkpoint(run_dir)
    assert checkpoint is not None
    stopped_at = json.loads((checkpoint / "state.json").read_text())["step"]
    assert stopped_at >= 3
    saved = (run_dir / "config.toml").read_text()
    assert "colocate = true" in saved
    # One process: the trainer's and the worker's logs are the same process's.
    trainer_log = (run_dir / "logs" / "trainer.log").read_text()
    assert "colocated" in (run_dir / "driver.log").read_text()
    assert "now sampling with weights of step" in trainer_log

    resumed = _marinrl(
        tmp_path, "--resume", str(run_dir), "--set", f"trainer.num_train_steps={stopped_at + 3}"
    )
    out, err = resumed.communicate(timeout=600)
    assert resumed.returncode == 0, err
    rows = read_metrics(run_dir)
    train = [r for r in rows if r["source"] == "train"]
    assert [r["step"] for r in train] == list(range(1, stopped_at + 4))
    # On-policy: every trained rollout was sampled with the weights being trained.
    assert all(r["mean_weight_lag"] == 0.0 for r in train)
    # Nothing moved between processes: the weights were handed over in place.
    rollout = [r for r in rows if r["source"] == "rollout" and "rollout/weights_bytes" in r]
    assert rollout and all(r["rollout/weights_bytes"] == 0.0 for r in rollout)
    assert any(r["source"] == "eval" and r["step"] == stopped_at + 3 for r in rows)


# --- a pretrained model's defaults ---------------------------------------------------------------


def _on_checkpoint(registry, *overrides):
    config = resolve_config(registry, selections={"env": "math"}, overrides=list(overrides))
    return attrs.evolve(config, model=attrs.evolve(config.model, checkpoint="some/model"))


def test_a_pretrained_model_gets_a_chat_models_defaults_and_the_run_says_which(registry):
    """`--model` with nothing else set: an answer budget a chat model can answer in, a learning
    rate that does not wreck it, a batch for this machine (the tiny model's 2 tokens and 256
    rollouts a step gave a new user no finished step in 5 minutes)."""
    notes: list[str] = []
    config = checkpoint_defaults(_on_checkpoint(registry), {}, notes, ("", 0))
    assert config.sampling.max_tokens == config.eval.sampling.max_tokens == 128
    assert config.trainer.batch_size == 32 and config.sampling.n_prompts == 4
    assert config.trainer.learning_rate == 1e-6 and config.trainer.weight_decay == 0.0
    (note,) = notes
    assert "sampling.max_tokens = 128" in note and "trainer.batch_size = 32" in note
    assert "set any of them to choose another" in note
    on_gpu = checkpoint_defaults(_on_checkpoint(registry), {}, [], ("GPU", 1))
    assert on_gpu.trainer.batch_size == 128 and on_gpu.sampling.n_prompts == 16
    # A max_seq_len the user chose bounds the answer budget (half of it, for the prompt).
    short = _on_checkpoint(registry, "model.max_seq_len=24")
    short = checkpoint_defaults(short, {"model": {"max_seq_len": 24}}, [], ("", 0))
    assert short.sampling.max_tokens == short.eval.sampling.max_tokens == 12


def test_what_the_user_set_is_kept_on_a_pretrained_model(registry):
    given = {
        "trainer": {"learning_rate": 5e-6},
        "sampling": {"max_tokens": 24, "n_prompts": 2},
        "eval": {"sampling": {"max_tokens": 24}},
    }
    config = _on_checkpoint(
        registry,
        "trainer.learning_rate=5e-6",
        "sampling.max_tokens=24",
        "sampling.n_prompts=2",
        "eval.sampling.max_tokens=24",
    )
    notes: list[str] = []
    config = checkpoint_defaults(config, given, notes, ("", 0))
    assert config.trainer.learning_rate == 5e-6
    assert config.sampling.max_tokens == config.eval.sampling.max_tokens == 24
    assert config.trainer.batch_size == 16  # one batch of the user's 2 prompts x 8 samples
    assert "learning_rate" not in notes[0] and "sampling.max_tokens" not in notes[0]
    # The tiny default model keeps the defaults the default task was tuned with.
    tiny = resolve_config(registry)
    assert checkpoint_defaults(tiny, {}, [], ("", 0)) is tiny


@pytest.mark.parametrize(
    ("loss", "env", "storage"),
    [("ppo", "guess", "gcs"), ("grpo", "guess_agent", "memory")],
    ids=["ppo-multi-turn-object-storage", "grpo-agents"],
)
def test_colocated_jobs_run_every_kind_of_plugin(tmp_path, loss, env, storage):
    """Colocated (issue 49): a loss with a critic and several updates per step on a multi-turn
    env through object storage, and a group loss on agents through the endpoint, each train,
    evaluate at the end, and stay on-policy."""
    run_dir = tmp_path / "c"
    proc = _marinrl(
        tmp_path, "--loss", loss, "--env", env, "--storage", storage,
        "--set", "resources.colocate=true", "--set", "trainer.num_train_steps=3",
        "--set", "trainer.batch_size=64", "--set", "eval.frequency=100",
        # The guess lessons sample 32 prompts a batch of their own; 8 fill a batch of 64.
        "--set", "curriculum.lessons[0].sampling.n_prompts=8",
        "--set", "eval.n_examples=8",  # an eval at the end is what is checked, not its score
        "--set", f'run_dir="{tmp_path}"', "--run-id", "c",
    )  # fmt: skip
    _, err = proc.communicate(timeout=900)
    assert proc.returncode == 0, err[-3000:]
    rows = read_metrics(run_dir)
    train = [r for r in rows if r["source"] == "train"]
    assert [r["step"] for r in train] == [1, 2, 3]
    assert all(r["mean_weight_lag"] == 0.0 for r in train)
    assert any(r["source"] == "eval" and r["step"] == 3 for r in rows)
    rollout = [r for r in rows if r["source"] == "rollout" and "rollout/turns" in r]
    assert rollout and all(r["rollout/turns"] >= 1 for r in rollout)
