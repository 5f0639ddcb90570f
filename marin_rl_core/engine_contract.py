"""The contract check of a generation engine plugin (re-exported by :mod:`marin_rl_core.testing`
as ``check_engine``): what the rollout side relies on, on a tiny model built here.

``tests/test_inference.py`` is the full behavioural suite the built-in engines pass (the
sampling distribution, weight swaps, chunking, tensor parallelism); this check is the short
version a third-party engine's tests call.
"""

from __future__ import annotations

from typing import Any

import attrs
import numpy as np

from marin_rl_core import protocols
from marin_rl_core.generation import EngineSpec, GenerationRequest
from marin_rl_core.hookspecs import PluginRecord


def check_engine(record: PluginRecord, config: Any = None) -> None:
    """Build the engine ``record`` (with ``config``, default: its config class's defaults) for a
    tiny float32 Llama and check: it is a
    :class:`~marin_rl_core.protocols.GenerationEngine`; every request gets its ``n`` samples,
    each within its budget and ending at a stop id exactly when ``stopped``; the same key gives
    the same samples whatever else the call holds; and, when it declares ``exact_logprobs``,
    the logprobs (greedy rows' untempered) equal the trainer's (to 1e-4)."""
    import jax

    from marin_rl_core.config.converter import check_config_class
    from marin_rl_core.config.schema import ModelConfig
    from marin_rl_core.models.build import build_model
    from marin_rl_core.models.logprobs import response_logprobs
    from marin_rl_core.models.tokenizer import ArithmeticTokenizer
    from marin_rl_core.registry import build_registry

    tok = ArithmeticTokenizer()
    shape = ModelConfig(hidden_dim=32, intermediate_dim=64, num_layers=2, num_heads=4)
    model = build_model(shape, tok, key=jax.random.PRNGKey(0))
    spec = EngineSpec(model=model, max_seq_len=16, eos_id=tok.eos_id, max_seqs=16)
    config = check_config_class(record, config)
    registry = build_registry()  # for an engine (auto) that builds another
    spec = attrs.evolve(spec, build_engine=lambda other: registry.build_engine(other, spec))
    engine = record.build(config, spec)
    name = f"engine {record.name!r}"
    assert isinstance(engine, protocols.GenerationEngine), f"{name}: not a GenerationEngine"

    prompts = [tok.encode(f"{a}+{a + 1}=", add_bos=True) for a in range(3)]
    requests = [
        GenerationRequest(prompt=prompts[0], n=3, temperature=1.0, max_tokens=4, seed=1, fold=0),
        GenerationRequest(prompt=prompts[1], n=1, temperature=0.0, max_tokens=5, seed=1, fold=1),
        GenerationRequest(prompt=prompts[2], n=2, temperature=0.7, max_tokens=2, seed=2),
    ]
    out = engine.generate(requests)
    assert [len(group) for group in out] == [3, 1, 2], f"{name}: one sample per row"
    for request, group in zip(requests, out):
        for sample in group:
            tokens = np.asarray(sample.tokens)
            assert 1 <= tokens.size <= request.max_tokens, f"{name}: over its budget"
            assert np.asarray(sample.logprobs).shape == tokens.shape, f"{name}: logprobs shape"
            assert sample.stopped == (int(tokens[-1]) == tok.eos_id), f"{name}: stopped flag"
            assert tok.eos_id not in tokens[:-1].tolist(), f"{name}: went on past EOS"
    again = engine.generate([requests[0]])
    assert [s.tokens.tolist() for s in again[0]] == [s.tokens.tolist() for s in out[0]], (
        f"{name}: the same key must give the same samples, whatever else the call holds"
    )
    if getattr(record, "exact_logprobs", True):
        flat = [(r, s) for r, group in zip(requests, out) for s in group]
        for request, sample in flat:
            (want,) = response_logprobs(
                model,
                [list(request.prompt)],
                [sample.tokens],
                max_seq_len=16,
                pad_id=tok.pad_id,
                temperature=request.temperature if request.temperature > 0 else 1.0,
            )
            np.testing.assert_allclose(
                sample.logprobs, want, atol=1e-4, err_msg=f"{name}: logprobs differ"
            )


__all__ = ["check_engine"]
