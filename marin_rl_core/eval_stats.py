"""The statistics ``marinrl eval`` reports (issue 63), from each problem's samples: mean reward,
pass@k (the unbiased estimator from ``n`` samples), maj@k (the most common answer of ``k``
samples), each with a 95% interval over the problems.

A leaf module (numpy and scipy only): what a user recomputes by hand from ``samples.jsonl``.

* **pass@k** of a problem with ``c`` of its ``n`` samples correct is ``1 - C(n-c, k) / C(n, k)``
  (Chen et al. 2021, the chance that ``k`` of the ``n`` drawn without replacement hold a
  correct one); of a lesson, the mean over its problems. pass@1 is the fraction correct.
* **maj@k**: a problem's first ``k`` samples vote with their answers (a sample without one does
  not vote); the answer with the most votes wins, a tie going to the one reached first; the
  problem counts as solved when a sample with that answer is correct.
* **Intervals** (95%) are over problems (the problems are the sample; a problem's samples are
  not independent draws of the lesson): for pass@k and maj@k, whose values lie in [0, 1], the
  Wilson score interval of the mean with as many trials as problems (it stays inside [0, 1] and
  is not empty at 0 or 1); for the mean reward, Student's t interval of the mean of the
  problems' mean rewards.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from typing import Any

import attrs

INTERVALS = "95% intervals over problems: Wilson score for pass@k and maj@k, Student's t for reward"
"""What the intervals are, as printed beside them."""


@attrs.frozen
class Estimate:
    """A mean over problems and its 95% interval."""

    value: float
    low: float
    high: float

    def as_dict(self) -> dict[str, float]:
        return {"value": self.value, "low": self.low, "high": self.high}

    def __str__(self) -> str:
        return f"{self.value:.3f} [{self.low:.3f}, {self.high:.3f}]"


def pass_at_k(n: int, c: int, k: int) -> float:
    """The unbiased pass@k of one problem: ``c`` of its ``n`` samples correct, ``k <= n``."""
    if not 0 < k <= n or not 0 <= c <= n:
        raise ValueError(f"pass@{k} of {c} correct in {n} samples: need 0 < k <= n, 0 <= c <= n")
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def majority_correct(answers: Sequence[str | None], correct: Sequence[bool], k: int) -> bool:
    """Whether the majority answer of the first ``k`` samples is a correct one (see the module
    docstring); ``False`` when none of them has an answer."""
    votes = Counter(a for a in answers[:k] if a is not None)
    if not votes:
        return False
    most = max(votes.values())
    winner = next(a for a in answers[:k] if a is not None and votes[a] == most)
    return any(a == winner and ok for a, ok in zip(answers[:k], correct[:k], strict=True))


def wilson(values: Sequence[float], z: float = 1.959964) -> Estimate:
    """The mean of ``values`` (each in [0, 1]) with its Wilson score interval, as many trials as
    values."""
    n = len(values)
    p = sum(values) / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z / (1 + z * z / n) * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
    low = 0.0 if p <= 0 else max(0.0, centre - half)  # (exactly 0 and 1 at the ends)
    return Estimate(p, low, 1.0 if p >= 1 else min(1.0, centre + half))


def student_t(values: Sequence[float]) -> Estimate:
    """The mean of ``values`` with Student's t 95% interval (a point when there is one value)."""
    from scipy.stats import t

    n = len(values)
    mean = sum(values) / n
    if n < 2:
        return Estimate(mean, mean, mean)
    sd = math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1))
    half = float(t.ppf(0.975, n - 1)) * sd / math.sqrt(n)
    return Estimate(mean, mean - half, mean + half)


def summarize(
    problems: Sequence[Sequence[dict[str, Any]]], ks: Sequence[int], *, majority: bool
) -> dict[str, Any]:
    """The statistics of problems' samples: ``problems[i]`` holds problem ``i``'s sample rows
    (``reward``, ``correct``, and with ``majority`` the ``answer``, ``None`` where a response
    has none). A problem's first ``n`` samples count, ``n`` the fewest any problem has; ``ks``
    above ``n`` are left out. Returns ``{"problems", "samples", "reward": Estimate,
    "pass@k": Estimate ..., "maj@k": Estimate ...}`` (maj@k with ``majority``: the env says
    what a response's answer is)."""
    if not problems:
        return {"problems": 0, "samples": 0}
    n = min(len(p) for p in problems)
    out: dict[str, Any] = {
        "problems": len(problems),
        "samples": n,
        "reward": student_t([sum(s["reward"] for s in p[:n]) / n for p in problems]),
    }
    for k in sorted(set(ks)):
        if not 0 < k <= n:
            continue
        out[f"pass@{k}"] = wilson(
            [pass_at_k(n, sum(bool(s["correct"]) for s in p[:n]), k) for p in problems]
        )
        if majority and k > 1:  # maj@1 is the first sample's pass
            out[f"maj@{k}"] = wilson(
                [
                    float(
                        majority_correct(
                            [s["answer"] for s in p[:n]], [bool(s["correct"]) for s in p[:n]], k
                        )
                    )
                    for p in problems
                ]
            )
    return out


__all__ = [
    "INTERVALS",
    "Estimate",
    "majority_correct",
    "pass_at_k",
    "student_t",
    "summarize",
    "wilson",
]
