"""The math env: generated arithmetic, held-out splits, grading, file problems, lessons."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from marin_rl_plugins.math_env import MathEnv, MathEnvConfig, default_lessons

from marin_rl_core import Env, LessonConfig, build_registry
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
        MathEnvConfig(task="file", data_path=str(path), question_field="q", answer_field="a", eval_fraction=0.2)
    )
    assert len(env.problems("train")) == 8 and len(env.problems("eval")) == 2
    problem = env.problems("eval")[0]
    assert problem.prompt.startswith("What is")
    assert env.score(problem, "0.5") == 1.0
    assert env.score(problem, "The answer is $\\boxed{\\frac{2}{4}}$") == 1.0
    assert env.score(problem, "0.25") == 0.0
    assert env.score(problem, "no idea") == 0.0

    import pyarrow as pa
    import pyarrow.parquet as pq

    parquet = tmp_path / "eval.parquet"
    pq.write_table(pa.table({"q": ["1+1?"], "a": ["2"]}), parquet)
    with_eval_file = MathEnv(
        MathEnvConfig(
            task="file", data_path=str(path), eval_data_path=str(parquet), question_field="q", answer_field="a",
            prompt_template="Q: {question} A:",
        )
    )
    assert len(with_eval_file.problems("train")) == 10
    (only,) = with_eval_file.problems("eval")
    assert only.prompt == "Q: 1+1? A:" and with_eval_file.score(only, "2") == 1.0


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
    assert [lesson.id for lesson in default_lessons(MathEnvConfig(task="file", data_path="x.jsonl"))] == ["file"]


def test_a_run_naming_the_math_env_gets_its_lessons():
    registry = build_registry()
    config = resolve_config(registry, selections={"env": "math"}, overrides=["env.partial_credit=0.25"])
    assert config.env.config.partial_credit == 0.25
    assert [lesson.id for lesson in config.curriculum.lessons][0] == "add_1digit"


def test_importing_the_plugins_does_not_import_jax():
    code = (
        "import sys, marin_rl_plugins.math_env, marin_rl_plugins.mock_env, marin_rl_plugins.rloo;"
        "heavy = [m for m in ('jax', 'levanter', 'haliax', 'ray', 'math_verify') if m in sys.modules];"
        "assert not heavy, heavy"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
