"""The ``mock`` env: tiny synthetic tasks for tests and demos, graded by exact match.

=============  ==========================  ===========
task           prompt                      answer
=============  ==========================  ===========
``count``      ``count: cat dog cat``      ``3``
``sort``       ``sort: 5 2 9``             ``2 5 9``
``reverse``    ``reverse: 3 1 4``          ``4 1 3``
``copy``       ``copy: 3 1 4``             ``3 1 4``
``max``        ``max: 3 1 4``              ``4``
=============  ==========================  ===========

Every prompt and answer is made of tokens of the arithmetic tokenizer. A problem belongs to the
eval split when a hash of its prompt falls below ``eval_fraction``; ``mode="train"`` never
returns one.
"""

from __future__ import annotations

import hashlib

import attrs
import numpy as np

from marin_rl_core import EnvPlugin, Problem, hookimpl, one_of

WORDS = ("cat", "dog", "fox", "owl", "bee", "ant", "cow", "pig", "hen", "yak")
TASKS = ("count", "sort", "reverse", "copy", "max")


@attrs.frozen(kw_only=True)
class MockEnvConfig:
    """Args:
    task: which task (see the module docstring).
    min_items: fewest words/numbers in a prompt.
    max_items: most words/numbers in a prompt.
    max_value: numbers are drawn from ``0..max_value`` (at most 99).
    eval_fraction: the share of problems held out for eval.
    """

    task: str = attrs.field(default="count", validator=one_of(*TASKS))
    min_items: int = attrs.field(default=1, validator=attrs.validators.ge(1))
    max_items: int = attrs.field(default=4, validator=attrs.validators.ge(1))
    max_value: int = attrs.field(
        default=9, validator=[attrs.validators.ge(1), attrs.validators.le(99)]
    )
    eval_fraction: float = attrs.field(
        default=0.2, validator=[attrs.validators.gt(0.0), attrs.validators.lt(1.0)]
    )

    def __attrs_post_init__(self) -> None:
        if self.max_items < self.min_items:
            raise ValueError(f"max_items ({self.max_items}) is below min_items ({self.min_items})")


def _eval_bucket(prompt: str) -> float:
    return int.from_bytes(hashlib.sha256(prompt.encode()).digest()[:8], "big") / 2**64


class MockEnv:
    """Implements :class:`marin_rl_core.Env`; see the module docstring."""

    def __init__(self, config: MockEnvConfig):
        self.config = config

    def make_problem(self, rng: np.random.Generator) -> Problem:
        """One random problem of the configured task."""
        c = self.config
        k = int(rng.integers(c.min_items, c.max_items + 1))
        if c.task == "count":
            words = [WORDS[i] for i in rng.integers(0, len(WORDS), size=k)]
            prompt, answer = "count: " + " ".join(words), str(k)
        else:
            values = [int(v) for v in rng.integers(0, c.max_value + 1, size=k)]
            result = {
                "sort": sorted(values),
                "reverse": values[::-1],
                "copy": values,
                "max": [max(values)],
            }[c.task]
            prompt = f"{c.task}: " + " ".join(map(str, values))
            answer = " ".join(map(str, result))
        return Problem(id=f"{c.task}:{prompt}", prompt=prompt, answer=answer, info={"task": c.task})

    def sample_problems(self, n: int, *, mode: str, seed: int) -> list[Problem]:
        if mode not in ("train", "eval"):
            raise ValueError(f"mode must be 'train' or 'eval', got {mode!r}")
        rng = np.random.default_rng([seed, 0 if mode == "train" else 1])
        want_eval = mode == "eval"
        out: list[Problem] = []
        attempts = 0
        while len(out) < n:
            attempts += 1
            if attempts > 1000 * n:
                raise RuntimeError(
                    f"could not draw {n} {mode} problems; widen the mock task's ranges"
                )
            problem = self.make_problem(rng)
            if (_eval_bucket(problem.prompt) < self.config.eval_fraction) == want_eval:
                out.append(problem)
        return out

    def score(self, problem: Problem, response: str) -> float:
        return 1.0 if response.strip() == problem.answer else 0.0


@hookimpl
def marinrl_register_envs():
    yield EnvPlugin(
        name="mock",
        summary="Tiny synthetic tasks (count, sort, reverse, copy, max) for tests and demos.",
        config_class=MockEnvConfig,
        build=MockEnv,
    )
