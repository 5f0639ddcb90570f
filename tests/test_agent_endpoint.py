"""Agent envs (issue 30): programs written against the real ``openai`` client, talking to the
policy through the rollout worker's endpoint, batched into the worker's sampler, recorded token
for token; their failures stay in their episodes."""

from __future__ import annotations

import asyncio
import os
import sys
import threading
import time

import attrs
import numpy as np
import pytest
from test_episodes import _manager

from marin_rl_core import (
    AgentClients,
    AgentCommand,
    AgentEndpoint,
    EnvPlugin,
    LessonConfig,
    Problem,
    SamplingParams,
    Score,
    hookimpl,
)
from marin_rl_core.rollout.episode_state import BatchCancelled

# --- a probe env: each test sets the agent it runs -----------------------------------------------

AGENT: dict[str, object] = {}
SEEN: list[AgentEndpoint] = []


@attrs.frozen
class ProbeAgentConfig:
    n: int = 1


class ProbeAgentEnv:
    def __init__(self, config: ProbeAgentConfig):
        self.config = config

    def sample_problems(self, n, *, mode, seed):
        return [Problem(id=f"p{seed}-{i}", prompt=f"{i % 10}+{i % 10}=") for i in range(n)]

    def run_agent(self, problem, endpoint):
        SEEN.append(endpoint)
        return AGENT["run"](problem, endpoint)


def _lessons(config):
    return [
        LessonConfig(
            id="probe_agent",
            env="probe_agent",
            sampling=SamplingParams(temperature=1.0, max_tokens=4, n_prompts=2),
            eval_sampling=SamplingParams(temperature=0.0, max_tokens=4, n_prompts=2),
        )
    ]


class probe_plugin:
    @staticmethod
    @hookimpl
    def marinrl_register_envs():
        yield EnvPlugin(
            name="probe_agent",
            summary="test agent",
            config_class=ProbeAgentConfig,
            build=ProbeAgentEnv,
            default_lessons=_lessons,
        )


def _batch(manager, n_examples=2, n_generations=2, seed=0, mode="train"):
    return manager.sample_batch(
        "probe_agent", n_examples=n_examples, n_generations=n_generations, mode=mode,
        seed=seed, weight_step=7, worker_id="w",
    )  # fmt: skip


@pytest.fixture(scope="module")
def chat(tmp_path_factory):
    """A rollout manager over a tiny Qwen3 checkpoint (chat template, no padded vocabulary)."""
    pytest.importorskip("torch")
    from marin_rl_core.testing import tiny_chat_tokenizer, write_tiny_hf_checkpoint

    path = tmp_path_factory.mktemp("agent") / "qwen3"
    write_tiny_hf_checkpoint(path, "qwen3", vocab_size=len(tiny_chat_tokenizer("chatml")))
    manager, config = _manager(
        "probe_agent",
        modules=[probe_plugin],
        overrides=[
            f'model.checkpoint="{path}"',
            "model.max_seq_len=96",
            'model.inference_dtype="float32"',
            "episodes.max_turns=6",
        ],
    )
    yield manager, config
    manager.shutdown()


def _trainer_agrees(manager, config, rollouts, temperature=1.0):
    """The trainer's logprobs of every recorded policy token equal the sampler's."""
    from marin_rl_core.learner.training_batch import training_batch_from_rollouts
    from marin_rl_core.models.logprobs import next_token_logprobs

    train = training_batch_from_rollouts(
        rollouts, np.ones(len(rollouts)), config.model.max_seq_len, manager.tokenizer.pad_id,
        temperature=temperature,
    )  # fmt: skip
    logprobs = np.asarray(
        next_token_logprobs(manager.model, train.input_ids, temperature=train.temperature).array
    )
    mask = np.asarray(train.loss_mask.array)
    assert mask.sum() == sum(r.num_policy_tokens for r in rollouts) > 0
    np.testing.assert_allclose(
        logprobs * mask, np.asarray(train.behaviour_logprobs.array), atol=1e-4
    )


# --- the guess game as an agent --------------------------------------------------------------------


