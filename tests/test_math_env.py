"""The math env: generated arithmetic, held-out splits, grading, file and dataset problems,
answer extraction, format and correctness rates, lessons."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from marin_rl_plugins.math_env import MathEnv, MathEnvConfig, default_lessons, extract_answer

from marin_rl_core import Env, LessonConfig, Score, build_registry
from marin_rl_core.config import resolve_config


@pytest.fixture(scope="module")
def env() -> MathEnv:
    return MathEnv(MathEnvConfig())


def test_add_1digit_is_every_single_digit_sum(env):
    assert isinstance(env, Env)
    problems = env.problems("train") + env.problems("eval")
    assert len(problems) == 100
    assert {p.prompt for p in problems} == {f"{a}+{b}=" for a in range(10) for b in range(10)}
    for p in problems:
        a, b = p.prompt[:-1].split("+")
        assert p.answer == str(int(a) + int(b))


def test_eval_split_is_held_out_and_each_eval_sum_has_its_swap_in_training(env):
    train = {p.prompt for p in env.problems("train")}
    held_out = {p.prompt for p in env.problems("eval")}
    assert len(held_out) == 30 and len(train) == 70
    assert not train & held_out
    for prompt in held_out:
        a, b = prompt[:-1].split("+")
        assert f"{b}+{a}=" in train
    # Training never sees an eval problem, whatever the seed.
    for seed in range(20):
        assert not {p.prompt for p in env.sample_problems(64, mode="train", seed=seed)} & held_out
    # The split does not depend on the process: a fresh env makes the same one.
    assert {p.prompt for p in MathEnv(MathEnvConfig()).problems("eval")} == held_out
    other = MathEnv(MathEnvConfig(split_seed=1))
    assert {p.prompt for p in other.problems("eval")} != held_out


def test_times_tables_to_four_hold_out_swapped_products():
    """``mul_small``, the default run's second lesson: its 8 held-out products each have their
    swap in training, and every answer is a number the addition lesson already writes."""
    small = MathEnv(MathEnvConfig(task="mul_small"))
    train = {p.prompt: p.answer for p in small.problems("train")}
    held_out = {p.prompt: p.answer for p in small.problems("eval")}
    assert len(train) == 17 and len(held_out) == 8
    for prompt, answer in held_out.items():
        a, b = prompt[:-1].split("*")
        assert train[f"{b}*{a}="] == answer == str(int(a) * int(b))
    assert max(int(x) for x in [*train.values(), *held_out.values()]) == 16


def test_hash_split_and_non_commutative_tasks(env):
    hashed = MathEnv(MathEnvConfig(split="hash", eval_fraction=0.2))
    assert len(hashed.problems("eval")) == 20
    sub = MathEnv(MathEnvConfig(task="sub_1digit"))
    problems = sub.problems("train") + sub.problems("eval")
    assert len(problems) == 55 and all(int(p.answer) >= 0 for p in problems)
    assert not {p.id for p in sub.problems("train")} & {p.id for p in sub.problems("eval")}
    two = MathEnv(MathEnvConfig(task="add_2digit"))
    assert len(two.problems("train")) + len(two.problems("eval")) == 90 * 90


def test_sampling_is_seeded_and_covers_the_split_before_repeating(env):
    a = env.sample_problems(70, mode="train", seed=3)
    assert [p.id for p in a] == [p.id for p in env.sample_problems(70, mode="train", seed=3)]
    assert [p.id for p in a] != [p.id for p in env.sample_problems(70, mode="train", seed=4)]
    assert len({p.id for p in a}) == 70
    assert len(env.sample_problems(100, mode="train", seed=0)) == 100  # training cycles
    # eval scores each held-out problem once, however many are asked for
    held_out = env.sample_problems(100, mode="eval", seed=0)
    assert sorted(p.id for p in held_out) == sorted(p.id for p in env.problems("eval"))
    with pytest.raises(ValueError, match="mode must be"):
        env.sample_problems(1, mode="test", seed=0)


def test_eval_is_graded_by_exact_match_of_the_whole_answer(env):
    problem = next(p for p in env.sample_problems(30, mode="eval", seed=0) if p.answer == "13")
    assert env.score(problem, "13") == 1.0
    for wrong in ("12", "13\n", " 13", "13cat", "1", "", "thirteen"):
        assert env.score(problem, wrong) == 0.0, wrong


def test_training_gives_partial_credit_for_the_right_number_that_goes_on(env):
    problem = next(p for p in env.sample_problems(70, mode="train", seed=0) if p.answer == "9")
    assert env.score(problem, "9") == 1.0
    assert env.score(problem, "9\n") == 0.5
    assert env.score(problem, "9 dog") == 0.5
    assert env.score(problem, "91") == 0.0
    assert env.score(problem, "8") == 0.0
    strict = MathEnv(MathEnvConfig(partial_credit=0.0))
    strict_problem = strict.sample_problems(1, mode="train", seed=0)[0]
    assert strict.score(strict_problem, strict_problem.answer + "\n") == 0.0


def test_problems_from_jsonl_and_parquet_are_graded_with_math_verify(tmp_path):
    rows = [{"q": f"What is {i}/{2 * i}?", "a": "\\frac{1}{2}"} for i in range(1, 11)]
    path = tmp_path / "half.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows))
    env = MathEnv(
        MathEnvConfig(
            task="file",
            data_path=str(path),
            question_field="q",
            answer_field="a",
            eval_fraction=0.2,
        )
    )
    assert len(env.problems("train")) == 8 and len(env.problems("eval")) == 2
    problem = env.problems("eval")[0]
    assert problem.prompt.startswith("What is")
    assert env.score(problem, "0.5").reward == 1.0
    assert env.score(problem, "The answer is $\\boxed{\\frac{2}{4}}$").reward == 1.0
    assert env.score(problem, "0.25").reward == 0.0
    assert env.score(problem, "no idea").reward == 0.0

    import pyarrow as pa
    import pyarrow.parquet as pq

    parquet = tmp_path / "eval.parquet"
    pq.write_table(pa.table({"q": ["1+1?"], "a": ["2"]}), parquet)
    with_eval_file = MathEnv(
        MathEnvConfig(
            task="file",
            data_path=str(path),
            eval_data_path=str(parquet),
            question_field="q",
            answer_field="a",
            prompt_template="Q: {question} A:",
        )
    )
    assert len(with_eval_file.problems("train")) == 10
    (only,) = with_eval_file.problems("eval")
    assert only.prompt == "Q: 1+1? A:" and with_eval_file.score(only, "2").reward == 1.0


def test_file_problems_report_bad_fields_and_formats(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps({"question": "x"}) + "\n")
    with pytest.raises(ValueError, match="no 'answer' field"):
        MathEnv(MathEnvConfig(task="file", data_path=str(path)))
    with pytest.raises(ValueError, match="needs data_path"):
        MathEnvConfig(task="file")
    with pytest.raises(ValueError, match="unknown task 'add'"):
        MathEnvConfig(task="add")
    csv = tmp_path / "p.csv"
    csv.write_text("question,answer\n")
    with pytest.raises(ValueError, match="use a .jsonl or .parquet file"):
        MathEnv(MathEnvConfig(task="file", data_path=str(csv)))


def test_default_curriculum_starts_with_add_1digit():
    lessons = default_lessons(MathEnvConfig())
    assert all(isinstance(lesson, LessonConfig) for lesson in lessons)
    assert lessons[0].id == "add_1digit" and not lessons[0].dependencies
    ids = [lesson.id for lesson in lessons]
    for lesson in lessons:
        MathEnv(MathEnvConfig(**lesson.env_config))  # every lesson's env config builds
        assert all(dep.lesson in ids for dep in lesson.dependencies)
    assert [
        lesson.id for lesson in default_lessons(MathEnvConfig(task="file", data_path="x.jsonl"))
    ] == ["file"]


def test_a_run_naming_the_math_env_gets_its_lessons():
    registry = build_registry()
    config = resolve_config(
        registry, selections={"env": "math"}, overrides=["env.partial_credit=0.25"]
    )
    assert config.env.config.partial_credit == 0.25
    assert [lesson.id for lesson in config.curriculum.lessons][0] == "add_1digit"


def test_importing_the_plugins_does_not_import_jax():
    code = (
        "import sys, marin_rl_plugins.math_env, marin_rl_plugins.mock_env, marin_rl_plugins.rloo;"
        "heavy = [m for m in ('jax', 'levanter', 'haliax', 'ray', 'math_verify', 'datasets')"
        " if m in sys.modules];"
        "assert not heavy, heavy"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


# --- datasets, answer extraction, format and correctness ---------------------------------------


@pytest.fixture
def offline_datasets(tmp_path, monkeypatch):
    """``datasets`` caches under tmp_path and never reaches for the hub: a hub name fails at
    once instead of retrying a missing network for half a minute."""
    datasets = pytest.importorskip("datasets")
    import huggingface_hub.constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "hf-datasets-cache"))


def write_dataset(root, **splits):
    """A directory of ``<split>.jsonl`` files, as ``datasets.load_dataset(root)`` reads it."""
    root.mkdir(parents=True, exist_ok=True)
    for split, rows in splits.items():
        (root / f"{split}.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return root


def gsm8k_rows(numbers):
    """GSM8K-shaped rows: the answer column is a worked solution ending in ``#### N``."""
    return [
        {
            "question": f"Sam has {n} apples and buys {n} more. How many now?",
            "answer": f"Sam has {n} + {n} = <<{n}+{n}={2 * n}>>{2 * n} apples.\n#### {2 * n}",
        }
        for n in numbers
    ]


