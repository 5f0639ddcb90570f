"""The example engine's own tests, as its author runs them (pytest in this directory, the package
installed): marinrl's engine contract check (its logprobs against the trainer's on a tiny model),
and its samples, greedy and drawn, against the built-in ``dense`` engine's: both draw with
marinrl's public engine helpers, so they agree token for token."""

from __future__ import annotations

import marinrl_reference_engine
import numpy as np

from marin_rl_core import EngineSpec, requests_for
from marin_rl_core.testing import check_plugin


def test_the_plugin_honours_the_engine_contract(plugin_registry):
    registry = plugin_registry(marinrl_reference_engine)
    assert registry.names("engine") == ["reference"]
    check_plugin(registry.get("engine", "reference"))


def test_samples_are_the_dense_engines():
    import jax

    from marin_rl_core import DenseSampler
    from marin_rl_core.testing import ArithmeticTokenizer, ModelConfig, build_model

    tok = ArithmeticTokenizer()
    shape = ModelConfig(hidden_dim=32, intermediate_dim=64, num_layers=2, num_heads=4)
    model = build_model(shape, tok, key=jax.random.PRNGKey(1))
    spec = EngineSpec(model=model, max_seq_len=16, eos_id=tok.eos_id, max_seqs=8)
    prompts = [tok.encode(f"{a}+{b}=", add_bos=True) for a, b in ((1, 2), (30, 4), (7, 77))]
    dense = DenseSampler(model, **spec.engine_kwargs())
    # A stop id the first row reaches within three tokens (an untrained model rarely says EOS).
    stop = int(dense.generate(requests_for(prompts[:1], temperature=0.0))[0][0].tokens[2])
    requests = requests_for(prompts, temperature=0.0, max_tokens=6, stop_tokens=[stop])

    ours = marinrl_reference_engine.ReferenceEngine(
        marinrl_reference_engine.ReferenceEngineConfig(), spec
    ).generate(requests)
    theirs = dense.generate(requests)
    assert ours[0][0].stopped and ours[0][0].tokens.size <= 3
    drawn = requests_for(prompts, n=2, temperature=1.0, max_tokens=6, seed=7)
    engine = marinrl_reference_engine.ReferenceEngine(
        marinrl_reference_engine.ReferenceEngineConfig(), spec
    )
    ours += engine.generate(drawn)
    theirs += dense.generate(drawn)
    assert len({tuple(s.tokens.tolist()) for row in ours[3:] for s in row}) > 1
    for mine_row, want_row in zip(ours, theirs, strict=True):
        for mine, want in zip(mine_row, want_row, strict=True):
            assert mine.tokens.tolist() == want.tokens.tolist()
            assert mine.stopped == want.stopped
            np.testing.assert_allclose(mine.logprobs, want.logprobs, atol=1e-4)
