"""The generation engines' contract suite: every engine plugin (levanter's paged engine, the
dense sampler, the kv engine, and any installed one) is held to the same tests: shapes, seeds,
stop tokens, weight swaps, the sampling distribution, and logprob agreement with the trainer's
computation. One engine of each kind (compiled once) is shared by the whole module; the kv
engine's own machinery (slots, rounds, its memory budget) is tested at the end."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import equinox as eqx
import haliax as hax
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from levanter.layers.attention import AttentionMask

from marin_rl_core import EngineSpec, Rollout, build_registry
from marin_rl_core.config import ModelConfig
from marin_rl_core.errors import ConfigError
from marin_rl_core.learner.training_batch import training_batch_from_rollouts
from marin_rl_core.models.build import build_model
from marin_rl_core.models.logprobs import next_token_logprobs, response_logprobs
from marin_rl_core.models.tokenizer import ArithmeticTokenizer
from marin_rl_core.rollout.inference import sample_prompts

REGISTRY = build_registry()
ENGINES = [name for name in REGISTRY.names("engine") if name != "auto"]
"""Every engine plugin but ``auto`` (which builds one of them)."""


def make_engine(name, model, **spec):
    """The engine plugin ``name`` built as a rollout worker builds it."""
    return REGISTRY.build_engine(name, EngineSpec(model=model, **spec))


MAX_SEQ_LEN = 16
CONFIG = ModelConfig(
    hidden_dim=32,
    intermediate_dim=64,
    num_layers=2,
    num_heads=4,
    num_kv_heads=4,
    max_seq_len=MAX_SEQ_LEN,
)


@pytest.fixture(scope="module")
def tok() -> ArithmeticTokenizer:
    return ArithmeticTokenizer()


@pytest.fixture(scope="module")
def models(tok):
    return [build_model(CONFIG, tok, key=jax.random.PRNGKey(k)) for k in (0, 1)]


@pytest.fixture(scope="module", params=ENGINES)
def engine(request, models, tok):
    # Small max_seqs so that the tests also exercise chunking of larger requests.
    eng = make_engine(
        request.param, models[0], max_seq_len=MAX_SEQ_LEN, eos_id=tok.eos_id, max_seqs=32
    )
    yield eng
    eng.update_model(models[0])


@pytest.fixture()
def fresh(engine, models):
    """The engine sampling from models[0] at the start of each test."""
    engine.update_model(models[0])
    return engine


def prompts_of(tok, n=6):
    return [tok.encode(f"{a}+{a + 1}=", add_bos=True) for a in range(n)]


@eqx.filter_jit
def _next_token_logits(model, ids):
    return model(ids, attn_mask=AttentionMask.causal())


def greedy_reference(model, prompt, max_tokens, stops):
    """Greedy decoding with full forward passes (no KV cache) over a right-padded row."""
    ids = list(prompt)
    for _ in range(max_tokens):
        row = ids + [0] * (MAX_SEQ_LEN - len(ids))
        x = hax.named(jnp.asarray([row], dtype=jnp.int32), ("batch", "position"))
        logits = _next_token_logits(model, x).array
        ids.append(int(jnp.argmax(logits[0, len(ids) - 1])))
        if ids[-1] in stops or len(ids) == MAX_SEQ_LEN:
            break
    return ids[len(prompt) :]


def test_samples_have_the_requested_shape(fresh, tok):
    prompts = prompts_of(tok)
    out = sample_prompts(fresh, prompts, n=4, temperature=1.0, max_tokens=5, seed=0)
    assert len(out) == len(prompts) and all(len(group) == 4 for group in out)
    for group in out:
        for s in group:
            assert 1 <= s.tokens.size <= 5
            assert s.logprobs.shape == s.tokens.shape
            assert np.all(s.logprobs <= 0)
            assert s.stopped == (int(s.tokens[-1]) == tok.eos_id)
            assert s.stopped or s.tokens.size == 5
            assert tok.eos_id not in s.tokens[:-1].tolist()


def test_greedy_matches_full_forward_decoding(fresh, models, tok):
    prompts = prompts_of(tok, 3)
    out = sample_prompts(fresh, prompts, n=2, temperature=0.0, max_tokens=6)
    for prompt, group in zip(prompts, out):
        want = greedy_reference(models[0], prompt, 6, {tok.eos_id})
        assert group[0].tokens.tolist() == want
        assert group[1].tokens.tolist() == want


def test_seed_fixes_the_samples(fresh, tok):
    prompts = prompts_of(tok, 3)
    a = sample_prompts(fresh, prompts, n=3, temperature=1.0, max_tokens=6, seed=7)
    b = sample_prompts(fresh, prompts, n=3, temperature=1.0, max_tokens=6, seed=7)
    c = sample_prompts(fresh, prompts, n=3, temperature=1.0, max_tokens=6, seed=8)
    tokens = lambda out: [s.tokens.tolist() for group in out for s in group]  # noqa: E731
    assert tokens(a) == tokens(b)
    assert tokens(a) != tokens(c)
    # The samples of one prompt differ from each other (clones get their own keys).
    assert len({tuple(s.tokens.tolist()) for s in a[0]}) > 1


def test_samples_follow_the_model_distribution(fresh, models, tok):
    """The first response token's frequencies over many samples match the model's (tempered)
    next-token distribution: a sampler reporting the right logprobs could still draw wrongly."""
    prompt = prompts_of(tok, 1)[0]
    temperature = 2.0  # flattens the untrained model's distribution: many tokens get drawn
    (group,) = sample_prompts(fresh, [prompt], n=32, temperature=temperature, max_tokens=1, seed=11)
    draws = [int(s.tokens[0]) for s in group]
    for seed in range(12, 27):  # 16 calls x 32 samples
        (group,) = sample_prompts(
            fresh, [prompt], n=32, temperature=temperature, max_tokens=1, seed=seed
        )
        draws += [int(s.tokens[0]) for s in group]
    row = prompt + [0] * (MAX_SEQ_LEN - len(prompt))
    x = hax.named(jnp.asarray([row], dtype=jnp.int32), ("batch", "position"))
    logits = np.asarray(_next_token_logits(models[0], x).array[0, len(prompt) - 1], np.float64)
    p = np.exp(logits / temperature - np.logaddexp.reduce(logits / temperature))
    # Eight bins of about equal probability (tokens sorted by it) keep the sampling noise
    # small: 512 correct draws land within about 0.05 total variation of the model.
    order = np.argsort(-p)
    bins = np.zeros(p.size, dtype=int)
    bins[order] = np.minimum((np.cumsum(p[order]) - p[order] / 2) * 8, 7).astype(int)
    want = np.bincount(bins, weights=p, minlength=8)
    got = np.bincount(bins[draws], minlength=8) / len(draws)
    total_variation = 0.5 * np.abs(got - want).sum()
    # A sampler that ignored the temperature (drew at T=1) or took the argmax is far off.
    assert total_variation < 0.12, (total_variation, got, want)
    assert len(set(draws)) > 5


def test_extra_stop_tokens_end_responses(fresh, models, tok):
    prompt = prompts_of(tok, 1)[0]
    free = greedy_reference(models[0], prompt, 6, {tok.eos_id})
    assert len(free) >= 3, "pick a prompt whose greedy answer is long enough"
    stop = free[1]
    (group,) = sample_prompts(
        fresh, [prompt], n=1, temperature=0.0, max_tokens=6, stop_tokens=[stop]
    )
    assert group[0].tokens.tolist() == free[: free.index(stop) + 1]
    assert group[0].stopped


def test_sampler_logprobs_equal_trainer_logprobs(fresh, models, tok):
    """The equivalence the importance ratio rests on: for the same weights, the logprob the
    engine reports for each sampled token equals the trainer's (full forward) logprob."""
    prompts = prompts_of(tok, 6)
    out = sample_prompts(fresh, prompts, n=4, temperature=1.0, max_tokens=6, seed=3)
    rollouts = [
        Rollout.single_turn(
            env_name="mock",
            lesson_id="l",
            problem_id=str(i),
            prompt_tokens=prompt,
            response_tokens=s.tokens,
            response_logprobs=s.logprobs,
            reward=0.0,
        )
        for i, (prompt, group) in enumerate(zip(prompts, out))
        for s in group
    ]
    batch = training_batch_from_rollouts(rollouts, np.zeros(len(rollouts)), MAX_SEQ_LEN, tok.pad_id)
    trainer = np.asarray(next_token_logprobs(models[0], batch.input_ids).array)
    mask = np.asarray(batch.loss_mask.array)
    behaviour = np.asarray(batch.behaviour_logprobs.array)
    assert mask.sum() == sum(r.response_tokens.size for r in rollouts)
    np.testing.assert_allclose(trainer * mask, behaviour, atol=1e-4)
    # The list-based helper agrees too.
    helper = response_logprobs(
        models[0],
        [r.prompt_tokens for r in rollouts],
        [r.response_tokens for r in rollouts],
        max_seq_len=MAX_SEQ_LEN,
        pad_id=tok.pad_id,
    )
    for r, got in zip(rollouts, helper):
        np.testing.assert_allclose(got, r.response_logprobs, atol=1e-4)


