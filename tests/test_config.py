"""Run configs: resolution order, round trips, and errors that name the path."""

from __future__ import annotations

import tomllib
from pathlib import Path

import attrs
import pytest

from marin_rl_core import ExitCode, build_registry
from marin_rl_core.config import RLJobConfig, dump_config, resolve_config

REPO = Path(__file__).resolve().parents[1]


def write(tmp_path: Path, text: str, name: str = "run.toml") -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def test_config_show_prints_every_default_and_reads_back_unchanged(cli, tmp_path):
    shown = cli("config", "show")
    assert shown.exit_code == 0, shown.output
    data = tomllib.loads(shown.output)
    assert data["loss"]["name"] == "rloo" and "kl_coef" in data["loss"]
    assert data["env"]["name"] == "math"
    assert data["trainer"]["num_train_steps"] >= 1
    assert data["curriculum"]["lessons"], "the env's default lessons are resolved"

    again = cli("config", "show", "--config", write(tmp_path, shown.output))
    assert again.exit_code == 0, again.output
    assert again.output == shown.output


def test_yaml_config_round_trips_too(cli, tmp_path):
    shown = cli("config", "show", "--format", "yaml", "--set", "loss.kl_coef=0.25")
    assert shown.exit_code == 0, shown.output
    again = cli(
        "config", "show", "--format", "yaml", "--config", write(tmp_path, shown.output, "run.yaml")
    )
    assert again.output == shown.output
    assert "kl_coef: 0.25" in again.output


def test_flags_override_files_and_set_overrides_flags(tmp_path):
    registry = build_registry()
    path = write(
        tmp_path, '[env]\nname = "mock"\n[loss]\nkl_coef = 0.5\n[trainer]\nbatch_size = 64\n'
    )
    config = resolve_config(
        registry,
        files=[path],
        selections={"env": "math"},
        overrides=["loss.kl_coef=0.05", "trainer.learning_rate=1e-4"],
    )
    assert isinstance(config, RLJobConfig)
    assert config.env.name == "math"
    assert config.loss.config.kl_coef == 0.05
    assert config.trainer.batch_size == 64
    assert config.trainer.learning_rate == 1e-4


def test_another_plugin_selected_over_a_saved_section_keeps_what_applies_and_says_what_not(
    tmp_path,
):
    """``--resume RUN --loss ppo`` on a grpo run: the saved ``[loss]`` holds grpo's settings;
    those ppo also has carry over (``kl_coef``), the others are dropped with a note (they were
    "unknown key" errors)."""
    registry = build_registry()
    saved = dump_config(
        resolve_config(
            registry, selections={"env": "mock", "loss": "grpo"}, overrides=["loss.kl_coef=0.07"]
        ),
        registry,
    )
    path = write(tmp_path, saved)
    notes: list[str] = []
    config = resolve_config(
        registry, files=[path], selections={"loss": "ppo"}, overrides=[], notes=notes
    )
    assert config.loss.name == "ppo" and config.loss.config.kl_coef == 0.07
    grpo_only = {f.name for f in attrs.fields(type(registry.get("loss", "grpo").config_class()))}
    grpo_only -= {f.name for f in attrs.fields(type(config.loss.config))}
    assert grpo_only and all(key in notes[0] for key in grpo_only), notes
    assert "--loss ppo replaces grpo" in notes[0]
    # The same plugin selected again changes nothing.
    again = resolve_config(registry, files=[path], selections={"loss": "grpo"}, notes=notes)
    assert again.loss.config.kl_coef == 0.07 and len(notes) == 1