def test_a_dataset_directory_gives_train_and_eval_splits_with_extracted_references(
    tmp_path, offline_datasets
):
    data = write_dataset(
        tmp_path / "gsm8k", train=gsm8k_rows(range(1, 11)), test=gsm8k_rows([50, 60, 70])
    )
    env = MathEnv(
        MathEnvConfig(task="dataset", dataset=str(data), prompt_template="Q: {question}\nA:")
    )
    assert isinstance(env, Env)
    train, held_out = env.problems("train"), env.problems("eval")
    assert len(train) == 10 and len(held_out) == 3
    # the reference is the number after ####, not the worked solution
    assert sorted(p.answer for p in held_out) == ["100", "120", "140"]
    assert {p.answer for p in train} == {str(2 * n) for n in range(1, 11)}
    assert held_out[0].prompt.startswith("Q: Sam has") and held_out[0].prompt.endswith("A:")
    assert not {p.id for p in train} & {p.id for p in held_out}

    problem = next(p for p in held_out if p.answer == "100")
    right = env.score(problem, "50 + 50 = 100\n#### 100")
    assert right == Score(1.0, {"format": 1.0, "correct": 1.0})
    assert env.score(problem, "#### 99") == Score(0.0, {"format": 1.0, "correct": 0.0})
    assert env.score(problem, "I do not know") == Score(0.0, {"format": 0.0, "correct": 0.0})

    # No eval split: eval_fraction of the train split is held out, never trained on.
    hold_out = MathEnv(
        MathEnvConfig(task="dataset", dataset=str(data), eval_split="", eval_fraction=0.2)
    )
    assert len(hold_out.problems("train")) == 8 and len(hold_out.problems("eval")) == 2
    assert not {p.prompt for p in hold_out.problems("train")} & {
        p.prompt for p in hold_out.problems("eval")
    }
    # One lesson, named for the dataset.
    assert [lesson.id for lesson in default_lessons(hold_out.config)] == ["gsm8k"]


