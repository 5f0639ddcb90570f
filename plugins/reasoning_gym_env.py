"""The ``reasoning_gym`` env: any procedural dataset of the ``reasoning-gym`` package, graded by
its own scorer.

``reasoning-gym`` (``pip install 'marin-rl[reasoning]'``) generates problems in code (no
downloads): arithmetic, logic puzzles, counting, ciphers, graph tasks and ~100 more, each with a
``score_answer``. Pick one by name::

    marinrl run --model ./my-qwen3 --env reasoning_gym --set env.dataset=leg_counting \\
        --set model.max_seq_len=512 --set sampling.max_tokens=256

* the prompt is the dataset's question followed by ``instruction`` (by default: answer inside
  ``<answer></answer>`` tags);
* the response's answer is the text of its last ``<answer>...</answer>`` (``extract =
  "answer_tag"``), its last ``\\boxed{...}`` (``"boxed"``) or the whole response (``"none"``),
  scored by the dataset's ``score_answer`` (1.0 for right; some datasets give partial credit);
* training draws from ``size`` problems generated with ``seed``, eval from ``eval_size`` others
  generated with a seed of their own.

Score metrics: ``format`` (an answer could be extracted) and ``correct`` (scored 1.0). The
problems are written in English: this env is for models with a Hugging Face tokenizer.
"""

from __future__ import annotations

import difflib
import re
from typing import Any

import attrs
import numpy as np

from marin_rl_core import EnvPlugin, Problem, Score, hookimpl, one_of

_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.S)
_BOXED = re.compile(r"\\boxed\{((?:[^{}]|\{[^{}]*\})*)\}")
EVAL_SEED_OFFSET = 1_000_003


INSTALL_HINT = (
    "the reasoning_gym env needs the reasoning-gym package: pip install 'marin-rl[reasoning]'"
)


def _known_dataset(instance: Any, attribute: Any, value: str) -> None:
    try:
        import reasoning_gym.factory
    except ImportError:
        return  # checked when the env is built, with the install hint
    names = sorted(reasoning_gym.factory.DATASETS)
    if value not in names:
        close = difflib.get_close_matches(value, names, n=3)
        hint = (
            f"; did you mean {', '.join(close)}?"
            if close
            else f" (one of {len(names)}: {', '.join(names[:8])}, ...)"
        )
        raise ValueError(f"reasoning-gym has no dataset {value!r}{hint}")


@attrs.frozen(kw_only=True)
class ReasoningGymEnvConfig:
    """Args:
    dataset: the reasoning-gym dataset's name (``leg_counting``, ``basic_arithmetic``, ...).
    size: training problems (generated on demand).
    eval_size: held-out problems.
    seed: generates the training problems (eval uses its own seed).
    instruction: appended to every question.
    extract: how the answer is taken from a response: ``answer_tag``, ``boxed`` or ``none``.
    """

    dataset: str = attrs.field(default="leg_counting", validator=_known_dataset)
    size: int = attrs.field(default=10_000, validator=attrs.validators.ge(1))
    eval_size: int = attrs.field(default=200, validator=attrs.validators.ge(1))
    seed: int = 0
    instruction: str = "Give only your final answer, inside <answer></answer> tags."
    extract: str = attrs.field(
        default="answer_tag", validator=one_of("answer_tag", "boxed", "none")
    )


def extract_answer(response: str, how: str) -> str | None:
    """The answer in ``response`` (see the module docstring); ``None`` when there is none."""
    if how == "none":
        return response.strip()
    found = (_ANSWER_TAG if how == "answer_tag" else _BOXED).findall(response)
    return found[-1].strip() if found else None


def preflight(config: ReasoningGymEnvConfig) -> list[str]:
    """The optional package is installed (checked before the job starts)."""
    import importlib.util

    try:
        installed = importlib.util.find_spec("reasoning_gym") is not None
    except (ImportError, ValueError):  # a module that failed to import, or was blocked
        installed = False
    return [] if installed else [INSTALL_HINT]


class ReasoningGymEnv:
    """Implements :class:`marin_rl_core.Env` (single-turn); see the module docstring."""

    def __init__(self, config: ReasoningGymEnvConfig):
        try:
            import reasoning_gym
        except ImportError as exc:
            raise RuntimeError(INSTALL_HINT) from exc

        self.config = config
        self._datasets = {
            "train": reasoning_gym.create_dataset(
                config.dataset, size=config.size, seed=config.seed
            ),
            "eval": reasoning_gym.create_dataset(
                config.dataset, size=config.eval_size, seed=config.seed + EVAL_SEED_OFFSET
            ),
        }

    def sample_problems(self, n: int, *, mode: str, seed: int) -> list[Problem]:
        if mode not in self._datasets:
            raise ValueError(f"mode must be 'train' or 'eval', got {mode!r}")
        dataset = self._datasets[mode]
        if mode == "eval":
            indices = list(range(min(n, len(dataset))))
        else:
            rng = np.random.default_rng([seed, 5])
            indices = [int(i) for i in rng.integers(0, len(dataset), size=n)]
        problems = []
        for index in indices:
            entry = dataset[index]
            question = str(entry["question"])
            prompt = (
                f"{question}\n\n{self.config.instruction}" if self.config.instruction else question
            )
            problems.append(
                Problem(
                    id=f"{self.config.dataset}:{mode}:{index}",
                    prompt=prompt,
                    answer=str(entry["answer"]),
                    info={"mode": mode, "index": index},
                )
            )
        return problems

    def score(self, problem: Problem, response: str) -> Score:
        dataset = self._datasets[problem.info["mode"]]
        entry = dataset[int(problem.info["index"])]
        answer = extract_answer(response, self.config.extract)
        reward = 0.0 if answer is None else float(dataset.score_answer(answer=answer, entry=entry))
        return Score(reward, {"format": float(answer is not None), "correct": float(reward >= 1.0)})


@hookimpl
def marinrl_register_envs():
    yield EnvPlugin(
        name="reasoning_gym",
        summary="Any reasoning-gym dataset by name, graded by its own scorer (HF models).",
        config_class=ReasoningGymEnvConfig,
        build=ReasoningGymEnv,
        preflight=preflight,
    )