def test_a_sampling_setting_a_lesson_of_its_own_hides_is_said():
    """``--env guess --set sampling.n_prompts=4``: the guess lesson samples 32 prompts a batch
    of its own; the user is told, with the setting that changes it."""
    registry = build_registry()
    notes: list[str] = []
    config = resolve_config(
        registry, selections={"env": "guess"},
        overrides=["sampling.n_prompts=4", "sampling.temperature=1.0"], notes=notes,
    )  # fmt: skip
    assert config.sampling_for(config.curriculum.lessons[0]).n_prompts == 32
    (note,) = [n for n in notes if "samples with its own settings" in n]
    assert "lesson 'guess_digit'" in note and "n_prompts 32 (not 4)" in note
    assert "temperature" not in note  # the same value: nothing hidden
    assert "curriculum.lessons[0].sampling.KEY" in note
    notes.clear()
    resolve_config(
        registry, selections={"env": "guess"},
        overrides=["curriculum.lessons[0].sampling.n_prompts=4"], notes=notes,
    )  # fmt: skip
    assert not [n for n in notes if "samples with its own settings" in n]
    # The default math task's last lesson samples 32 prompts of its own too; one of its own
    # lessons without sampling settings follows $.sampling.
    resolve_config(registry, overrides=["sampling.n_prompts=4"], notes=notes)
    assert [n for n in notes if "lesson 'add_2digit' samples with its own settings" in n]
    notes.clear()
    lesson = 'curriculum.lessons=[{id = "add", env_config = {task = "add_1digit"}}]'
    resolve_config(registry, overrides=["sampling.n_prompts=4", lesson], notes=notes)
    assert not [n for n in notes if "samples with its own settings" in n]


def test_typo_in_a_plugin_section_names_the_path_and_suggests_the_key(cli, tmp_path):
    result = cli("config", "validate", write(tmp_path, "[loss]\nkl_coeff = 0.05\n"))
    assert result.exit_code == ExitCode.CONFIG == 3
    assert "unknown key 'kl_coeff' (did you mean 'kl_coef'?)" in result.output
    assert "@ $.loss" in result.output


def test_mistyped_value_names_the_path_and_expected_type(cli, tmp_path):
    result = cli("config", "validate", write(tmp_path, '[loss]\nkl_coef = "high"\n'))
    assert result.exit_code == ExitCode.CONFIG
    assert "$.loss.kl_coef" in result.output
    assert "expected a number" in result.output

    result = cli("config", "validate", write(tmp_path, "[trainer]\nbatch_size = 1.5\n", "b.toml"))
    assert result.exit_code == ExitCode.CONFIG
    assert "$.trainer.batch_size" in result.output and "expected an integer" in result.output


def test_a_value_outside_its_choices_is_reported_at_the_field(cli):
    result = cli(
        "config", "show", "--set", 'trainer.lr_schedule="cosin"', "--set", 'env.split="swp"'
    )
    assert result.exit_code == ExitCode.CONFIG
    assert (
        "unknown lr_schedule 'cosin'; choose one of cosine, linear, constant @ $.trainer.lr_schedule"
        in result.output
    )
    assert "unknown split 'swp'; choose one of swap, hash @ $.env.split" in result.output
    assert "expected None" not in result.output


def test_bad_set_override_names_its_path(cli):
    result = cli("config", "show", "--set", "trainer.batch_sise=3")
    assert result.exit_code == ExitCode.CONFIG
    assert "unknown key 'batch_sise' (did you mean 'batch_size'?)" in result.output
    assert "@ $.trainer" in result.output


def test_lesson_env_config_typo_is_reported_at_the_lesson(cli, tmp_path):
    text = """
[env]
name = "math"
[[curriculum.lessons]]
id = "a"
env_config = { levle = "add_1digit" }
"""
    result = cli("config", "validate", write(tmp_path, text))
    assert result.exit_code == ExitCode.CONFIG
    assert "$.curriculum.lessons[0].env_config" in result.output
    assert "unknown key 'levle'" in result.output