def test_dataset_configs_and_data_that_do_not_fit_say_what_to_change(tmp_path, offline_datasets):
    data = write_dataset(tmp_path / "d", train=gsm8k_rows(range(5)), test=gsm8k_rows([7]))
    with pytest.raises(ValueError, match="needs dataset"):
        MathEnvConfig(task="dataset")
    with pytest.raises(ValueError, match='set eval_split = ""'):
        MathEnvConfig(task="dataset", dataset=str(data), eval_split="train")
    with pytest.raises(ValueError, match="unknown extract 'regex'"):
        MathEnvConfig(extract="regex")
    with pytest.raises(ValueError, match="no 'problem' column .*question_field"):
        MathEnv(MathEnvConfig(task="dataset", dataset=str(data), question_field="problem"))
    with pytest.raises(ValueError, match=r"row 0: answer_extraction = 'boxed' finds no answer"):
        MathEnv(MathEnvConfig(task="dataset", dataset=str(data), answer_extraction="boxed"))
    with pytest.raises(ValueError, match="split 'validation' could not be loaded .*Unknown split"):
        MathEnv(MathEnvConfig(task="dataset", dataset=str(data), eval_split="validation"))
    with pytest.raises(ValueError, match="does not exist"):
        MathEnv(MathEnvConfig(task="dataset", dataset=str(tmp_path / "nowhere")))