def test_tempered_sampling_reports_tempered_logprobs(fresh, models, tok):
    prompts = prompts_of(tok, 2)
    out = sample_prompts(fresh, prompts, n=2, temperature=0.5, max_tokens=4, seed=1)
    flat = [(p, s) for p, group in zip(prompts, out) for s in group]
    got = response_logprobs(
        models[0],
        [p for p, _ in flat],
        [s.tokens for _, s in flat],
        max_seq_len=MAX_SEQ_LEN,
        pad_id=tok.pad_id,
        temperature=0.5,
    )
    for (_, s), want in zip(flat, got):
        np.testing.assert_allclose(s.logprobs, want, atol=1e-4)


def test_a_batch_mixing_temperatures_matches_each_rows_sampler(fresh, models, tok):
    """Lessons may sample at different temperatures and share a training batch: with one
    temperature per row the trainer's logprobs still equal what the sampler reported."""
    prompts = prompts_of(tok, 4)
    rollouts, temps = [], []
    for temperature, seed in ((0.5, 1), (1.5, 2)):
        out = sample_prompts(fresh, prompts, n=2, temperature=temperature, max_tokens=4, seed=seed)
        for i, (prompt, group) in enumerate(zip(prompts, out)):
            for s in group:
                rollouts.append(
                    Rollout.single_turn(
                        env_name="mock",
                        lesson_id=f"t{temperature}",
                        problem_id=str(i),
                        prompt_tokens=prompt,
                        response_tokens=s.tokens,
                        response_logprobs=s.logprobs,
                        reward=0.0,
                    )
                )
                temps.append(temperature)
    batch = training_batch_from_rollouts(
        rollouts,
        np.zeros(len(rollouts)),
        MAX_SEQ_LEN,
        tok.pad_id,
        temperature=temps,
        batch_size=len(rollouts) + 2,
    )
    np.testing.assert_allclose(batch.temperature.array, temps + [1.0, 1.0])
    trainer = np.asarray(
        next_token_logprobs(models[0], batch.input_ids, temperature=batch.temperature).array
    )
    mask = np.asarray(batch.loss_mask.array)
    np.testing.assert_allclose(
        trainer * mask, np.asarray(batch.behaviour_logprobs.array), atol=1e-4
    )
    # One shared temperature would get the 0.5-tempered rows wrong.
    shared = np.asarray(next_token_logprobs(models[0], batch.input_ids, temperature=1.5).array)
    assert not np.allclose(shared * mask, np.asarray(batch.behaviour_logprobs.array), atol=1e-3)