@pytest.mark.parametrize(
    ("client", "processes"),
    [("async", 0), ("sync", 0), ("async", 2)],
    ids=["async", "sync", "async-in-env-processes"],
)
def test_an_agent_samples_through_the_endpoint_exactly_what_the_in_process_env_samples(
    client, processes
):
    """The guess game written as an OpenAI-client loop over text completions gives, seed for
    seed, the very rollouts of the in-process ``guess`` env: the same ids (stop tokens and
    feedback included, nothing re-tokenized), loss masks, logprobs and rewards; and the
    trainer's logprobs of them equal the sampler's."""
    kwargs = dict(n_examples=6, n_generations=4, mode="train", seed=3, weight_step=0, worker_id="w")
    reference, _ = _manager("guess")
    expected, _ = reference.sample_batch("guess_digit", **kwargs)
    reference.shutdown()
    manager, config = _manager(
        "guess_agent",
        overrides=[f'env.client="{client}"', f"episodes.env_processes={processes}"],
    )
    try:
        batch, metrics = manager.sample_batch("guess_agent", **kwargs)
        assert metrics["env_errors"] == 0 and metrics["episode_splits"] == 0
        assert len(batch.rollouts) == len(expected.rollouts) == 24
        for got, want in zip(batch.rollouts, expected.rollouts):
            assert got.tokens.tolist() == want.tokens.tolist()
            assert got.loss_mask.tolist() == want.loss_mask.tolist()
            assert got.turn_starts.tolist() == want.turn_starts.tolist()
            # (the endpoint batches calls as they arrive: float noise of the batch's shape, seen
            # at 1.4e-6 under load)
            np.testing.assert_allclose(got.logprobs, want.logprobs, atol=1e-5)
            assert (got.reward, got.truncated) == (want.reward, want.truncated)
        assert metrics["turns"] > 1
        _trainer_agrees(manager, config, batch.rollouts)
    finally:
        manager.shutdown()


def test_an_agent_subprocess_gets_its_endpoint_from_the_environment():
    kwargs = dict(n_examples=2, n_generations=2, mode="train", seed=5, weight_step=0, worker_id="w")
    reference, _ = _manager("guess")
    expected, _ = reference.sample_batch("guess_digit", **kwargs)
    reference.shutdown()
    manager, _ = _manager("guess_agent", overrides=['env.client="subprocess"'])
    try:
        batch, metrics = manager.sample_batch("guess_agent", **kwargs)
    finally:
        manager.shutdown()
    assert metrics["env_errors"] == 0
    assert [r.tokens.tolist() for r in batch.rollouts] == [
        r.tokens.tolist() for r in expected.rollouts
    ]
    assert [r.reward for r in batch.rollouts] == [r.reward for r in expected.rollouts]


# --- chat completions with the real client ---------------------------------------------------------


def test_chat_completions_through_the_openai_client_are_recorded_as_returned(chat):
    import openai  # here: only this file's tests need it, not every worker's collection

    manager, config = chat
    replies: dict[str, list] = {}

    def agent(problem, endpoint):
        client = openai.OpenAI(base_url=endpoint.base_url, api_key=endpoint.api_key, max_retries=0)
        assert [m.id for m in client.models.list()] == ["qwen3"]
        messages = [{"role": "user", "content": problem.prompt}]
        first = client.chat.completions.create(
            model=endpoint.model, messages=messages, n=3, logprobs=True,
            extra_body={"return_token_ids": True},
        )  # fmt: skip
        messages.append(first.choices[0].message.model_dump(exclude_none=True))
        messages.append({"role": "user", "content": "!"})
        chunks = list(
            client.chat.completions.create(
                model=endpoint.model, messages=messages, stream=True, max_tokens=3,
                stream_options={"include_usage": True}, extra_body={"return_token_ids": True},
            )
        )  # fmt: skip
        replies[problem.id + endpoint.api_key] = [first, chunks]
        return 1.0

    AGENT["run"] = agent
    batch, metrics = _batch(manager)
    assert metrics["env_errors"] == 0 and len(replies) == 4
    tokenizer = manager.tokenizer
    rollouts = batch.rollouts
    sampled = 0
    for first, chunks in replies.values():
        assert first.model == "qwen3" and len(first.choices) == 3
        for choice in first.choices:
            ids = choice.model_extra["completion_token_ids"]
            assert choice.finish_reason in ("stop", "length") and 1 <= len(ids) <= 4
            assert [t.logprob for t in choice.logprobs.content] == pytest.approx(
                _recorded(rollouts, ids), abs=1e-6
            )
            sampled += len(ids)
        assert first.usage.completion_tokens == sum(
            len(c.model_extra["completion_token_ids"]) for c in first.choices
        )
        # The stream: role and text, then the finish reason, then the usage.
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        finish = [c.choices[0].finish_reason for c in chunks if c.choices]
        assert finish[-1] in ("stop", "length") and chunks[-1].usage.completion_tokens <= 3
        streamed_ids = chunks[0].choices[0].model_extra["completion_token_ids"]
        stops = set(tokenizer.stop_ids)
        assert text == tokenizer.decode([t for t in streamed_ids if t not in stops])
        sampled += len(streamed_ids)
    # Three samples of each first call: the first continues into the second call, the other
    # two are branches of their own; every sampled id is trained once, in its own sample.
    assert sum(r.num_policy_tokens for r in rollouts) == sampled
    assert all(r.reward == 1.0 and r.metadata.weight_step == 7 for r in rollouts)
    assert metrics["episode_splits"] >= 4 * 2  # each episode's two further choices at least
    _trainer_agrees(manager, config, batch.rollouts)