def test_curriculum_dependencies_must_form_a_dag(cli, tmp_path):
    text = """
[[curriculum.lessons]]
id = "a"
dependencies = [{ lesson = "b" }]
[[curriculum.lessons]]
id = "b"
dependencies = [{ lesson = "a" }]
[[curriculum.lessons]]
id = "c"
dependencies = [{ lesson = "d" }]
"""
    result = cli("config", "validate", write(tmp_path, text))
    assert result.exit_code == ExitCode.CONFIG
    assert "dependencies form a cycle: a -> b -> a" in result.output
    assert "$.curriculum.lessons[2].dependencies[0].lesson: no lesson 'd'" in result.output


def test_batch_size_must_hold_whole_groups(cli):
    result = cli(
        "config",
        "show",
        "--set",
        "trainer.batch_size=100",
        "--set",
        "sampling.n_generations_per_prompt=8",
    )
    assert result.exit_code == ExitCode.CONFIG
    assert (
        "$.trainer.batch_size: 100 is not a multiple of $.sampling.n_generations_per_prompt (8)"
        in result.output
    )


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            ["trainer.sync_interval_steps=3", "replay_buffer.max_rollout_step_delay=1"],
            "$.trainer.sync_interval_steps: weights published every 3 steps go stale after "
            "$.replay_buffer.max_rollout_step_delay + 1 = 2 steps",
        ),
        (
            ["replay_buffer.capacity=64", "trainer.batch_size=256"],
            "$.replay_buffer.capacity: 64 rollouts can never fill a training batch",
        ),
        (
            ["trainer.microbatch_size=48", "trainer.batch_size=256"],
            "$.trainer.microbatch_size: 48 does not divide $.trainer.batch_size (256); pick a "
            "divisor such as 32",
        ),
    ],
    ids=["sync-slower-than-staleness", "capacity-below-batch", "microbatch-not-a-divisor"],
)
def test_settings_that_could_never_feed_the_trainer_are_rejected(cli, overrides, message):
    args = [a for o in overrides for a in ("--set", o)]
    result = cli("config", "show", *args)
    assert result.exit_code == ExitCode.CONFIG
    assert message in " ".join(result.output.split())


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("trainer.learning_rate=-0.001", "'learning_rate' must be >= 0: -0.001 @ $.trainer"),
        ("loss.kl_coef=nan", "expected a finite number, got nan (expected float) @ $.loss.kl_coef"),
        ("sampling.temperature=inf", "expected a finite number, got inf"),
        ("trainer.checkpoint_interval_steps=0", "'checkpoint_interval_steps' must be >= 1"),
        ("trainer.batch_size=-8", "'batch_size' must be >= 1"),
        ("model.max_seq_len=1", "'max_seq_len' must be >= 2"),
        ("curriculum.ema_alpha=1.5", "'ema_alpha' must be <= 1.0"),
        ("trainer.mesh.data_parallel=0", "data_parallel must be -1 (all devices) or >= 1"),
    ],
)
def test_numbers_out_of_range_are_refused_before_anything_runs(cli, override, message):
    """A negative learning rate would train (backwards); a nan would reach the optimizer."""
    result = cli("config", "show", "--set", override)
    assert result.exit_code == ExitCode.CONFIG, result.output
    assert message in result.output


def test_missing_config_file_is_a_config_error(cli, tmp_path):
    result = cli("config", "validate", str(tmp_path / "nope.toml"))
    assert result.exit_code == ExitCode.CONFIG
    assert "does not exist" in result.output


@pytest.mark.parametrize("path", sorted(REPO.glob("examples/configs/*.toml")), ids=lambda p: p.name)
def test_every_shipped_config_file_is_valid(path):
    registry = build_registry()
    config = resolve_config(registry, files=[path])
    assert dump_config(config, registry)


def test_a_partial_table_overrides_only_its_keys():
    registry = build_registry()
    default = resolve_config(registry)
    config = resolve_config(registry, overrides=["eval.sampling.max_tokens=5"])
    assert config.eval.sampling.max_tokens == 5
    # The rest of eval's sampling keeps eval's own defaults (greedy, one sample), not the
    # SamplingParams class defaults.
    assert config.eval.sampling.temperature == default.eval.sampling.temperature == 0.0
    assert config.eval.sampling.n_generations_per_prompt == 1
    assert config.sampling == default.sampling