def test_new_weights_are_used_after_update_model(engine, models, tok):
    prompts = prompts_of(tok, 3)
    engine.update_model(models[0])
    before = sample_prompts(engine, prompts, n=1, temperature=0.0, max_tokens=6)
    engine.update_model(models[1])
    after = sample_prompts(engine, prompts, n=1, temperature=0.0, max_tokens=6)
    for prompt, old, new in zip(prompts, before, after):
        assert old[0].tokens.tolist() == greedy_reference(models[0], prompt, 6, {tok.eos_id})
        assert new[0].tokens.tolist() == greedy_reference(models[1], prompt, 6, {tok.eos_id})
    assert [g[0].tokens.tolist() for g in before] != [g[0].tokens.tolist() for g in after]
    # Sampled logprobs come from the new weights as well.
    sampled = sample_prompts(engine, prompts, n=2, temperature=1.0, max_tokens=4, seed=5)
    flat = [(p, s) for p, group in zip(prompts, sampled) for s in group]
    want = response_logprobs(
        models[1], [p for p, _ in flat], [s.tokens for _, s in flat], max_seq_len=MAX_SEQ_LEN
    )
    for (_, s), w in zip(flat, want):
        np.testing.assert_allclose(s.logprobs, w, atol=1e-4)


@contextlib.contextmanager
def programs_lowered() -> Iterator[list[str]]:
    """The programs JAX lowers (traced to MLIR: compiled, or loaded from a cache) in the block,
    one entry each."""
    lowered: list[str] = []

    def count(event: str, seconds: float, **kwargs) -> None:
        if event == "/jax/core/compile/jaxpr_to_mlir_module_duration":
            lowered.append(event)

    jax.monitoring.register_event_duration_secs_listener(count)
    try:
        yield lowered
    finally:
        jax.monitoring.unregister_event_duration_listener(count)