def _episodes(batch):
    episodes: list[list] = []
    for r in batch.rollouts:
        if r.part == 0:
            episodes.append([])
        episodes[-1].append(r)
    return episodes


def _recorded(rollouts, ids):
    """The recorded logprobs of the call whose completion ids are ``ids``, from whichever
    sample holds them."""
    for r in rollouts:
        for start in r.turn_starts:
            if r.tokens[start : start + len(ids)].tolist() == ids and r.loss_mask[start]:
                return r.logprobs[start : start + len(ids)].tolist()
    raise AssertionError(f"completion {ids} is not in the episode's samples")


def test_an_edited_history_is_a_flagged_split_and_every_sampled_token_is_trained_once(chat):
    import openai

    manager, config = chat
    sampled: list[int] = []

    def agent(problem, endpoint):
        client = openai.OpenAI(base_url=endpoint.base_url, api_key=endpoint.api_key, max_retries=0)
        history = [{"role": "user", "content": problem.prompt}]
        for content in ["1", "2"]:
            reply = client.chat.completions.create(
                model=endpoint.model, messages=history, extra_body={"return_token_ids": True}
            ).choices[0]
            sampled.append(len(reply.model_extra["completion_token_ids"]))
            history += [{"role": "assistant", "content": reply.message.content}]
            history += [{"role": "user", "content": content}]
        # The agent rewrites its first message (a summary, an edited prompt): not a prefix.
        history[0] = {"role": "user", "content": "9+9="}
        reply = client.chat.completions.create(
            model=endpoint.model, messages=history, extra_body={"return_token_ids": True}
        ).choices[0]
        sampled.append(len(reply.model_extra["completion_token_ids"]))
        return Score(0.5, {"calls": 3.0})

    AGENT["run"] = agent
    batch, metrics = _batch(manager)
    assert metrics["env_errors"] == 0
    episodes = _episodes(batch)
    assert len(episodes) == 4 and metrics["episode_splits"] >= 4
    for parts in episodes:
        assert len(parts) >= 2  # the edited history starts a sample of its own
        last = parts[-1]
        assert last.num_turns == 1 and last.turn_rewards.tolist() == [0.5]
        assert "9+9=" in manager.tokenizer.decode(last.tokens[: last.prompt_length].tolist())
        assert all(r.reward == 0.5 for r in parts)
    assert sum(r.num_policy_tokens for r in batch.rollouts) == sum(sampled)
    assert metrics["score/calls"] == 3.0 and metrics["turns"] == 3.0
    _trainer_agrees(manager, config, batch.rollouts)