def test_set_indexes_the_env_plugins_default_lessons(cli):
    """With no lessons in the config the job runs the env's default ones: ``--set
    curriculum.lessons[I]...`` changes lesson I of those and leaves the others as they were;
    an index past them names the lessons there are."""
    registry = build_registry()
    default = resolve_config(registry, selections={"env": "math"})
    config = resolve_config(
        registry,
        selections={"env": "math"},
        overrides=[
            "curriculum.lessons[1].sampling.max_tokens=8",
            "curriculum.lessons[1].eval_sampling.max_tokens=8",
        ],
    )
    lessons, before = config.curriculum.lessons, default.curriculum.lessons
    assert [x.id for x in lessons] == [x.id for x in before] and len(lessons) == 5
    assert lessons[1].dependencies == before[1].dependencies  # the rest of the lesson kept
    assert lessons[0] == before[0] and lessons[2:] == before[2:]
    # A lesson's partial tables override the run's key by key: only max_tokens changed, and
    # its eval is still greedy.
    sampling, evaluated = config.sampling_for(lessons[1]), config.eval_sampling_for(lessons[1])
    assert default.sampling_for(before[1]).max_tokens != 8
    assert sampling == attrs.evolve(default.sampling_for(before[1]), max_tokens=8)
    assert evaluated == attrs.evolve(default.eval_sampling_for(before[1]), max_tokens=8)
    assert evaluated.temperature == 0.0
    result = cli("config", "show", "--set", "curriculum.lessons[7].sampling.max_tokens=8")
    assert result.exit_code == ExitCode.CONFIG
    assert "index 7 is out of range: curriculum.lessons has 5 items ([0] add_1digit, [1] " in (
        result.output
    )


def test_a_config_file_that_is_not_utf8_is_a_config_error(cli, tmp_path):
    path = tmp_path / "latin1.toml"
    path.write_bytes("[trainer]\n# r\xe9glages\nbatch_size = 32\n".encode("latin-1"))
    result = cli("config", "validate", str(path))
    assert result.exit_code == 3
    assert "is not UTF-8 text (byte 0xe9 at offset 13); save it as UTF-8" in result.output


def test_a_lesson_evaluated_with_fewer_tokens_than_it_trains_with_is_refused(cli):
    """One run-wide eval budget used to cut longer answers short and score them 0, silently."""
    lessons = '[{id = "long", sampling = {max_tokens = 5}}]'
    result = cli("config", "show", "--env", "mock", "--set", f"curriculum.lessons={lessons}")
    assert result.exit_code == 3
    assert "$.eval.sampling.max_tokens: lesson 'long' is evaluated with 3 tokens but trained " in (
        result.output
    )
    assert "set $.curriculum.lessons[0].eval_sampling.max_tokens" in result.output
    fixed = '[{id = "long", sampling = {max_tokens = 5}, eval_sampling = {max_tokens = 5}}]'
    result = cli("config", "show", "--env", "mock", "--set", f"curriculum.lessons={fixed}")
    assert result.exit_code == 0, result.output