def test_weights_as_a_transfer_delivers_them_compile_nothing_new(engine, models, tok):
    """A worker warms its sampler up on the model it built (its arrays not committed to a
    device), then samples the same shapes with the trainer's weights, which a weight transfer
    delivers committed to the device (``jax.device_put(x, sharding)``): nothing is compiled
    again (XLA compiles a program apart for committed arguments; the warm-up was wasted)."""
    prompts = prompts_of(tok, 3)
    engine.update_model(models[0])
    sample_prompts(engine, prompts, n=2, temperature=1.0, max_tokens=4, seed=0)
    delivered = jax.tree.map(
        lambda x: jax.device_put(x, x.sharding) if isinstance(x, jax.Array) else x, models[1]
    )
    with programs_lowered() as lowered:
        engine.update_model(delivered)
        sample_prompts(engine, prompts, n=2, temperature=1.0, max_tokens=4, seed=2)
    assert lowered == [], f"{len(lowered)} programs compiled again for the delivered weights"


@pytest.mark.parametrize("kind", ENGINES)
def test_a_new_engine_compiles_its_programs_in_its_first_call_only(kind, models, tok):
    """The second call of the same shapes compiles nothing: levanter's paged engine made its
    state not committed to a device and got it back committed, and compiled its prefill again
    (a program apart for each)."""
    # (12 tokens, 7 slots: no other test's shapes, so the first call finds nothing compiled)
    engine = make_engine(kind, models[0], max_seq_len=12, eos_id=tok.eos_id, max_seqs=7)
    lowered = []
    for seed in (0, 1):
        with programs_lowered() as programs:
            sample_prompts(
                engine, prompts_of(tok, 3), n=2, temperature=1.0, max_tokens=4, seed=seed
            )
        lowered.append(len(programs))
    assert lowered[0] > 0 and lowered[1] == 0, f"programs lowered per call: {lowered}"