def test_many_concurrent_episodes_share_generation_calls(chat):
    manager, _ = chat
    clients = AgentClients(pools=4)  # 64 episodes over 4 connection pools

    async def agent(problem, endpoint):
        client = clients.asynchronous(endpoint)
        assert str(client.base_url).rstrip("/") == endpoint.base_url.rstrip("/")
        messages = [{"role": "user", "content": problem.prompt}]
        for _ in range(3):
            reply = await client.chat.completions.create(model="x", messages=messages)
            messages += [reply.choices[0].message.model_dump(exclude_none=True)]
            messages += [{"role": "user", "content": "?"}]
        return 0.0

    AGENT["run"] = agent
    start = time.perf_counter()
    batch, metrics = _batch(manager, n_examples=16, n_generations=4)
    wall = time.perf_counter() - start
    # The agents' time is the batch's time outside generation, not 64 episodes' times summed.
    assert 0 < metrics["score_seconds"] < wall - metrics["seconds"] + 0.1
    # Every call reached its own episode: 64 episodes of 3 calls each, each call in one sample
    # (a reply cut at max_tokens is not a prefix of its re-templated message: a new sample).
    assert metrics["env_errors"] == 0 and metrics["turns"] == 3.0
    assert sum(len(r.turn_starts) for r in batch.rollouts) == 64 * 3
    assert len(batch.rollouts) == 64 + metrics["episode_splits"]
    assert len({r.problem_id for r in batch.rollouts}) == 16
    assert len(clients._clients) == 4
    server = manager._runner.agent_episodes(config_of(manager)).server
    # 64 episodes x 3 calls in far fewer generation calls than calls, none of more than a
    # cohort's share (episodes.generation_cohorts = 2: 32 calls), as in-process episodes.
    assert server.generate_calls < 64 * 3 / 4
    assert 0 < server.largest_call <= 32


def config_of(manager):
    return manager.config.episodes


# --- failures --------------------------------------------------------------------------------------


def test_agent_failures_stay_in_their_episode_and_refusals_say_why(chat):
    import openai

    manager, config = chat
    # The hang's timeout is the point, but the healthy episodes share it: generous enough for
    # them on a loaded machine (5 s counted healthy agents as timed out under load 4-18).
    timeout = 25.0
    manager.config = attrs.evolve(
        config, episodes=attrs.evolve(config.episodes, episode_timeout_s=timeout, max_turns=2)
    )
    refusals: dict[str, str] = {}
    kept: list[AgentEndpoint] = []
    stop = threading.Event()

    def agent(problem, endpoint):
        client = openai.OpenAI(base_url=endpoint.base_url, api_key=endpoint.api_key, max_retries=0)
        ask = lambda **kw: client.chat.completions.create(
            model="m", messages=[{"role": "user", "content": problem.prompt}], **kw
        )
        role = problem.id.split("-")[-1]
        if role == "0":  # crashes after a call
            ask()
            raise RuntimeError("the agent's own bug")
        if role == "1":  # hangs (until the test ends)
            ask()
            stop.wait(timeout + 60)
            return 1.0
        if role == "2":  # runs into the call limit, and gives up
            for _ in range(3):
                try:
                    ask()
                except openai.BadRequestError as exc:
                    refusals["limit"] = str(exc)
                    raise
        try:  # a healthy agent that first asks for what the endpoint cannot do
            ask(top_p=0.5)
        except openai.BadRequestError as exc:
            refusals["top_p"] = str(exc)
        ask()
        kept.append(endpoint)
        return 1.0

    AGENT["run"] = agent
    start = time.monotonic()
    try:
        batch, metrics = _batch(manager, n_examples=4, n_generations=1)
    finally:
        stop.set()
        manager.config = config
    assert time.monotonic() - start < timeout + 60  # the hang is cut off, not waited for
    # The crash and the hang lose their own problems' groups only.
    assert metrics["env_errors"] == 1 and metrics["env_timeouts"] == 1
    by_problem: dict[str, list] = {}
    for r in batch.rollouts:
        by_problem.setdefault(r.problem_id.split("-")[-1], []).append(r)
    assert sorted(by_problem) == ["2", "3"]
    # The agent at the call limit asked the same question twice (two samples of one prompt:
    # a branch) before it was refused; trained on, truncated, reward 0.
    limited = by_problem["2"]
    assert [(r.num_turns, r.truncated, r.reward) for r in limited] == [(1, True, 0.0)] * 2
    assert [(r.num_turns, r.reward) for r in by_problem["3"]] == [(1, 1.0)]
    assert metrics["episode_splits"] == 1
    assert "episodes.max_turns" in refusals["limit"] and "top_p" in refusals["top_p"]
    # A call after its episode ended, and a call with a key of no episode.
    endpoint = kept[0]
    late = openai.OpenAI(base_url=endpoint.base_url, api_key=endpoint.api_key, max_retries=0)
    with pytest.raises(openai.APIStatusError, match="episode has ended") as ended:
        late.chat.completions.create(model="m", messages=[{"role": "user", "content": "1"}])
    assert ended.value.status_code == 410
    base = endpoint.base_url.split("/e/")[0] + "/v1"
    stranger = openai.OpenAI(base_url=base, api_key="nope", max_retries=0)
    with pytest.raises(openai.AuthenticationError, match="unknown episode key"):
        stranger.chat.completions.create(model="m", messages=[{"role": "user", "content": "1"}])
    # The bearer key alone attributes a call (here: to an ended episode).
    by_key = openai.OpenAI(base_url=base, api_key=endpoint.api_key, max_retries=0)
    with pytest.raises(openai.APIStatusError, match="episode has ended"):
        by_key.completions.create(model="m", prompt="1")


