"""What does the agent endpoint cost? Rollout tokens/s of agent episodes talking HTTP to the
worker's OpenAI-compatible endpoint vs the same episodes through the in-process multi-turn API,
side by side.

Runs 64 concurrent episodes (16 problems x 4 samples) of the default tiny model, each ``--turns``
actions of up to ``--action-tokens`` tokens answered by a one-token observation, three ways:

* in process: a multi-turn env whose ``step`` answers at once;
* through HTTP: an agent program per episode (``openai.AsyncOpenAI``, or ``openai.OpenAI`` on a
  thread with ``--client sync``) that sends the game so far to ``/v1/completions``, appends the
  reply and the observation, and asks again; its programs in the rollout worker's process, and
  again in ``--processes`` env processes (``episodes.env_processes``: the clients' Python off
  the worker's interpreter; 0 skips it).

All sample the very same tokens (the endpoint continues each call from the recorded ids, with
the same per-episode seeds), so the ratio is the endpoint's overhead alone: HTTP, JSON, the
client, batching the calls back together. Batches alternate, ``--batches`` of each way; the
median is taken over the batches that compiled nothing (the steady state: a shape compiles
once, and the compile cache keeps it), and the table says how many those were and how many
compilations the others met. Warm-up goes on past ``--warm-up`` batches until one compiles
nothing (at most 3x as many). The bar (issue 30): HTTP / in process >= 0.8.

    python bench/agent_endpoint.py [--turns 4] [--action-tokens 16] [--batches 5] [--warm-up 3]
        [--client async|sync] [--processes 4] [--set KEY=VALUE ...]
"""

from __future__ import annotations

import argparse
import statistics
from typing import Any

import attrs
from episode_bench import add_episode_args, episode_managers, timed_batch

from marin_rl_core import AgentClients, EnvPlugin, Problem, Step, build_registry, hookimpl


@attrs.frozen
class TalkConfig:
    turns: int = 4
    client: str = "async"


def _prompt(i: int) -> str:
    return f"count: cat dog {i % 10}"


class TalkEpisode:
    def __init__(self, config: TalkConfig):
        self.config, self.turn = config, 0

    def step(self, action) -> Step:
        self.turn += 1
        done = self.turn >= self.config.turns
        return Step(observation="!", reward=float(done), done=done)


class TalkEnv:
    """In process: ``turns`` actions, each answered with ``!``."""

    def __init__(self, config: TalkConfig):
        self.config = config

    def sample_problems(self, n, *, mode, seed):
        return [Problem(id=str(i), prompt=_prompt(i)) for i in range(n)]

    def reset(self, problem):
        return TalkEpisode(self.config)


class TalkAgentEnv:
    """Through HTTP: the same conversation, as an OpenAI-client program."""

    def __init__(self, config: TalkConfig):
        self.config = config
        self._clients = AgentClients()

    def sample_problems(self, n, *, mode, seed):
        return [Problem(id=str(i), prompt=_prompt(i)) for i in range(n)]

    def _client(self, endpoint):
        if self.config.client == "async":
            return self._clients.asynchronous(endpoint)
        return self._clients.sync(endpoint)

    def run_agent(self, problem, endpoint):
        client = self._client(endpoint)
        if self.config.client == "async":
            return self._talk_async(client, problem.prompt)
        prompt = problem.prompt
        for _ in range(self.config.turns):
            prompt += client.completions.create(model="m", prompt=prompt).choices[0].text + "!"
        return 1.0

    async def _talk_async(self, client, prompt: str) -> float:
        for _ in range(self.config.turns):
            reply = await client.completions.create(model="m", prompt=prompt)
            prompt += reply.choices[0].text + "!"
        return 1.0


class talk_plugins:
    @staticmethod
    @hookimpl
    def marinrl_register_envs():
        yield EnvPlugin(name="talk", summary="in process", config_class=TalkConfig, build=TalkEnv)
        yield EnvPlugin(
            name="talk_agent", summary="over HTTP", config_class=TalkConfig, build=TalkAgentEnv
        )


