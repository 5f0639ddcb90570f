"""The learner on a device mesh: 4 simulated CPU devices train exactly like 1, and a checkpoint
saved on 4 devices resumes on 1 and on 2. A trainer group of 2 processes x 2 devices (one mesh
over both, ``jax.distributed`` with gloo) trains exactly like 1 process x 4 devices, and its
checkpoint resumes on 1 process.

Each device count is its own process (``tests/sharded_step.py``): XLA fixes the number of
simulated devices (``--xla_force_host_platform_device_count``) when JAX starts. Every layout
takes the same two RL steps (rloo with a KL penalty, so the reference model is sharded too)
from the same initial weights on the same batches.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

SCRIPT = Path(__file__).with_name("sharded_step.py")
LAYOUTS = {
    # name: (trainer overrides, expected (data_parallel, fsdp, tensor_parallel) on 4 devices)
    "fsdp": ("", (1, 4, 1)),
    "dp": ("mesh.data_parallel=-1", (4, 1, 1)),
    "tp": ("mesh.tensor_parallel=2", (1, 2, 2)),
    "micro": ("microbatch_size=4", (1, 4, 1)),
}


def _run(devices: int, out: Path, *args: str) -> dict[str, np.ndarray]:
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), str(devices), str(out), *args],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return dict(np.load(out))


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, np.ndarray]]:
    tmp = tmp_path_factory.mktemp("sharding")
    layouts = [f"--layout={name}={overrides}" for name, (overrides, _) in LAYOUTS.items()]
    four = _run(4, tmp / "four.npz", *layouts, "--save", str(tmp / "ckpt"))
    # The 1-device process resumes the checkpoint (its first layout) and takes the plain and
    # micro-batched steps from scratch; the 2-device resume runs beside it (two cores here).
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        one = pool.submit(
            _run,
            1,
            tmp / "one.npz",
            "--layout=fsdp=",
            "--layout=base=",
            "--layout=micro=microbatch_size=2",
            "--load",
            str(tmp / "ckpt"),
        )
        two = pool.submit(_run, 2, tmp / "two.npz", "--layout=fsdp=", "--load", str(tmp / "ckpt"))
        one, two = one.result(), two.result()
    return {"four": four, "one": one, "one_resumed": one, "two_resumed": two}


def run_group(argv: list[str], processes: int) -> None:
    """``python ARGV... --group COORDINATOR,PROCESSES,I`` for each process ``I`` of a trainer
    group on 127.0.0.1 (each sets its own simulated devices); asserts that all exit 0."""
    from marin_rl_core.testing import free_port

    coordinator = f"127.0.0.1:{free_port()}"
    procs = [
        subprocess.Popen(
            [sys.executable, *argv, "--group", f"{coordinator},{processes},{i}"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )  # fmt: skip
        for i in range(processes)
    ]
    errors = [p.communicate(timeout=600)[1] for p in procs]
    for p, err in zip(procs, errors, strict=True):
        assert p.returncode == 0, err[-4000:]


def _run_group(processes: int, devices: int, out: Path, *args: str) -> dict[str, np.ndarray]:
    """``sharded_step.py`` as a trainer group: ``processes`` processes of ``devices`` each."""
    run_group([str(SCRIPT), str(devices), str(out), *args], processes)
    return dict(np.load(out))


@pytest.fixture(scope="module")
def group_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, np.ndarray]]:
    tmp = tmp_path_factory.mktemp("group")
    layouts = ["--layout=fsdp=", "--layout=tp=mesh.tensor_parallel=2"]
    group = _run_group(2, 2, tmp / "group.npz", *layouts, "--save", str(tmp / "ckpt"))
    four = _run(4, tmp / "four.npz", *layouts)
    resumed = _run(1, tmp / "resumed.npz", "--layout=fsdp=", "--load", str(tmp / "ckpt"))
    return {"group": group, "four": four, "resumed": resumed}


@pytest.mark.slow  # test_trainer_group runs a group in the default run
@pytest.mark.parametrize("layout", ["fsdp", "tp"])
def test_a_trainer_group_of_two_processes_trains_like_one_process(group_runs, layout):
    """2 processes x 2 devices, one mesh: the same losses, gradient norms and parameters after
    each step as 1 process x 4 devices, with the parameters split over all four devices."""
    group, four = group_runs["group"], group_runs["four"]
    assert tuple(group[f"{layout}/sizes"]) == tuple(four[f"{layout}/sizes"])
    assert int(group[f"{layout}/max_devices_per_leaf"]) == 4
    assert bool(group[f"{layout}/same_layout"])
    for step in (1, 2):
        np.testing.assert_allclose(
            group[f"{layout}/loss{step}"], four[f"{layout}/loss{step}"], rtol=1e-5
        )
        np.testing.assert_allclose(
            group[f"{layout}/grad_norm{step}"], four[f"{layout}/grad_norm{step}"], rtol=1e-5
        )
        _assert_same_params(_params(group, layout, step), _params(four, layout, step))


@pytest.mark.slow
def test_a_checkpoint_of_a_trainer_group_resumes_on_one_process(group_runs):
    """Both processes write their shards of the step-1 checkpoint; one process alone reads it
    back and takes the group's step 2."""
    group, resumed = group_runs["group"], group_runs["resumed"]
    np.testing.assert_allclose(resumed["fsdp/loss2"], group["fsdp/loss2"], rtol=1e-5)
    _assert_same_params(_params(resumed, "fsdp", 2), _params(group, "fsdp", 2))