def test_an_async_agent_that_hangs_is_cancelled_at_the_episode_timeout(chat):
    manager, config = chat
    manager.config = attrs.evolve(
        config, episodes=attrs.evolve(config.episodes, episode_timeout_s=2.0)
    )

    async def agent(problem, endpoint):
        if problem.id.endswith("-1"):
            await asyncio.sleep(3600)
        return 1.0

    AGENT["run"] = agent
    try:
        start = time.monotonic()
        batch, metrics = _batch(manager, n_examples=2, n_generations=1)
    finally:
        manager.config = config
    assert time.monotonic() - start < 60 and metrics["env_timeouts"] == 1  # not the hour
    assert batch is None  # the other episode made no call: nothing to train on


def _group_alive(marker: str) -> list[int]:
    """Pids of this machine's processes whose command line holds ``marker``."""
    import psutil

    return [
        p.pid
        for p in psutil.process_iter(["cmdline", "status"])
        if p.pid != os.getpid()
        and marker in (p.info["cmdline"] or [])
        and p.info["status"] != psutil.STATUS_ZOMBIE
    ]


def _wait_gone(marker: str, seconds: float = 5.0) -> list[int]:
    deadline = time.monotonic() + seconds
    while (alive := _group_alive(marker)) and time.monotonic() < deadline:
        time.sleep(0.05)
    return alive


def _sleeper_script(marker: str, pids: str | None = None) -> str:
    """An agent program that starts a child and sleeps; both carry ``marker`` in their argv and
    sleep far longer than a test runs, so only a kill ends them in time."""
    write = f"open({pids!r}, 'w').write(f'{{os.getpid()}} {{child.pid}}')\n" if pids else ""
    return (
        "import os, subprocess, sys, time\n"
        "child = subprocess.Popen(\n"
        f"    [sys.executable, '-c', 'import time; time.sleep(3600)', {marker!r}])\n"
        f"{write}"
        "time.sleep(3600)\n"
    )


def test_a_cancelled_batch_kills_its_agent_subprocesses(chat, tmp_path):
    """The job stopping mid-batch (the worker cancels its batch) ends the batch at once and
    leaves no agent program running, children of the program included."""
    manager, _ = chat
    marker = f"marinrl-agent-{os.getpid()}-{tmp_path.name}"
    pids = tmp_path / "pids"

    def agent(problem, endpoint):
        return AgentCommand(argv=[sys.executable, "-c", _sleeper_script(marker, str(pids)), marker])

    AGENT["run"] = agent
    finished = threading.Event()
    late: list[str] = []

    def cancel_when_started():
        deadline = time.monotonic() + 60
        while not (pids.exists() and pids.read_text().strip()) and time.monotonic() < deadline:
            time.sleep(0.05)
        manager.cancel()
        if not finished.wait(60):  # a lost cancel would wait for the programs (an hour)
            late.append(f"the batch had not stopped 60 s after its cancel: {_group_alive(marker)}")
            for pid in _group_alive(marker):
                os.kill(pid, 9)

    cancel = threading.Thread(target=cancel_when_started)
    cancel.start()
    try:
        with pytest.raises(BatchCancelled):
            _batch(manager, n_examples=1, n_generations=1)
    finally:
        finished.set()
        cancel.join()
    assert not late, late[0]
    assert len(pids.read_text().split()) == 2
    running = _wait_gone(marker)
    assert not running, f"agent processes still running after the cancel: {running}"


