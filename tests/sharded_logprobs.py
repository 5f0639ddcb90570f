"""Log-probabilities of a batch sharded over N simulated CPU devices (data parallel); used by
tests/test_sharding.py in a process of its own (XLA fixes the device count when JAX starts).

    python tests/sharded_logprobs.py DEVICES OUT.json

Writes the compiled forward-and-backward pass's collectives (what crosses devices) and its
per-device temporary memory, and the largest difference from the same computation unsharded.
"""

from __future__ import annotations

import json
import os
import sys


def main() -> None:
    devices, out = int(sys.argv[1]), sys.argv[2]
    os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices}"
    os.environ["JAX_PLATFORMS"] = "cpu"

    import equinox as eqx
    import haliax as hax
    import jax
    import jax.numpy as jnp
    import numpy as np

    from marin_rl_core.config import ModelConfig
    from marin_rl_core.model import build_model, next_token_logprobs_and_entropy
    from marin_rl_core.tokenizer import ArithmeticTokenizer

    tok = ArithmeticTokenizer()
    model = build_model(ModelConfig(max_seq_len=64), tok, key=jax.random.PRNGKey(0))
    rng = np.random.default_rng(0)
    rows = 32
    ids = hax.named(
        jnp.asarray(rng.integers(4, tok.vocab_size, size=(rows, 64)), jnp.int32),
        ("batch", "position"),
    )
    weights = jnp.asarray(rng.normal(size=(rows, 64)), jnp.float32)

    def loss(m, ids):  # type: ignore[no-untyped-def]
        # Blocks of 32 tokens per device: 32 // (32 / devices) positions of every row at a time.
        logprobs, _ = next_token_logprobs_and_entropy(m, ids, block_tokens=32)
        return jnp.sum(logprobs.array * weights), logprobs.array

    step = eqx.filter_jit(eqx.filter_value_and_grad(loss, has_aux=True))
    (_, plain), _ = step(model, ids)

    mesh = jax.sharding.Mesh(np.array(jax.devices()), ("data",))
    with hax.partitioning.set_mesh(mesh), hax.axis_mapping({"batch": "data"}):
        sharded_ids = hax.shard(ids)
        compiled = step.lower(model, sharded_ids).lowered.compile()
        (_, sharded), _ = step(model, sharded_ids)
    text = compiled.as_text()
    collectives = sorted(
        {op for op in ("all-gather", "all-to-all", "collective-permute") if f" {op}(" in text}
    )
    stats = compiled.memory_analysis()
    with open(out, "w") as f:
        json.dump(
            {
                "collectives": collectives,
                "temp_bytes": int(stats.temp_size_in_bytes),
                "max_difference": float(np.abs(np.asarray(sharded) - np.asarray(plain)).max()),
            },
            f,
        )


if __name__ == "__main__":
    main()
