"""The third-party path: pip-install the example plugin packages and use their envs by name
(``examples/marinrl-echo``, single-turn; ``examples/marinrl-countdown``, multi-turn;
``examples/marinrl-agent-calculator``, an agent program), the example loss
(``examples/marinrl-reinforce``), storage (``examples/marinrl-sqlite-storage``) and engine
(``examples/marinrl-reference-engine``), and an env graded by a judge model
(``examples/marinrl-describe``)."""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from marin_rl_core.testing import check_plugin

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "marinrl-echo"
COUNTDOWN = EXAMPLE.parent / "marinrl-countdown"
REINFORCE = EXAMPLE.parent / "marinrl-reinforce"
AGENT_CALCULATOR = EXAMPLE.parent / "marinrl-agent-calculator"
SQLITE_STORAGE = EXAMPLE.parent / "marinrl-sqlite-storage"
REFERENCE_ENGINE = EXAMPLE.parent / "marinrl-reference-engine"
DESCRIBE = EXAMPLE.parent / "marinrl-describe"


def pip_install(example: Path, target: Path) -> Path:
    """``pip install`` an example package into ``target``, its own directory (not the test env)."""
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--quiet",
            "--no-deps",
            "--no-build-isolation",
            "--target",
            str(target),
            str(example),
        ],
        check=True,
        capture_output=True,
    )
    return target


@pytest.fixture(scope="module")
def installed_echo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return pip_install(EXAMPLE, tmp_path_factory.mktemp("site"))