def test_more_samples_than_slots_are_chunked(fresh, models, tok):
    prompts = [tok.encode(f"{a}*{b}=", add_bos=True) for a in range(5) for b in range(4)]
    out = sample_prompts(
        fresh, prompts, n=4, temperature=0.0, max_tokens=3
    )  # 80 sequences, 32 slots
    assert len(out) == 20
    for prompt, group in list(zip(prompts, out))[::7]:
        assert group[0].tokens.tolist() == greedy_reference(models[0], prompt, 3, {tok.eos_id})


def test_bad_requests_are_rejected_with_the_limit(fresh, tok):
    with pytest.raises(ValueError, match="prompts need 1..15 tokens"):
        sample_prompts(fresh, [[1] * MAX_SEQ_LEN], n=1)
    with pytest.raises(ValueError, match="n must be in 1..32"):
        sample_prompts(fresh, prompts_of(tok, 1), n=33)
    with pytest.raises(ValueError, match="at most 4"):
        sample_prompts(fresh, prompts_of(tok, 1), n=1, stop_tokens=[10, 11, 12, 13])


def test_update_model_rejects_a_different_architecture(fresh, models):
    bigger_vocab = models[0].resize_vocab(models[0].Vocab.size + 8)
    with pytest.raises(ValueError, match="same architecture"):
        fresh.update_model(bigger_vocab)


@pytest.mark.parametrize("kind", ENGINES)
def test_long_prompts_with_several_samples_each_match_the_trainer(kind, models, tok):
    """Prompts of 16 tokens and more (a chat template makes them common) with n > 1: every
    sample's logprobs match the trainer's. With 16-token KV pages levanter's clones of a prompt
    that fills a page decoded from the wrong cache entries."""
    max_seq_len = 40
    engine = make_engine(kind, models[1], max_seq_len=max_seq_len, eos_id=tok.eos_id, max_seqs=8)
    prompts = [
        [tok.bos_id] + [tok.token_id(str(i % 10)) for i in range(length)]
        for length in (15, 16, 17, 30)
    ]
    samples = sample_prompts(engine, prompts, n=2, temperature=1.0, max_tokens=8, seed=3)
    responses = [s.tokens for group in samples for s in group]
    ours = response_logprobs(
        models[1],
        [p for p in prompts for _ in range(2)],
        responses,
        max_seq_len=max_seq_len,
        pad_id=tok.pad_id,
    )
    for sample, expected in zip([s for group in samples for s in group], ours):
        assert sample.tokens.size > 1
        np.testing.assert_allclose(sample.logprobs, expected, atol=1e-4)


@pytest.mark.parametrize("kind", ENGINES)
def test_a_lora_policy_is_sampled_unmerged_as_the_trainer_computes_it(kind, models, tok):
    """A colocated LoRA job's sampler is handed the policy with its adapters apart (on the
    trainer's own base, no merged copy): every engine applies them, and its logprobs are the
    trainer's for that policy, which differ from the base's; greedy decoding picks what the
    merged policy picks."""
    from marin_rl_core.config.schema import LoraConfig
    from marin_rl_core.models.lora import add_adapters, merged, without_dropout

    lora = LoraConfig(rank=4, dropout=0.1)  # dropout: off while sampling
    policy = add_adapters(models[0], lora, key=jax.random.PRNGKey(5))
    policy = jax.tree.map(
        lambda x: x + 0.3 if eqx.is_array(x) and x.shape and x.shape[-1] == 4 else x, policy
    )  # a trained lora_B: every adapter moves the policy (lora_B is [..., out, 4])
    policy = without_dropout(policy)  # as the trainer hands it over (sampled_in_place)
    engine = make_engine(kind, policy, max_seq_len=MAX_SEQ_LEN, eos_id=tok.eos_id, max_seqs=8)
    prompts = prompts_of(tok, 3)
    samples = [s for g in sample_prompts(engine, prompts, n=2, temperature=1.0, max_tokens=6,
                                         seed=4) for s in g]  # fmt: skip
    args = ([p for p in prompts for _ in range(2)], [s.tokens for s in samples])
    ours = response_logprobs(policy, *args, max_seq_len=MAX_SEQ_LEN, pad_id=tok.pad_id)
    base = response_logprobs(models[0], *args, max_seq_len=MAX_SEQ_LEN, pad_id=tok.pad_id)
    for sample, expected in zip(samples, ours, strict=True):
        np.testing.assert_allclose(sample.logprobs, expected, atol=1e-4)
    assert max(np.abs(a - b).max() for a, b in zip(ours, base, strict=True)) > 1e-2
    greedy = sample_prompts(engine, prompts, n=1, temperature=0.0, max_tokens=6, seed=0)
    for prompt, (sample,) in zip(prompts, greedy, strict=True):
        assert (
            list(sample.tokens)
            == greedy_reference(merged(policy), prompt, 6, {tok.eos_id})[: sample.tokens.size]
        )