def _params(run: dict[str, np.ndarray], layout: str, step: int) -> list[np.ndarray]:
    prefix = f"{layout}/params{step}/"
    return [
        run[k]
        for k in sorted(
            (k for k in run if k.startswith(prefix)), key=lambda k: int(k.rsplit("/", 1)[1])
        )
    ]


def _assert_same_params(a: list[np.ndarray], b: list[np.ndarray]) -> None:
    assert len(a) == len(b) and len(a) > 0
    for x, y in zip(a, b, strict=True):
        np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_a_step_on_four_devices_equals_the_step_on_one(runs, layout):
    four, one = runs["four"], runs["one"]
    assert tuple(four[f"{layout}/sizes"]) == LAYOUTS[layout][1]
    # FSDP and tensor parallelism really split the parameters; data parallelism replicates them.
    assert bool(four[f"{layout}/sharded"]) == (layout != "dp")
    assert bool(four[f"{layout}/same_layout"]), "a step changed the parameters' sharding"
    for step in (1, 2):
        np.testing.assert_allclose(four[f"{layout}/loss{step}"], one[f"base/loss{step}"], rtol=1e-5)
        np.testing.assert_allclose(
            four[f"{layout}/grad_norm{step}"], one[f"base/grad_norm{step}"], rtol=1e-5
        )
        _assert_same_params(_params(four, layout, step), _params(one, "base", step))


def test_gradient_accumulation_on_one_device_equals_the_whole_batch(runs):
    one = runs["one"]
    for step in (1, 2):
        np.testing.assert_allclose(one[f"micro/loss{step}"], one[f"base/loss{step}"], rtol=1e-5)
        _assert_same_params(_params(one, "micro", step), _params(one, "base", step))


@pytest.mark.parametrize("resumed", ["one_resumed", "two_resumed"])
def test_a_checkpoint_saved_on_four_devices_resumes_on_fewer(runs, resumed):
    """Step 2 taken after restoring the 4-device checkpoint of step 1 on 1 or 2 devices equals
    step 2 of the uninterrupted 4-device run."""
    four, other = runs["four"], runs[resumed]
    np.testing.assert_allclose(other["fsdp/loss2"], four["fsdp/loss2"], rtol=1e-5)
    _assert_same_params(_params(other, "fsdp", 2), _params(four, "fsdp", 2))