def test_a_hub_dataset_that_cannot_be_loaded_says_to_pass_a_local_path(offline_datasets):
    config = MathEnvConfig(
        task="dataset", dataset="no-such-org/no-such-dataset", dataset_config="main"
    )
    with pytest.raises(ValueError) as info:
        MathEnv(config)  # parsing the config loads nothing; building the env does
    message = str(info.value)
    assert "\n" not in message
    assert (
        "'no-such-org/no-such-dataset' (config 'main') split 'train' could not be loaded" in message
    )
    assert (
        "no-such-org/no-such-dataset" in message.split("could not be loaded (", 1)[1]
    )  # the reason
    assert "pass a local path" in message and "directory of .jsonl/.parquet files" in message
    assert "data_path" in message


@pytest.mark.parametrize(
    ("response", "expected"),
    [
        (
            "First \\boxed{1}, then \\boxed{\\frac{\\sqrt{2}}{2}}.",
            {
                "boxed": "\\frac{\\sqrt{2}}{2}",
                "hash": None,
                "last_number": "2",
                "auto": "\\frac{\\sqrt{2}}{2}",
            },
        ),
        (
            "Sam has 3 + 4 = 7 apples.\n#### 7",
            {"boxed": None, "hash": "7", "last_number": "7", "auto": "7"},
        ),
        (
            "It drops from 5-3 to -12.5 degrees.",
            {"boxed": None, "hash": None, "last_number": "-12.5", "auto": "-12.5"},
        ),
        (
            "That is 1,600 dollars or 0.25 of it",
            {"boxed": None, "hash": None, "last_number": "0.25", "auto": "0.25"},
        ),
        (
            "an unfinished \\boxed{x and \\boxed{} nothing else",
            {"boxed": None, "hash": None, "last_number": None, "auto": None},
        ),
        ("I do not know", {"boxed": None, "hash": None, "last_number": None, "auto": None}),
    ],
)
def test_each_extraction_mode_takes_its_answer_or_none(response, expected):
    for how, answer in expected.items():
        assert extract_answer(response, how) == answer, how
    assert extract_answer(response, "none") == response.strip()


def test_format_and_correctness_are_graded_separately_with_math_verify(tmp_path):
    path = tmp_path / "half.jsonl"
    path.write_text(
        "\n".join(
            json.dumps({"question": f"What is {i}/{2 * i}?", "answer": "0.5"}) for i in range(1, 6)
        )
    )

    def env(**kw):
        return MathEnv(MathEnvConfig(task="file", data_path=str(path), eval_fraction=0.2, **kw))

    auto = env()
    problem = auto.problems("eval")[0]
    graded = {
        "so it is \\boxed{\\frac{1}{2}}": (1.0, 1.0),  # equivalent forms verify
        "halve it: $\\boxed{\\dfrac{2}{4}}$": (1.0, 1.0),
        "#### 0.50": (1.0, 1.0),
        "one half, 0.5": (1.0, 1.0),
        "\\boxed{\\frac{1}{3}}": (1.0, 0.0),  # well formed, wrong
        "about a half": (0.0, 0.0),  # no answer at all
    }
    for response, (format_, correct) in graded.items():
        score = auto.score(problem, response)
        assert score.metrics == {"format": format_, "correct": correct}, response
        assert score.reward == correct, response

    # extract = "boxed" asks for a box: a bare right number is not well formed.
    boxed = env(extract="boxed")
    assert boxed.score(problem, "0.5").metrics == {"format": 0.0, "correct": 0.0}
    assert boxed.score(problem, "\\boxed{0.5}").metrics == {"format": 1.0, "correct": 1.0}
    # extract = "none": math-verify reads the whole response.
    whole = env(extract="none")
    assert whole.score(problem, "it is \\frac{1}{2}").reward == 1.0
    assert whole.score(problem, "no idea").metrics == {"format": 0.0, "correct": 0.0}

    # format_reward pays a well-formed wrong answer in training only.
    shaped = env(format_reward=0.25)
    train_problem, eval_problem = shaped.problems("train")[0], shaped.problems("eval")[0]
    assert shaped.score(train_problem, "\\boxed{3}").reward == 0.25
    assert shaped.score(train_problem, "no idea").reward == 0.0
    assert shaped.score(train_problem, "\\boxed{1/2}").reward == 1.0
    assert shaped.score(eval_problem, "\\boxed{3}").reward == 0.0