@pytest.mark.parametrize("block_s", [0.0, 1.0])
def test_a_cancel_while_an_agent_starts_kills_its_group(block_s):
    """A cancel that lands while an agent subprocess is starting (asyncio connects its pipes
    after the fork: a busy runner loop makes that window seconds long) still kills the program
    and its children at once, rather than waiting for them to end on their own."""
    from marin_rl_core.rollout.agent_episodes import _run_command

    marker = f"marinrl-start-{os.getpid()}-{block_s}"
    endpoint = AgentEndpoint(base_url="http://127.0.0.1:9/v1", api_key="k", model="m")
    command = AgentCommand(argv=[sys.executable, "-c", _sleeper_script(marker), marker])

    async def cancel_during_start():
        task = asyncio.ensure_future(_run_command(command, endpoint, 3600))
        await asyncio.sleep(0)  # the fork has happened; the pipes are not connected yet
        time.sleep(block_s)  # a busy loop: the program starts its child meanwhile
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(task, 30)

    try:
        asyncio.run(cancel_during_start())
        running = _wait_gone(marker)
        assert not running, f"agent processes still running after the cancel: {running}"
    finally:
        for pid in _group_alive(marker):
            os.kill(pid, 9)


# --- agents in env processes (episodes.env_processes) ---------------------------------------------


@attrs.frozen
class SpreadAgentConfig:
    """What each problem's agent does, by problem index: ``ok`` (two calls, returns its pid),
    ``raise`` (after a call), ``exit@1`` (ends its process after a call in the batch of seed 1,
    else ``ok``), ``hang@0`` (async, after a call in the batch of seed 0)."""

    roles: tuple[str, ...] = ("ok", "ok")


class SpreadAgentEnv:
    """An async OpenAI-client agent that children spawned by ``episodes.env_processes`` can
    import (module-level, no test globals)."""

    def __init__(self, config: SpreadAgentConfig):
        self.config = config
        self.clients = AgentClients()

    def sample_problems(self, n, *, mode, seed):
        return [Problem(id=f"p{seed}-{i}", prompt=f"{i % 10}+{i % 10}=") for i in range(n)]

    async def run_agent(self, problem, endpoint):
        client = self.clients.asynchronous(endpoint)
        role = self.config.roles[int(problem.id.split("-")[-1]) % len(self.config.roles)]
        prompt = problem.prompt
        reply = await client.completions.create(model="m", prompt=prompt, max_tokens=3)
        if role == "raise":
            raise ValueError("the agent's own bug")
        if role == "exit@1" and problem.id.startswith("p1-"):
            os._exit(3)
        if role == "hang@0" and problem.id.startswith("p0-"):
            await asyncio.sleep(3600)
        prompt += reply.choices[0].text + "="
        await client.completions.create(model="m", prompt=prompt, max_tokens=3)
        return {"pid": os.getpid()}

    def score(self, problem, result):
        return Score(reward=1.0, metrics={"agent_pid": result["pid"], "score_pid": os.getpid()})


class spread_plugin:
    @staticmethod
    @hookimpl
    def marinrl_register_envs():
        yield EnvPlugin(
            name="spread_agent",
            summary="test agent for env processes",
            config_class=SpreadAgentConfig,
            build=SpreadAgentEnv,
            default_lessons=lambda config: [
                attrs.evolve(lesson, id="spread_agent", env="spread_agent")
                for lesson in _lessons(config)
            ],
        )