# --- the kv engine's own machinery: slots, rounds, per-request settings, its memory budget ------


def test_kv_samples_do_not_depend_on_slots_or_rounds(models, tok):
    """Continuous batching moves rows between slots and rounds: 4 slots refilled every 2 steps
    sample exactly what 64 slots decoding to the end sample."""
    from marin_rl_core.rollout.kv_engine import KVCacheEngine

    prompts = [tok.encode(f"{a}+{b}=", add_bos=True) for a in range(4) for b in range(3)]
    kwargs = dict(max_seq_len=MAX_SEQ_LEN, eos_id=tok.eos_id)
    small = KVCacheEngine(models[0], max_seqs=4, steps_per_round=2, **kwargs)
    large = KVCacheEngine(models[0], max_seqs=64, **kwargs)
    a = sample_prompts(small, prompts, n=3, temperature=1.0, max_tokens=8, seed=4)
    b = sample_prompts(large, prompts, n=3, temperature=1.0, max_tokens=8, seed=4)
    assert small.prefills > 9 and small.rounds > large.rounds  # 36 rows through 4 slots
    for group_a, group_b in zip(a, b):
        for x, y in zip(group_a, group_b):
            assert x.tokens.tolist() == y.tokens.tolist()
            np.testing.assert_allclose(x.logprobs, y.logprobs, atol=1e-5)


def test_kv_requests_in_one_call_keep_their_own_settings(models, tok):
    """Rows of different requests share rounds (the generation queue's case): each keeps its
    temperature, budget and stop ids."""
    from marin_rl_core.generation import GenerationRequest
    from marin_rl_core.rollout.kv_engine import KVCacheEngine

    engine = KVCacheEngine(models[0], max_seq_len=MAX_SEQ_LEN, eos_id=tok.eos_id, max_seqs=8)
    prompt = prompts_of(tok, 1)[0]
    free = greedy_reference(models[0], prompt, 6, {tok.eos_id})
    assert len(free) >= 3
    greedy, budget, stop, sampled = engine.generate(
        [
            GenerationRequest(prompt=prompt, n=2, temperature=0.0, max_tokens=6, fold=0),
            GenerationRequest(prompt=prompt, temperature=0.0, max_tokens=2, fold=1),
            GenerationRequest(
                prompt=prompt, temperature=0.0, max_tokens=6, stop_tokens=[free[1]], fold=2
            ),
            GenerationRequest(prompt=prompt, n=3, temperature=1.5, max_tokens=6, fold=3),
        ]
    )
    assert [s.tokens.tolist() for s in greedy] == [free, free]
    assert budget[0].tokens.tolist() == free[:2] and not budget[0].stopped
    assert stop[0].tokens.tolist() == free[: free.index(free[1]) + 1] and stop[0].stopped
    assert len(sampled) == 3 and all(1 <= s.tokens.size <= 6 for s in sampled)
    want = response_logprobs(
        models[0], [prompt] * 3, [s.tokens for s in sampled], max_seq_len=MAX_SEQ_LEN,
        temperature=1.5,
    )  # fmt: skip
    for s, w in zip(sampled, want):
        np.testing.assert_allclose(s.logprobs, w, atol=1e-4)