def test_a_lesson_is_evaluated_with_its_own_eval_sampling():
    from marin_rl_core.models.build import initial_model
    from marin_rl_core.models.tokenizer import model_tokenizer
    from marin_rl_core.rollout.manager import RolloutManager

    registry = build_registry()
    lessons = (
        '[{id = "short", sampling = {max_tokens = 1}, eval_sampling = {max_tokens = 1}}, '
        '{id = "other"}]'
    )
    config = resolve_config(
        registry, selections={"env": "mock"}, overrides=[f"curriculum.lessons={lessons}"]
    )
    assert config.eval_sampling_for(config.curriculum.lessons[0]).max_tokens == 1
    assert config.eval_sampling_for(config.curriculum.lessons[1]) == config.eval.sampling
    tokenizer = model_tokenizer(config.model)
    manager = RolloutManager(
        config, registry, model=initial_model(config, tokenizer), tokenizer=tokenizer
    )
    _, batch = manager.evaluate_lesson(
        "short", n_examples=4, eval_type="micro_eval", seed=0, step=0, weight_step=0, worker_id="w"
    )
    assert batch is not None
    assert max(len(r.response_tokens) for r in batch.rollouts) == 1


def test_env_token_fractions_name_lesson_envs_and_sum_to_at_most_one(cli):
    from marin_rl_core.errors import ConfigError

    registry = build_registry()
    config = resolve_config(
        registry,
        selections={"env": "math"},
        overrides=["replay_buffer.env_token_fractions={math = 0.6}"],
    )
    assert dict(config.replay_buffer.env_token_fractions) == {"math": 0.6}
    with pytest.raises(ConfigError, match="guess is not the env of any lesson"):
        resolve_config(
            registry,
            selections={"env": "math"},
            overrides=["replay_buffer.env_token_fractions={guess = 0.5}"],
        )
    with pytest.raises(ConfigError, match="together at most 1"):
        resolve_config(
            registry,
            selections={"env": "math"},
            overrides=["replay_buffer.env_token_fractions={math = 1.5}"],
        )


def test_an_env_of_code_on_the_tiny_default_model_says_to_pass_a_hugging_face_model(cli, tmp_path):
    """HumanEval prompts and 512-token answers cannot fit the 16 positions of the default
    arithmetic model: the run stops at once and says which option is missing."""
    result = cli("run", "--env", "code", "--set", f'run_dir="{tmp_path}"')
    assert result.exit_code == 3, result.output
    assert "max_tokens (512) leaves no room for a prompt in $.model.max_seq_len (16)" in (
        result.output
    )
    assert "needs a Hugging Face checkpoint, --model PATH_OR_NAME" in result.output
    assert not list(tmp_path.iterdir()), "nothing started"


def test_the_engine_is_a_plugin_section_and_an_old_inference_engine_setting_still_reads(
    cli, tmp_path
):
    """`--engine kv --set engine.steps_per_round=8` reaches the kv engine's config; an unknown
    engine names the registered ones; a config saved before engines were plugins (a resumed
    run's config.toml) still reads, its model.inference_engine taken as [engine] name."""
    registry = build_registry()
    assert resolve_config(registry).engine.name == "auto"
    config = resolve_config(
        registry, selections={"engine": "kv"}, overrides=["engine.steps_per_round=8"]
    )
    assert config.engine.name == "kv" and config.engine.config.steps_per_round == 8
    result = cli("config", "show", "--engine", "kvv")
    assert result.exit_code == ExitCode.UNKNOWN_PLUGIN
    assert "Did you mean 'kv'?" in result.output and "auto, dense, kv, paged" in result.output
    old = tmp_path / "config.toml"
    old.write_text('[model]\ninference_engine = "paged"\n')
    notes: list[str] = []
    config = resolve_config(registry, files=[old], notes=notes)
    assert config.engine.name == "paged"
    assert "model.inference_engine = 'paged' is read as [engine] name = 'paged'" in notes[0]


def test_a_set_without_equals_says_how_to_write_it(cli):
    """`--set trainer.num_train_steps 5` (a space for '='): a usage error that shows the form,
    not click's "unexpected extra argument (5)"."""
    result = cli("config", "show", "--set", "trainer.num_train_steps", "5")
    assert result.exit_code == ExitCode.USAGE
    text = " ".join(result.output.replace("│", " ").split())
    assert "--set takes KEY=VALUE as one argument, got 'trainer.num_train_steps'" in text
    assert "unexpected extra argument" not in text