@pytest.fixture(scope="module")
def sampled(tmp_path_factory: pytest.TempPathFactory) -> Callable[[int, int, str], dict]:
    """``sampled(devices, tp, dtype)``: ``sharded_sampling.py``'s figures for the kv and paged
    engines, both in one process (run once per arguments)."""
    import functools
    import json

    @functools.cache
    def run(devices: int, tp: int, dtype: str) -> dict:
        out = tmp_path_factory.mktemp("sampling") / "sampling.json"
        script = Path(__file__).with_name("sharded_sampling.py")
        proc = subprocess.run(
            [sys.executable, str(script), str(devices), str(tp), dtype, str(out), "kv,paged"],
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert proc.returncode == 0, proc.stderr[-4000:]
        return json.loads(out.read_text())

    return run


@pytest.mark.parametrize(
    ("engine", "devices", "tp", "dtype", "tolerance"),
    [
        ("kv", 4, 4, "float32", 1e-4),
        ("paged", 4, 4, "float32", 1e-4),
        pytest.param("kv", 4, 2, "bfloat16", 0.1, marks=pytest.mark.slow),
        pytest.param("paged", 4, 2, "bfloat16", 0.1, marks=pytest.mark.slow),
    ],
    ids=["kv-tp4-float32", "paged-tp4-float32", "kv-tp2-bfloat16", "paged-tp2-bfloat16"],
)
def test_a_rollout_engine_sharded_over_its_devices_samples_what_the_trainer_scores(
    sampled, engine, devices, tp, dtype, tolerance
):
    """The inference engine split over a worker's devices (tensor parallelism) reports, for each
    token it samples, the logprob the trainer computes for it (to float32 rounding; bfloat16
    weights move logprobs by a few hundredths), and decodes greedily like one device."""
    got = sampled(devices, tp, dtype)[engine]
    assert got["devices"] == devices and got["sharded"]
    assert got["dtypes"] == [dtype]
    assert got["n_tokens"] > 12
    assert got["max_logprob_gap"] < tolerance
    if dtype == "float32":
        assert got["greedy_equal"]


@pytest.fixture(scope="module")
def logprob_runs(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """``sharded_logprobs.py`` on 4 devices: the batch over 1 and 4 of them, and FSDP."""
    import json

    out = tmp_path_factory.mktemp("logprobs") / "logprobs.json"
    script = Path(__file__).with_name("sharded_logprobs.py")
    proc = subprocess.run(
        [sys.executable, str(script), "4", str(out)], capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(out.read_text())


def test_logprobs_of_a_batch_sharded_over_devices_stay_on_each_devices_rows(logprob_runs):
    """The log-probabilities (forward and backward, computed in blocks of positions) of a batch
    split over four devices move nothing between devices, and each device holds a quarter of
    the memory one device needs for the whole batch. Blocks of flattened rows x positions
    gathered every row's hidden states onto every device, which then computed the LM head and
    softmax over a 151k vocabulary for the whole global batch."""
    got = logprob_runs["dp"]
    assert got["4"]["collectives"] == [], got["4"]
    assert got["4"]["max_difference"] < 1e-5
    assert got["4"]["temp_bytes"] < 0.35 * got["1"]["temp_bytes"], got


def test_with_fsdp_the_lm_head_is_computed_vocabulary_parallel(logprob_runs):
    """Parameters split over four devices (FSDP): each device computes every row's logits for a
    quarter of the vocabulary instead of gathering the whole LM head and its float32 gradient,
    with the same log-probabilities and gradient as one device, in less temporary memory."""
    got = logprob_runs["fsdp"]
    split, whole = got["True"], got["False"]
    for figures in (split, whole):
        assert figures["max_difference"] < 1e-5, got
        assert figures["max_grad_difference"] < 1e-5 * max(1.0, figures["grad_scale"]), got
    assert split["temp_bytes"] < 0.8 * whole["temp_bytes"], got


def test_a_mesh_that_does_not_fit_the_trainers_devices_is_a_config_error(
    cli, tiny_mock_job, tmp_path
):
    """Only the trainer's own process knows its devices; its set-up error still reaches the user
    as a message and exit code 3, not as Ray's ActorDiedError."""
    from marin_rl_core.errors import ExitCode

    result = cli(
        "run",
        *tiny_mock_job,
        "--set",
        "trainer.mesh.tensor_parallel=2",
        "--set",
        f'run_dir="{tmp_path}"',
    )
    assert result.exit_code == ExitCode.CONFIG, result.output
    assert "the trainer has 1 device(s)" in result.output
    assert "tensor_parallel=2" in result.output
    assert "Traceback" not in result.output


def test_the_guides_four_device_command_trains_on_a_sharded_mesh(tmp_path):
    """docs/hf-models.md's "Try it on CPU" command, as written (plus a few small-job settings:
    later --set values win), runs the whole job with the trainer over 4 simulated devices."""
    import shlex

    text = (Path(__file__).resolve().parents[1] / "docs" / "hf-models.md").read_text()
    block = text.split("<!-- docs-test: four-cpu-devices -->", 1)[1]
    command = shlex.split(block.split("```bash", 1)[1].split("```", 1)[0].replace("\\\n", " "))
    start = command.index("marinrl")
    env = dict(os.environ)
    env.update(assignment.split("=", 1) for assignment in command[:start])
    env["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {env['XLA_FLAGS']}"  # the suite's first
    argv = command[start:]
    assert argv[:2] == ["marinrl", "run"] and env["XLA_FLAGS"].endswith("device_count=4")
    small = ["trainer.num_train_steps=3", "eval.n_examples=8", "eval.frequency=100"]
    small += ["sampling.n_prompts=8"]  # 8 x 8 samples: the guide's batch of 64, not 256
    small += [f'run_dir="{tmp_path}"']
    proc = subprocess.run(
        [sys.executable, "-m", "marin_rl_core", *argv[1:], "--run-id", "mesh"]
        + [arg for setting in small for arg in ("--set", setting)],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    log = (tmp_path / "mesh" / "logs" / "trainer.log").read_text()
    assert "'data_parallel': 1, 'fsdp': 2, 'tensor_parallel': 2" in log
    assert "over 4 device(s)" in log
    assert (tmp_path / "mesh" / "checkpoints").is_dir()


def test_a_colocated_job_trains_and_samples_over_all_four_devices_of_its_process(tmp_path):
    """resources.colocate with several devices: one process; the trainer's mesh spans all four
    (FSDP 2 x tensor-parallel 2) and the sampler splits the model over two of the same devices;
    each publish is placed into the sampler's shardings in the process."""
    env = dict(os.environ)
    env["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count=4"
    settings = [
        "resources.colocate=true",
        "trainer.batch_size=64",
        "sampling.n_prompts=8",  # 8 x 8 samples: one batch of 64
        "trainer.mesh.tensor_parallel=2",
        "model.inference_tensor_parallel=2",
        "trainer.num_train_steps=3",
        "eval.n_examples=8",
        "eval.frequency=100",
        f'run_dir="{tmp_path}"',
    ]
    proc = subprocess.run(
        [sys.executable, "-m", "marin_rl_core", "run", "--env", "math", "--run-id", "both"]
        + [arg for setting in settings for arg in ("--set", setting)],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    log = (tmp_path / "both" / "logs" / "trainer.log").read_text()
    assert "'data_parallel': 1, 'fsdp': 2, 'tensor_parallel': 2" in log
    assert "over 4 device(s)" in log
    assert "now sampling with weights of step 3" in log
    rows = [json.loads(line) for line in (tmp_path / "both" / "metrics.jsonl").open()]
    assert [r["step"] for r in rows if r["source"] == "train"] == [1, 2, 3]
    assert all(r["mean_weight_lag"] == 0.0 for r in rows if r["source"] == "train")