def test_kv_engine_sizes_its_slots_from_the_memory_budget(models, tok):
    from marin_rl_core.rollout.kv_engine import KVCacheEngine, free_device_bytes

    kwargs = dict(max_seq_len=MAX_SEQ_LEN, eos_id=tok.eos_id, max_seqs=10_000)
    free = free_device_bytes(jax.devices()[0])
    layers = sum(x.nbytes for x in jax.tree.leaves(models[0].transformer.layers))
    # Room for the decoder's copy and about 100 slots of this model.
    fraction = (layers + 100 * 13_000) / free
    engine = KVCacheEngine(models[0], memory_fraction=fraction, **kwargs)
    assert 10 < engine.max_seqs < 1000
    with pytest.raises(ValueError, match=f"n must be in 1..{engine.max_seqs}"):
        sample_prompts(engine, prompts_of(tok, 1), n=engine.max_seqs + 1)
    with pytest.raises(ConfigError, match="raise model.inference_memory_fraction"):
        KVCacheEngine(models[0], memory_fraction=layers / free / 2, **kwargs)


def test_kv_takes_new_weights_between_rounds_without_draining_its_rows(models, tok):
    """In-flight weights (issue 48): weights swapped while rows decode take effect at the next
    round; each token's logprob is from the weights that sampled it, and each sample says the
    weight steps it spans."""
    from marin_rl_core.generation import GenerationRequest
    from marin_rl_core.rollout.kv_engine import KVCacheEngine

    engine = KVCacheEngine(
        models[0], max_seq_len=MAX_SEQ_LEN, eos_id=tok.eos_id, max_seqs=8, steps_per_round=2
    )
    assert engine.in_flight_weights
    engine.update_model(models[0], weight_step=3)
    prompts = prompts_of(tok, 2)
    requests = [
        GenerationRequest(prompt=p, n=2, temperature=1.0, max_tokens=10, seed=11, fold=i)
        for i, p in enumerate(prompts)
    ]
    polls = []

    def poll():
        polls.append(len(polls))
        if len(polls) == 1:
            return [(requests, future)]
        if len(polls) == 2:  # after the prefill and one round of 2 steps: 3 tokens each
            engine.update_model(models[1], weight_step=4)
        return []

    import concurrent.futures

    future = concurrent.futures.Future()
    future.set_running_or_notify_cancel()
    engine.serve(poll)
    samples = [s for group in future.result() for s in group]
    rows = [p for p in prompts for _ in range(2)]
    old = response_logprobs(models[0], rows, [s.tokens for s in samples], max_seq_len=MAX_SEQ_LEN)
    new = response_logprobs(models[1], rows, [s.tokens for s in samples], max_seq_len=MAX_SEQ_LEN)
    spanned = 0
    for s, a, b in zip(samples, old, new):
        np.testing.assert_allclose(s.logprobs[:3], a[:3], atol=1e-4)
        np.testing.assert_allclose(s.logprobs[3:], b[3:], atol=1e-4)
        if s.tokens.size > 3:
            assert s.weight_steps == (3, 4)
            assert not np.allclose(s.logprobs[3:], a[3:], atol=1e-3)
            spanned += 1
        else:
            assert s.weight_steps == (3, 3)
    assert spanned >= 2
    # A call that starts after the swap: one weight step.
    after = engine.generate([GenerationRequest(prompt=prompts[0], max_tokens=4, seed=1)])
    assert after[0][0].weight_steps == (4, 4)