@pytest.fixture(scope="module")
def installed_countdown(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return pip_install(COUNTDOWN, tmp_path_factory.mktemp("site"))


@pytest.fixture(scope="module")
def installed_agent_calculator(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return pip_install(AGENT_CALCULATOR, tmp_path_factory.mktemp("site"))


@pytest.fixture(scope="module")
def installed_reinforce(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return pip_install(REINFORCE, tmp_path_factory.mktemp("site"))


@pytest.fixture(scope="module")
def installed_sqlite_storage(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return pip_install(SQLITE_STORAGE, tmp_path_factory.mktemp("site"))


@pytest.fixture(scope="module")
def installed_reference_engine(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return pip_install(REFERENCE_ENGINE, tmp_path_factory.mktemp("site"))


def site_env(site: Path | tuple[Path, ...]) -> dict[str, str]:
    """The environment of a process that sees the packages installed in ``site`` (or in each
    of several sites)."""
    sites = [str(s) for s in (site if isinstance(site, tuple) else (site,))]
    return {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([*sites, os.environ.get("PYTHONPATH", "")]),
    }


def marinrl(site: Path | tuple[Path, ...], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "marin_rl_core", *args],
        capture_output=True,
        text=True,
        env=site_env(site),
    )


def test_installed_plugin_is_listed_with_its_distribution_and_version(installed_echo):
    result = marinrl(installed_echo, "plugins", "list", "--json", "--kind", "env")
    assert result.returncode == 0, result.stderr
    rows = {row["name"]: row for row in json.loads(result.stdout)}
    assert rows["echo"]["distribution"] == "marinrl-echo"
    assert rows["echo"]["version"] == "0.2.0"
    assert rows["echo"]["plugin"] == "echo"
    assert "math" in rows  # the built-ins are still there


def test_run_config_resolves_the_installed_env_by_name(installed_echo):
    result = marinrl(installed_echo, "config", "show", "--env", "echo", "--set", "env.length=3")
    assert result.returncode == 0, result.stderr
    import tomllib

    data = tomllib.loads(result.stdout)
    assert data["env"] == {"name": "echo", "length": 3, "max_value": 9}
    assert [lesson["env"] for lesson in data["curriculum"]["lessons"]] == ["echo"]


def test_not_installed_means_unknown(installed_echo):
    result = marinrl(Path("/nonexistent"), "config", "show", "--env", "echo")
    assert result.returncode == 4
    assert "unknown env 'echo'" in result.stderr


def test_example_plugin_honours_the_env_contract(installed_echo, plugin_registry, monkeypatch):
    monkeypatch.syspath_prepend(str(installed_echo))
    module = importlib.import_module("marinrl_echo")
    registry = plugin_registry(module)
    assert registry.names("env") == ["echo"]
    check_plugin(registry.get("env", "echo"))


# --- the multi-turn example ----------------------------------------------------------------------


def test_multi_turn_example_is_listed_with_its_distribution_and_version(installed_countdown):
    result = marinrl(installed_countdown, "plugins", "list", "--json", "--kind", "env")
    assert result.returncode == 0, result.stderr
    rows = {row["name"]: row for row in json.loads(result.stdout)}
    assert rows["countdown"]["distribution"] == "marinrl-countdown"
    assert rows["countdown"]["version"] == "0.1.0"


def test_multi_turn_example_honours_the_env_contract(
    installed_countdown, plugin_registry, monkeypatch
):
    from marin_rl_core import MultiTurnEnv

    monkeypatch.syspath_prepend(str(installed_countdown))
    module = importlib.import_module("marinrl_countdown")
    registry = plugin_registry(module)
    assert registry.names("env") == ["countdown"]
    record = registry.get("env", "countdown")
    check_plugin(record)
    assert isinstance(record.build(record.config_class()), MultiTurnEnv)


def test_multi_turn_example_passes_its_own_tests(installed_countdown):
    """The package's tests/ (contract checks, the game's rules, countdown.toml's budget), run
    as its author runs them: pytest in the package directory, the package installed."""
    run_own_tests(COUNTDOWN, installed_countdown)


def test_multi_turn_example_trains_with_its_run_config(installed_countdown, tmp_path):
    """``marinrl run --config countdown.toml`` as the package's README gives it, made short
    (the ``tiny_mock_job`` sizes): the Ray workers load the installed plugin, and its first
    lesson's multi-turn episodes are trained on."""
    small = [
        "trainer.num_train_steps=2",
        "trainer.batch_size=32",
        "sampling.n_prompts=4",
        "eval.n_examples=8",
        "eval.frequency=100",
        f'run_dir="{tmp_path}"',
    ]
    result = marinrl(
        installed_countdown,
        "run",
        "--config",
        str(COUNTDOWN / "countdown.toml"),
        "--run-id",
        "countdown",
        *[arg for setting in small for arg in ("--set", setting)],
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    run_dir = tmp_path / "countdown"
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").open()]
    train = [r for r in rows if r["source"] == "train"]
    assert [r["step"] for r in train] == [1, 2]
    assert all(r["replay/countdown/sampled_rollouts"] > 0 for r in train)
    batches = [r for r in rows if r["source"] == "rollout" and "rollout/turns" in r]
    assert batches and {r["rollout/lesson"] for r in batches} == {"countdown_small"}
    assert all(r["rollout/turns"] > 1 for r in batches)  # an untrained policy rarely wins at once
    samples = [json.loads(line) for line in (run_dir / "samples.jsonl").open()]
    assert samples and {s["lesson"] for s in samples} == {"countdown_small"}
    assert any(len(s["turns"]) > 1 for s in samples)
    evals = [r for r in rows if r["source"] == "eval"]
    assert evals and all(r["eval/countdown/n"] == 8 for r in evals)  # the locked lesson too


def run_own_tests(package: Path, site: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"],
        cwd=package,
        capture_output=True,
        text=True,
        env=site_env(site),
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert " passed" in result.stdout and "failed" not in result.stdout


def train_rows_of_a_run(site, tiny_mock_job, tmp_path, run_id, steps, *flags):
    """``marinrl run`` of the tiny mock job for ``steps`` steps with ``flags`` (``--loss
    reinforce``, ...) in a process that sees the packages in ``site``: it succeeds and logs
    one train row a step. Returns the run directory and the train rows."""
    from marin_rl_core.metrics import read_metrics

    result = marinrl(
        site, "run", *tiny_mock_job, *flags, "--set", f"trainer.num_train_steps={steps}",
        "--set", f'run_dir="{tmp_path}"', "--run-id", run_id,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    run_dir = tmp_path / run_id
    train = [r for r in read_metrics(run_dir) if r["source"] == "train"]
    assert [r["step"] for r in train] == list(range(1, steps + 1))
    return run_dir, train


# --- the custom loss example ---------------------------------------------------------------------


@pytest.mark.slow
def test_the_custom_loss_example_passes_its_own_tests(installed_reinforce):
    """marinrl's contract checks for losses (its loss function on a tiny model included) and
    the loss against numpy, run as the package's author runs them. Slow (25 s): the default
    run trains the same example through ``marinrl run`` and checks the built-in losses with
    the same contract checks."""
    run_own_tests(REINFORCE, installed_reinforce)


@pytest.fixture(scope="module")
def loss_and_storage_run(
    installed_reinforce, installed_sqlite_storage, tiny_mock_job, tmp_path_factory
):
    """One ``marinrl run --loss reinforce --storage sqlite`` of 3 steps, in a process that sees
    both example packages: two third-party plugins of different kinds in one job, as a user
    combines them. The custom-loss and custom-storage tests each check their plugin's part."""
    return train_rows_of_a_run(
        (installed_reinforce, installed_sqlite_storage), tiny_mock_job,
        tmp_path_factory.mktemp("runs"), "loss-and-storage", 3,
        "--loss", "reinforce", "--storage", "sqlite",
    )  # fmt: skip


def test_the_custom_loss_example_trains_through_marinrl_run(loss_and_storage_run):
    run_dir, train = loss_and_storage_run
    assert tomllib.loads((run_dir / "config.toml").read_text())["loss"]["name"] == "reinforce"
    # The loss's own per-token metric, weighed over each step by the framework.
    assert all(0 < r["importance_weight"] <= 2.0 for r in train)
    assert all(r["num_tokens"] > 0 for r in train)


# --- the custom storage example ------------------------------------------------------------------


def test_the_custom_storage_example_passes_its_own_tests(installed_sqlite_storage):
    """The contract check, a round trip, a retried write delivered once, a resumed reader and
    back-pressure, run as the package's author runs them."""
    run_own_tests(SQLITE_STORAGE, installed_sqlite_storage)


def test_the_custom_storage_example_carries_a_run_through_marinrl_run(loss_and_storage_run):
    """``marinrl run --storage sqlite``: the trainer and the rollout worker, each in its own Ray
    process, meet through the run directory's SQLite file."""
    import sqlite3

    run_dir, _ = loss_and_storage_run
    assert tomllib.loads((run_dir / "config.toml").read_text())["storage"]["name"] == "sqlite"
    with sqlite3.connect(run_dir / "rollouts.sqlite") as db:
        (stored,) = db.execute("SELECT COUNT(*) FROM batches").fetchone()
    assert stored >= 1


# --- the custom engine example -------------------------------------------------------------------


def test_the_custom_engine_example_passes_its_own_tests(installed_reference_engine):
    """marinrl's engine contract check (logprobs equal to the trainer's on a tiny model) and
    samples, greedy and drawn, equal to the ``dense`` engine's, run as the package's author runs
    them."""
    run_own_tests(REFERENCE_ENGINE, installed_reference_engine)


@pytest.mark.slow  # its contract and own tests run by default; this is the full job
def test_the_custom_engine_example_samples_a_run_through_marinrl_run(
    installed_reference_engine, tiny_mock_job, tmp_path
):
    run_dir, _ = train_rows_of_a_run(
        installed_reference_engine, tiny_mock_job, tmp_path, "custom-engine", 2,
        "--engine", "reference",
    )  # fmt: skip
    assert tomllib.loads((run_dir / "config.toml").read_text())["engine"]["name"] == "reference"


# --- the agent example ---------------------------------------------------------------------------


def test_the_agent_example_passes_its_own_tests(installed_agent_calculator):
    run_own_tests(AGENT_CALCULATOR, installed_agent_calculator)


def test_the_unmodified_agent_script_trains_through_marinrl_run(
    installed_agent_calculator, tmp_path
):
    """``marinrl run --env calculator_agent`` on a tiny Qwen3 checkpoint with a tool-calling chat
    template: each episode runs ``calculator_agent.py`` as a subprocess that reaches the policy
    through its OpenAI endpoint; the episodes' calls are trained on."""
    pytest.importorskip("torch")
    from marin_rl_core.metrics import read_metrics
    from marin_rl_core.testing import tiny_chat_tokenizer, write_tiny_hf_checkpoint

    checkpoint = write_tiny_hf_checkpoint(
        tmp_path / "qwen3", "qwen3", template="chatml_tools", max_position_embeddings=640,
        vocab_size=len(tiny_chat_tokenizer("chatml_tools")),
    )  # fmt: skip
    settings = [
        f'model.checkpoint="{checkpoint}"', "model.max_seq_len=640", "trainer.num_train_steps=2",
        "trainer.batch_size=2", "eval.n_examples=1",
        # 1 prompt x 2 samples: a batch of 2 episodes (each an agent process, ~1.6 CPU-s), not the
        # lesson's 16; with the sampler's warm-up batch and the two evals, 8 agent processes (17
        # with batches of 4 and evals of 2: half this test's CPU)
        "curriculum.lessons[0].sampling.n_prompts=1",
        "curriculum.lessons[0].sampling.n_generations_per_prompt=2",
        # On-policy: the worker samples each step's batch with the weights before it, not
        # batches ahead that nobody trains (each episode is an agent process, ~2 CPU-s)
        "replay_buffer.max_rollout_step_delay=0",
        "eval.frequency=100", f'run_dir="{tmp_path}"',
    ]  # fmt: skip
    result = marinrl(
        installed_agent_calculator, "run", "--env", "calculator_agent", "--run-id", "agent",
        *[arg for setting in settings for arg in ("--set", setting)],
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    rows = read_metrics(tmp_path / "agent")
    train = [r for r in rows if r["source"] == "train"]
    assert [r["step"] for r in train] == [1, 2]
    batches = [r for r in rows if r["source"] == "rollout" and "rollout/turns" in r]
    assert batches and all(r["rollout/env_errors"] == 0 for r in batches)
    # On-policy, one batch a step, and none begun after the last step for nobody to train.
    assert len(batches) == 2
    assert "was cancelled" not in (tmp_path / "agent" / "logs" / "rollout-0.log").read_text()
    assert all(r["rollout/turns"] >= 1 and r["rollout/generated_tokens"] > 0 for r in batches)
    samples = [json.loads(line) for line in (tmp_path / "agent" / "samples.jsonl").open()]
    # The agent's system prompt and the tool schema it sent reached the policy.
    assert samples and "calculate" in samples[0]["prompt"]


# --- an env graded by a judge ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def installed_describe(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return pip_install(DESCRIBE, tmp_path_factory.mktemp("site"))


def test_the_judged_env_example_passes_its_own_tests(installed_describe):
    run_own_tests(DESCRIBE, installed_describe)


def test_the_judged_env_example_learns_what_its_judge_asks_for(installed_describe, tmp_path):
    """The bar for a judge's reward: ``marinrl run --config describe.toml`` with its judge's url
    pointed at a judge served on loopback (tests/judge_server.py) whose rubric asks for a
    description of exactly 6 characters. The held-out judged reward rises, and what a program
    counts beside it, the env's own ``characters``, moves to the 6 asked for; every trained
    rollout's reward is the judge's grade less the length penalty."""
    from judge_server import JudgeServer

    # 40 steps: the held-out judged reward 0.80-1.00 at seeds 0-2 on an AMD EPYC machine
    # (2026-12-04); 28 steps gave 0.60-0.80 on another machine but 0.29 here at seed 0
    steps = 40
    with JudgeServer(target=6, delay_s=0.0) as judge:
        small = [
            f"trainer.num_train_steps={steps}", "eval.n_examples=32", f"eval.frequency={steps}",
            "trainer.batch_size=128", "sampling.n_prompts=16",  # batches of 128 learned as 256 did
            f'run_dir="{tmp_path}"', f'reward.terms[0].config.url="{judge.url}"',
            f'reward.terms[0].config.cache="{tmp_path / "judge.sqlite"}"',
        ]  # fmt: skip
        result = marinrl(
            installed_describe, "run", "--config", str(DESCRIBE / "describe.toml"),
            "--run-id", "describe", *[arg for setting in small for arg in ("--set", setting)],
        )  # fmt: skip
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    run_dir = tmp_path / "describe"
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").open()]
    evals = [r for r in rows if r["source"] == "eval"]
    first, last = evals[0], evals[-1]
    assert (first["step"], last["step"]) == (0, steps)
    judged = [r["eval/describe/reward/judge"] for r in (first, last)]
    chars = [r["eval/describe/characters"] for r in (first, last)]
    assert judged[1] >= judged[0] + 0.3, f"the judged reward did not rise: {judged}"
    assert abs(chars[1] - 6) <= abs(chars[0] - 6) / 2, f"not nearer 6 characters: {chars}"
    samples = [json.loads(line) for line in (run_dir / "samples.jsonl").open()]
    assert samples
    for row in samples:
        terms = row["reward_terms"]
        assert row["reward"] == pytest.approx(terms["judge"] - 0.05 * terms["length"])
    batches = [r for r in rows if r["source"] == "rollout" and "rollout/reward/judge" in r]
    assert batches and all("rollout/score/words" in r for r in batches)