def _compilations() -> Any:
    """A counter of the XLA compilations since it was made (JAX's monitoring events)."""
    import jax.monitoring

    count = [0]

    def listen(event: str, seconds: float, **kwargs: Any) -> None:
        if "backend_compile" in event:
            count[0] += 1

    jax.monitoring.register_event_duration_secs_listener(listen)
    return lambda: count[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_episode_args(parser, problems=16, samples=4, batches=5)
    parser.add_argument("--warm-up", type=int, default=3, help="batches before measuring")
    parser.add_argument("--client", choices=["async", "sync"], default="async")
    parser.add_argument(
        "--processes", type=int, default=4, help="env processes for the agents' variant (0: none)"
    )
    args = parser.parse_args()

    registry = build_registry(modules=[talk_plugins])
    client = [f'env.client="{args.client}"']
    variants = {"talk": ("talk", []), "talk_agent": ("talk_agent", client)}
    if args.processes:
        processes = [*client, f"episodes.env_processes={args.processes}"]
        variants["talk_agent_processes"] = ("talk_agent", processes)
    managers = episode_managers(registry, args, variants)

    def one(variant: str, seed: int) -> tuple[float, float, list]:
        env = variants[variant][0]
        wall, batch, metrics = timed_batch(managers[variant], env, args, seed)
        tokens = [r.tokens.tolist() for r in batch.rollouts] if batch else []
        return metrics["generated_tokens"] / wall, metrics["seconds"] / wall, tokens

    compiled = _compilations()
    # Warm up: compile (the endpoint's calls come in batches of several heights and widths,
    # grouped as they arrive) and start everything; go on past --warm-up batches until one
    # compiles nothing (at most 3x as many), so the measured batches measure no compilation.
    for env in managers:
        for k in range(3 * args.warm_up):
            before = compiled()
            one(env, -1 - k)
            if k + 1 >= args.warm_up and compiled() == before:
                break
    rates: dict[str, list[float]] = {env: [] for env in managers}
    busy: dict[str, list[float]] = {env: [] for env in managers}
    compiles = dict.fromkeys(managers, 0)
    same = True
    for i in range(args.batches):
        tokens = {}
        for env in managers:
            before = compiled()
            rate, share, tokens[env] = one(env, i + 1)
            if compiled() > before:  # a shape met for the first time: not the steady state
                compiles[env] += compiled() - before
                continue
            rates[env].append(rate)
            busy[env].append(share)
        same = same and all(t == tokens["talk"] for t in tokens.values())
    if not all(rates.values()):
        raise SystemExit("every measured batch of a variant compiled: run with more --batches")
    episodes = args.problems * args.samples
    print(
        f"{episodes} concurrent episodes, {args.turns} calls of up to {args.action_tokens} tokens "
        f"each; agents use the {args.client} OpenAI client"
    )
    names = {
        "talk": "in process",
        "talk_agent": "HTTP, agents in the worker",
        "talk_agent_processes": f"HTTP, agents in {args.processes} env processes",
    }
    width = max(len(names[env]) for env in managers)
    print(
        f"{'episodes':>{width}} {'tokens/s (median)':>18} {'generating':>11} {'/ in process':>13}"
        f" {'batches kept':>12} {'compilations in the others':>26}"
    )
    base = statistics.median(rates["talk"])
    for env in managers:
        rate = statistics.median(rates[env])
        print(
            f"{names[env]:>{width}} {rate:>18.0f} {statistics.median(busy[env]):>10.0%} "
            f"{rate / base:>13.2f} {len(rates[env]):>12} {compiles[env]:>26}"
        )
    print(f"identical tokens every way: {same}")
    best = max(statistics.median(rates[env]) for env in managers if env != "talk") / base
    print(f"tokens/s through HTTP / in process, the better way: {best:.2f} (bar: >= 0.8)")
    for manager in managers.values():
        manager.shutdown()


if __name__ == "__main__":
    main()
