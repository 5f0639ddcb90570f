"""The rollout worker's one generation queue: episodes and agent calls that wait while the
engine works share its next call, each keeping its own settings and samples; a request the
engine refuses fails its own source only."""

from __future__ import annotations

import time

import jax
import pytest

from marin_rl_core import EngineSpec, GenerationRequest, build_registry
from marin_rl_core.config import ModelConfig
from marin_rl_core.models.build import build_model
from marin_rl_core.models.tokenizer import ArithmeticTokenizer
from marin_rl_core.rollout.generation_queue import GenerationQueue


@pytest.fixture(scope="module")
def engine():
    tok = ArithmeticTokenizer()
    shape = ModelConfig(hidden_dim=32, intermediate_dim=64, num_layers=2, num_heads=4)
    model = build_model(shape, tok, key=jax.random.PRNGKey(0))
    spec = EngineSpec(model=model, max_seq_len=16, eos_id=tok.eos_id, max_seqs=32)
    return build_registry().build_engine("kv", spec), tok


def test_sources_waiting_share_the_next_call_and_keep_their_own_samples(engine):
    engine, tok = engine
    prompts = [tok.encode(f"{a}+{a}=", add_bos=True) for a in range(6)]
    first = [GenerationRequest(prompt=prompts[0], n=4, max_tokens=6, seed=1, fold=0)]
    episodes = [
        GenerationRequest(prompt=p, n=2, temperature=1.0, max_tokens=5, seed=2, fold=i)
        for i, p in enumerate(prompts[1:4])
    ]
    agent = [GenerationRequest(prompt=p, temperature=0.0, max_tokens=4) for p in prompts[4:]]
    alone = [engine.generate(r) for r in (first, episodes, agent)]
    queue = GenerationQueue(engine)
    try:
        futures = [queue.submit(first)]  # the engine is busy with it while the others wait
        futures += [queue.submit(episodes), queue.submit(agent)]
        shared = [f.result(timeout=120) for f in futures]
    finally:
        queue.close()
    assert queue.submissions == 3 and queue.calls <= 2
    for got, want in zip(shared, alone):
        assert [[s.tokens.tolist() for s in g] for g in got] == [
            [s.tokens.tolist() for s in g] for g in want
        ]


def test_a_request_the_engine_refuses_fails_its_own_source_only(engine):
    engine, tok = engine
    good = [GenerationRequest(prompt=tok.encode("1+2=", add_bos=True), max_tokens=3)]
    too_long = [GenerationRequest(prompt=[tok.bos_id] * 16, max_tokens=3)]
    queue = GenerationQueue(engine)
    try:
        busy = queue.submit(good)
        futures = [queue.submit(too_long), queue.submit(good)]
        assert busy.result(timeout=120)[0][0].tokens.size >= 1
        with pytest.raises(ValueError, match="prompts need 1..15 tokens"):
            futures[0].result(timeout=120)
        assert futures[1].result(timeout=120)[0][0].tokens.size >= 1
    finally:
        queue.close()
    closed = queue.submit(good)
    with pytest.raises(RuntimeError, match="closed"):
        closed.result(timeout=1)


def test_a_request_joins_rows_already_decoding_and_returns_before_them():
    """With the kv engine the queue feeds rows in continuously: a short request submitted while
    long rows decode is prefilled at the next round and handed back while they go on (it does
    not wait for the call in progress), and its samples are what it samples alone."""
    tok = ArithmeticTokenizer()
    shape = ModelConfig(hidden_dim=32, intermediate_dim=64, num_layers=2, num_heads=4)
    model = build_model(shape, tok, key=jax.random.PRNGKey(1))
    spec = EngineSpec(model=model, max_seq_len=64, eos_id=tok.eos_id, max_seqs=16)
    config = build_registry().get("engine", "kv").config_class(steps_per_round=2)
    engine = build_registry().build_engine("kv", spec, config)
    prompt = tok.encode("3+4=", add_bos=True)
    long = [GenerationRequest(prompt=prompt, n=8, temperature=1.0, max_tokens=48, seed=3)]
    short = [GenerationRequest(prompt=prompt, n=2, temperature=1.0, max_tokens=2, seed=4)]
    alone = engine.generate(short)
    queue = GenerationQueue(engine)
    order: list[str] = []
    try:
        rounds = engine.rounds
        first = queue.submit(long)
        first.add_done_callback(lambda _: order.append("long"))
        deadline = time.monotonic() + 120
        while engine.rounds == rounds and time.monotonic() < deadline:  # the long rows decode
            time.sleep(0.005)
        second = queue.submit(short)
        second.add_done_callback(lambda _: order.append("short"))
        got, longest = second.result(timeout=120), first.result(timeout=120)
    finally:
        queue.close()
    assert max(s.tokens.size for s in longest[0]) > 8  # the long rows ran many rounds
    assert order == ["short", "long"]
    assert [s.tokens.tolist() for s in got[0]] == [s.tokens.tolist() for s in alone[0]]
