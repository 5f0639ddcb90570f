"""The ``default`` curriculum: unlocking, edge-of-competence weights, graduation and regression."""

from __future__ import annotations

import json

import pytest
from marin_rl_plugins.default_curriculum import DefaultCurriculum, DefaultCurriculumConfig

from marin_rl_core import LessonConfig, LessonDependency, LessonStats


def lessons():
    return [
        LessonConfig(id="easy", stop_threshold=0.95),
        LessonConfig(
            id="hard",
            dependencies=(LessonDependency(lesson="easy", reward_threshold=0.9),),
            stop_threshold=0.9,
        ),
    ]


def stats(lesson, reward, step=0):
    return LessonStats(lesson_id=lesson, mean_reward=reward, n_rollouts=8, step=step)


@pytest.fixture()
def policy():
    return DefaultCurriculum(DefaultCurriculumConfig(), lessons())


def test_a_lesson_unlocks_when_its_dependency_reaches_the_threshold_and_stays_unlocked(policy):
    assert policy.lesson_states() == {"easy": "active", "hard": "locked"}
    policy.update_eval(stats("easy", 0.89))
    assert policy.lesson_states()["hard"] == "locked"
    policy.update_eval(stats("easy", 0.91))
    assert policy.lesson_states()["hard"] == "active"
    policy.update_eval(stats("easy", 0.5))  # a bad eval later does not lock it again
    assert policy.lesson_states()["hard"] == "active"
    assert {policy.sample_lesson(seed=s) for s in range(200)} == {"easy", "hard"}


def test_lessons_at_the_edge_of_competence_get_the_most_batches(policy):
    policy.update_eval(stats("easy", 0.91))
    for _ in range(20):
        policy.update_training(stats("easy", 0.98))  # nearly solved
        policy.update_training(stats("hard", 0.5))  # half right: the most to learn
    weights = policy.sampling_weights()
    assert weights["hard"] > 2 * weights["easy"]
    assert sum(weights.values()) == pytest.approx(1.0)


def test_a_graduated_lesson_keeps_a_share_and_is_reactivated_when_forgotten(policy):
    policy.update_eval(stats("easy", 0.96))
    assert policy.lesson_states() == {"easy": "graduated", "hard": "active"}
    policy.update_training(stats("hard", 0.5))
    graduated_share = policy.sampling_weights()["easy"]
    assert 0.1 < graduated_share < 0.5  # reviewed, not dropped
    policy.update_eval(stats("easy", 0.9))  # within the regression margin: still graduated
    assert policy.lesson_states()["easy"] == "graduated"
    policy.update_eval(stats("easy", 0.8))  # forgotten: trained on again
    assert policy.lesson_states()["easy"] == "active"
    policy.update_training(stats("easy", 0.5))
    assert policy.sampling_weights()["easy"] > graduated_share
    policy.update_eval(stats("easy", 0.95))
    assert policy.lesson_states()["easy"] == "graduated"


def test_state_survives_a_json_round_trip(policy):
    policy.update_eval(stats("easy", 0.96))
    policy.update_eval(stats("easy", 0.7))
    policy.update_training(stats("hard", 0.3))
    restored = DefaultCurriculum(DefaultCurriculumConfig(), lessons())
    restored.load_state_dict(json.loads(json.dumps(policy.state_dict())))
    assert (
        restored.lesson_states() == policy.lesson_states() == {"easy": "active", "hard": "active"}
    )
    assert restored.sampling_weights() == pytest.approx(policy.sampling_weights())


def test_state_of_an_unknown_lesson_is_rejected(policy):
    with pytest.raises(ValueError, match="unknown lessons: \\['gone'\\]"):
        policy.load_state_dict({"eval_history": {"gone": [0.5]}})


def test_a_locked_lesson_that_scores_well_stays_locked_and_unsampled(policy):
    policy.update_eval(stats("hard", 1.0))  # it happens to score above its stop threshold
    assert policy.lesson_states()["hard"] == "locked"
    assert {policy.sample_lesson(seed=s) for s in range(100)} == {"easy"}
    policy.update_eval(stats("easy", 0.91))  # now its dependency is met
    policy.update_eval(stats("hard", 1.0))
    assert policy.lesson_states()["hard"] == "graduated"


def test_an_eval_with_no_scored_problem_changes_nothing(policy):
    policy.update_eval(stats("easy", 0.96))
    assert policy.lesson_states()["easy"] == "graduated"
    before = policy.state_dict()
    empty = LessonStats(lesson_id="easy", mean_reward=0.0, n_rollouts=0, step=5)
    policy.update_eval(empty)  # every problem was dropped: not a score of 0
    assert policy.state_dict() == before
    assert policy.lesson_states()["easy"] == "graduated"
