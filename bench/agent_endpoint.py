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
nothing (at most 3x as many). The bar (issues 30, 48): HTTP / in process >= 0.8.

    python bench/agent_endpoint.py [--turns 4] [--action-tokens 16] [--batches 5] [--warm-up 3]
        [--client async|sync] [--processes 4] [--shapes tiny,small] [--set KEY=VALUE ...]

Two policy shapes (``--shapes``): ``tiny``, the default task's model, whose batch generates in
~0.1 s on two CPU cores, so that the client's own Python dominates; and ``small`` (4 layers, 256
wide), still ~10x cheaper per token than a 135M model. The bar is read at the last shape; each
shape also prints what one HTTP call adds to the wall time of an in-process turn.
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


SHAPES = {
    "tiny": [],  # the default task's model: 1 layer, 64 wide
    "small": ["model.hidden_dim=256", "model.intermediate_dim=1024", "model.num_layers=4"],
}
"""The policy shapes measured: ``tiny`` generates ~30,000 tokens/s on two CPU cores, so a
batch's generation takes ~0.1 s and the OpenAI client's own Python (~1 ms a call) is most of
what is measured; ``small`` (4 layers, 256 wide, ~3,000 tokens/s here) is still far cheaper per
token than any model an agent is trained on."""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_episode_args(parser, problems=16, samples=4, batches=5)
    parser.add_argument("--warm-up", type=int, default=3, help="batches before measuring")
    parser.add_argument("--client", choices=["async", "sync"], default="async")
    parser.add_argument(
        "--processes", type=int, default=4, help="env processes for the agents' variant (0: none)"
    )
    parser.add_argument(
        "--shapes", default="tiny,small", help=f"policy shapes, comma-separated: {list(SHAPES)}"
    )
    args = parser.parse_args()
    shapes = [s.strip() for s in args.shapes.split(",") if s.strip()]
    if unknown := [s for s in shapes if s not in SHAPES]:
        parser.error(f"unknown shape(s) {unknown}: choose from {list(SHAPES)}")
    import cells

    # Each shape in a child process (bench/cells.py): a time limit or Ctrl-C stops it at once
    # and the shapes measured so far are reported.
    if cells.in_child():
        episodes = args.problems * args.samples
        print(
            f"{episodes} concurrent episodes, {args.turns} calls of up to {args.action_tokens} "
            f"tokens each; agents use the {args.client} OpenAI client"
        )
        for shape in shapes:
            best, overhead_ms = measure(args, SHAPES[shape])
            cells.emit(shape=shape, best=best, overhead_ms=overhead_ms)
        return
    records, _ = cells.run_in_child()
    results = {r["shape"]: (r["best"], r["overhead_ms"]) for r in records}
    if not results:
        return
    for shape, (best, overhead_ms) in results.items():
        print(
            f"{shape}: HTTP / in process {best:.2f}; each HTTP call costs {overhead_ms:.2f} ms "
            "more than an in-process turn"
        )
    last = list(results)[-1]
    print(
        f"tokens/s through HTTP / in process, the better way, {last} shape: "
        f"{results[last][0]:.2f} (bar: >= 0.8)"
    )


def measure(args: argparse.Namespace, shape: list[str]) -> tuple[float, float]:
    """One shape's table; returns the better HTTP variant's ratio to in process and its extra
    wall milliseconds per agent call."""
    registry = build_registry(modules=[talk_plugins])
    client = [f'env.client="{args.client}"']
    variants = {"talk": ("talk", shape), "talk_agent": ("talk_agent", [*shape, *client])}
    if args.processes:
        processes = [*shape, *client, f"episodes.env_processes={args.processes}"]
        variants["talk_agent_processes"] = ("talk_agent", processes)
    managers = episode_managers(registry, args, variants)

    def one(variant: str, seed: int) -> tuple[float, float, float, list]:
        env = variants[variant][0]
        wall, batch, metrics = timed_batch(managers[variant], env, args, seed)
        tokens = [r.tokens.tolist() for r in batch.rollouts] if batch else []
        return metrics["generated_tokens"] / wall, metrics["seconds"] / wall, wall, tokens

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
    walls: dict[str, list[float]] = {env: [] for env in managers}
    compiles = dict.fromkeys(managers, 0)
    same = True
    for i in range(args.batches):
        tokens = {}
        for env in managers:
            before = compiled()
            rate, share, wall, tokens[env] = one(env, i + 1)
            if compiled() > before:  # a shape met for the first time: not the steady state
                compiles[env] += compiled() - before
                continue
            rates[env].append(rate)
            busy[env].append(share)
            walls[env].append(wall)
        same = same and all(t == tokens["talk"] for t in tokens.values())
    for manager in managers.values():
        manager.shutdown()
    if not all(rates.values()):
        raise SystemExit("every measured batch of a variant compiled: run with more --batches")
    names = {
        "talk": "in process",
        "talk_agent": "HTTP, agents in the worker",
        "talk_agent_processes": f"HTTP, agents in {args.processes} env processes",
    }
    width = max(len(names[env]) for env in managers)
    print(f"\n{' '.join(shape) or 'the default task model'}")
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
    best = max(
        (env for env in managers if env != "talk"), key=lambda e: statistics.median(rates[e])
    )
    calls = args.problems * args.samples * args.turns
    extra = statistics.median(walls[best]) - statistics.median(walls["talk"])
    return statistics.median(rates[best]) / base, 1000 * extra / calls


if __name__ == "__main__":
    main()