def test_score_metrics_are_floats_and_cannot_shadow_reward():
    assert Score(1, {"correct": True}).metrics == {"correct": 1.0}
    with pytest.raises(ValueError, match="'reward' is not allowed"):
        Score(1.0, {"reward": 1.0})


def test_rollouts_and_eval_report_format_and_correct_rates(tmp_path, offline_datasets):
    """End to end on the tiny default model: training batches carry ``score/format`` and
    ``score/correct``, and eval logs ``eval/<lesson>/format`` and ``/correct`` beside the reward."""
    from marin_rl_core.rollout.worker import RolloutWorker

    sums = [{"question": f"{a}+{b}=", "answer": str(a + b)} for a in range(5) for b in range(5)]
    data = write_dataset(tmp_path / "sums", train=sums[:20], test=sums[20:])
    registry = build_registry()
    config = resolve_config(
        registry,
        selections={"env": "math"},
        overrides=[
            "env.task=dataset",
            f"env.dataset={data}",
            "env.extract=last_number",
            "env.format_reward=0.5",
            "sampling.n_prompts=4",
            "eval.n_examples=5",
        ],
    )
    assert [lesson.id for lesson in config.curriculum.lessons] == ["sums"]
    logged: list[dict] = []
    worker = RolloutWorker(
        config,
        registry,
        worker_index=0,
        writer=None,
        weight_client=None,
        curriculum=registry.get("curriculum", config.curriculum.name).build(
            config.curriculum.config, config.curriculum.lessons
        ),
        log=lambda metrics, *, step, source: logged.append(metrics),
    )
    batch, metrics = worker.manager.sample_batch(
        "sums", n_examples=4, n_generations=8, mode="train", seed=0, weight_step=0, worker_id="w"
    )
    fmt, correct = metrics["score/format"], metrics["score/correct"]
    assert 0.0 < fmt <= 1.0 and 0.0 <= correct <= fmt
    # The reward is correctness, plus format_reward for each well-formed wrong answer.
    assert metrics["reward"] == pytest.approx(correct + 0.5 * (fmt - correct))
    assert len(batch.rollouts) == 32

    eval_metrics = worker.evaluate()
    assert set(eval_metrics) >= {"eval/sums/reward", "eval/sums/format", "eval/sums/correct"}
    assert eval_metrics["eval/sums/reward"] == pytest.approx(eval_metrics["eval/sums/correct"])
    assert logged == [eval_metrics]
    stats, _ = worker.manager.evaluate_lesson(
        "sums", n_examples=5, eval_type="micro_eval", seed=1, step=0, weight_step=0, worker_id="w"
    )
    assert set(stats.metrics) == {"format", "correct"}


def test_the_documented_dataset_config_is_a_valid_math_config():
    import tomllib
    from pathlib import Path

    docs = (Path(__file__).resolve().parents[1] / "docs" / "plugins.md").read_text()
    block = next(b for b in docs.split("```toml")[1:] if 'task = "dataset"' in b).split("```")[0]
    env = tomllib.loads(block)["env"]
    assert env.pop("name") == "math"
    config = MathEnvConfig(**env)  # builds nothing: the dataset is loaded by the env
    assert config.dataset == "openai/gsm8k" and config.extract == "auto"
    assert [lesson.id for lesson in default_lessons(config)] == ["gsm8k"]


def test_grading_is_bounded_in_any_thread(caplog):
    """math-verify's own timeout works only in a main thread; rollout workers score in others.
    A response whose grading would run for hours (sympy evaluating 9^9^9^9) is cut off, counts
    as wrong, and the next response is graded as usual."""
    import threading

    from marin_rl_plugins.math_env import BoundedGrader

    grader = BoundedGrader()
    results = {}

    def grade_in_a_worker_thread():
        results["hang"] = grader.grade("42", "\\boxed{9^{9^{9^{9}}}}", "auto", 2.0)
        results["next"] = grader.grade("42", "so it is \\boxed{42}", "auto", 30.0)

    thread = threading.Thread(target=grade_in_a_worker_thread)
    thread.start()
    thread.join(120)
    assert not thread.is_alive(), "grading did not return"
    assert results == {"hang": (True, False), "next": (True, True)}
    assert grader.timeouts == 1
    assert "took longer than 2 s (grading_timeout_s)" in caplog.text