def _spread(*roles, timeout=120.0):
    return _manager(
        "spread_agent",
        modules=[spread_plugin],
        overrides=[
            f"env.roles={list(roles)!r}".replace("'", '"'),
            "episodes.env_processes=2",
            f"episodes.episode_timeout_s={timeout}",
            "model.max_seq_len=32",
        ],
    )[0]


def _spread_batch(manager, n_examples, seed=0):
    return manager.sample_batch(
        "spread_agent", n_examples=n_examples, n_generations=2, mode="train", seed=seed,
        weight_step=0, worker_id="w",
    )  # fmt: skip


def test_agents_in_env_processes_run_there_and_sample_what_agents_in_the_worker_sample(caplog):
    """``episodes.env_processes`` takes the agents' programs (and their clients' CPU) out of the
    rollout worker; the episodes are recorded as before, token for token. Agents left in the
    worker get a hint that says so."""
    caplog.set_level("INFO", logger="marin_rl_core.rollout.manager")
    in_processes = _spread("ok")
    try:
        batch, metrics = _spread_batch(in_processes, n_examples=4, seed=2)
        pids = set(in_processes.env("spread_agent").pids)
    finally:
        in_processes.shutdown()
    assert metrics["env_errors"] == 0 and len(batch.rollouts) == 8
    # Score metrics reach the batch as means: half the episodes ran in each process.
    assert os.getpid() not in pids and len(pids) == 2
    assert metrics["score/agent_pid"] == metrics["score/score_pid"] == pytest.approx(sum(pids) / 2)
    assert all(r.num_turns == 2 for r in batch.rollouts)
    reference, _ = _manager(
        "spread_agent", modules=[spread_plugin], overrides=["model.max_seq_len=32"]
    )
    try:
        expected, in_worker = _spread_batch(reference, n_examples=4, seed=2)
    finally:
        reference.shutdown()
    assert in_worker["score/agent_pid"] == os.getpid()
    assert "episodes.env_processes = N runs them in N processes" in caplog.text
    for got, want in zip(batch.rollouts, expected.rollouts):
        assert got.tokens.tolist() == want.tokens.tolist()
        assert got.loss_mask.tolist() == want.loss_mask.tolist()
        # (calls batched differently: float noise of the batch's shape)
        np.testing.assert_allclose(got.logprobs, want.logprobs, atol=1e-5)


def test_an_agent_failing_in_an_env_process_fails_its_episodes_only(caplog):
    """An agent that raises or hangs past the episode's time loses its own problem's group;
    one that ends its process also the episodes running there, and the process is started
    again for the next batch."""
    # Problems 0 and 2 run in process 0, 1 and 3 in process 1 (round robin, batch after batch).
    # The hang's timeout is the point; the healthy episodes share it (8 s was too tight for
    # them under load).
    manager = _spread("raise", "exit@1", "hang@0", "ok", timeout=25.0)
    try:
        start = time.monotonic()
        batch, metrics = _spread_batch(manager, n_examples=4, seed=0)
        assert time.monotonic() - start < 25.0 + 60
        # (errors count problems, timeouts episodes: 2 samples of each problem)
        assert metrics["env_errors"] == 1 and metrics["env_timeouts"] == 2
        assert {r.problem_id for r in batch.rollouts} == {"p0-1", "p0-3"}
        assert "ValueError: the agent's own bug (test_agent_endpoint.py:" in caplog.text
        # Seed 1: problem 1's agent ends process 1, failing problem 3's episodes there too
        # (unless they finished first); problem 2's agent no longer hangs.
        batch, metrics = _spread_batch(manager, n_examples=4, seed=1)
        survivors = {r.problem_id for r in batch.rollouts} if batch else set()
        assert survivors <= {"p1-2", "p1-3"} and "p1-2" in survivors
        assert metrics["env_errors"] == 4 - len(survivors) and metrics["env_timeouts"] == 0
        batch, metrics = _spread_batch(manager, n_examples=4, seed=2)
        assert metrics["env_process_restarts"] == 1
        assert "process 1 (pid " in caplog.text
        assert "is replaced (exit code 3); its episodes failed" in caplog.text
        assert {r.problem_id for r in batch.rollouts} == {"p2-1", "p2-2", "p2-3"}
    finally:
        manager.shutdown()
