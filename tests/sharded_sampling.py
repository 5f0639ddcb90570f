"""Sample through marinrl's engines (ENGINES: a comma-separated list of kv, paged, dense;
paged by default) with the model split over N simulated CPU devices (tensor parallelism); used
by tests/test_sharding.py.

    python tests/sharded_sampling.py DEVICES TENSOR_PARALLEL DTYPE OUT.json [ENGINES]

Writes, for each engine, for prompts of the default task: whether the engine's parameters are
sharded, the largest gap between the logprob the sharded engine reported for each sampled token
and the trainer's full-forward logprob of it (on one unsharded float32 copy of the weights), and
whether greedy decoding gives the same tokens as an unsharded engine. (The engines in one
process: each process costs a few CPU-seconds to start.)
"""

from __future__ import annotations

import json
import os
import sys


def main() -> None:
    devices, tp, dtype, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
    kinds = (sys.argv[5] if len(sys.argv) > 5 else "paged").split(",")
    # After the XLA flags this process inherits (the suite's quick compile): the last
    # value of a flag wins.
    flags = os.environ.get("XLA_FLAGS", "")
    os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={devices}"
    from marin_rl_core.deferred_imports import defer

    defer()  # as in marinrl's own processes: what levanter imports and these need not
    os.environ["JAX_PLATFORMS"] = "cpu"

    import jax
    import jax.numpy as jnp
    import numpy as np

    from marin_rl_core import EngineSpec, build_registry
    from marin_rl_core.config import ModelConfig
    from marin_rl_core.models.build import build_model
    from marin_rl_core.models.logprobs import response_logprobs
    from marin_rl_core.models.tokenizer import ArithmeticTokenizer
    from marin_rl_core.rollout.inference import sample_prompts
    from marin_rl_core.rollout.samplers import inference_mesh

    tok = ArithmeticTokenizer()
    config = ModelConfig(
        hidden_dim=32, intermediate_dim=64, num_layers=2, num_heads=4, num_kv_heads=4
    )
    model = build_model(config, tok, key=jax.random.PRNGKey(0))
    mesh, mapping = inference_mesh(tp)
    kwargs = dict(
        max_seq_len=config.max_seq_len, eos_id=tok.eos_id, max_seqs=64, compute_dtype=dtype
    )
    registry = build_registry()
    prompts = [tok.encode(f"{a}+{b}=", add_bos=True) for a in range(4) for b in range(3)]

    def check(kind: str) -> dict:
        sharded = registry.build_engine(
            kind, EngineSpec(model=model, mesh=mesh, axis_mapping=mapping, **kwargs)
        )
        plain = registry.build_engine(kind, EngineSpec(model=model, **kwargs))
        samples = sample_prompts(sharded, prompts, n=4, temperature=1.0, max_tokens=4, seed=5)
        pairs = [(p, s) for p, group in zip(prompts, samples) for s in group]
        trainer = response_logprobs(
            model,
            [p for p, _ in pairs],
            [s.tokens for _, s in pairs],
            max_seq_len=config.max_seq_len,
        )
        gap = max(float(np.max(np.abs(t - s.logprobs))) for t, (_, s) in zip(trainer, pairs))
        greedy = [
            [s.tokens.tolist() for s in group]
            for engine in (sharded, plain)
            for group in sample_prompts(engine, prompts, n=1, temperature=0.0, max_tokens=4, seed=0)
        ]
        half = len(greedy) // 2
        leaves = [x for x in jax.tree.leaves(sharded.model) if hasattr(x, "sharding")]
        return {
            "devices": jax.device_count(),
            "sharded": any(not x.sharding.is_fully_replicated for x in leaves),
            "dtypes": sorted(
                {str(x.dtype) for x in leaves if jnp.issubdtype(x.dtype, jnp.floating)}
            ),
            "max_logprob_gap": gap,
            "n_tokens": int(sum(s.tokens.size for _, s in pairs)),
            "greedy_equal": greedy[:half] == greedy[half:],
        }

    with open(out, "w") as f:
        json.dump({kind: check(kind) for kind in kinds}, f)


if __name__ == "__main__":
    main()
