"""A single-turn verifiers (0.4.0) taskset for tests/test_verifiers_env.py: sums of two digits,
its rubric rewarding a reply with a digit in it and, apart, the right answer. ``REPLIES`` holds each
task's replies as the rubric saw them (the test's in-process rollout worker shares it). Imported by
verifiers by its id (``verifiers_sum_taskset``), so ``tests/`` must be on the path of the process
that runs it."""

import re

import verifiers.v1 as vf

REPLIES: dict[str, list[str]] = {}  # each task's replies, as the rubric saw them


class SumData(vf.TaskData):
    answer: str


class SumTask(vf.Task[SumData]):
    @vf.reward(weight=1.0)
    async def has_digit(self, trace) -> float:
        """A random tiny model earns this sometimes."""
        REPLIES.setdefault(self.data.prompt, []).append(trace.last_reply)
        return float(re.search(r"\d", trace.last_reply) is not None)

    @vf.reward(weight=1.0)
    async def exact(self, trace) -> float:
        """... and this almost never."""
        return float(trace.last_reply.strip() == self.data.answer)


class SumTaskset(vf.Taskset[SumTask, vf.TasksetConfig]):
    def load(self):
        return [
            SumTask(SumData(prompt=f"what is the sum of {a} and {b}", answer=str(a + b)))
            for a in range(4)
            for b in range(4)
        ]


__all__ = ["SumTaskset"]
