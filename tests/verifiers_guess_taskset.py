"""A multi-turn verifiers (0.4.0) environment for tests/test_verifiers_env.py: the taskset exports
an ``Env`` of its own that plays the user, as verifiers' own conversational envs do. The policy
guesses a digit three times, told after each guess whether the hidden digit is higher or lower;
the rubric rewards a guess that names it. Imported by verifiers by its id
(``verifiers_guess_taskset``), so ``tests/`` must be on the path of the process that runs it."""

import re

import verifiers.v1 as vf

TURNS = 3


class GuessData(vf.TaskData):
    hidden: int


class GuessTask(vf.Task[GuessData]):
    @vf.reward(weight=1.0)
    async def found(self, trace) -> float:
        replies = [m.content for m in trace.messages if m.role == "assistant"]
        return float(any(str(self.data.hidden) in (text or "") for text in replies))

    @vf.metric
    async def guesses(self, trace) -> float:
        return float(sum(m.role == "assistant" for m in trace.messages))


class GuessTaskset(vf.Taskset[GuessTask, vf.TasksetConfig]):
    def load(self):
        return [
            GuessTask(GuessData(prompt="guess the digit", hidden=d), self.config.task)
            for d in range(10)
        ]


class GuessEnvConfig(vf.EnvConfig):
    agent: vf.AgentConfig = vf.AgentConfig()


class GuessEnv(vf.Env[GuessEnvConfig]):
    async def run(self, task, agents):
        async with agents.agent.interaction(task) as game:
            segment = await game.turn()
            for _ in range(TURNS - 1):
                guess = re.search(r"\d", segment.last_reply or "")
                if guess is None:
                    feedback = "a digit please"
                elif int(guess.group()) == task.data.hidden:
                    return
                else:
                    higher = int(guess.group()) < task.data.hidden
                    feedback = "higher" if higher else "lower"
                segment = await game.turn(feedback)


__all__ = ["GuessEnv", "GuessTaskset"]
