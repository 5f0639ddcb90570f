"""Log-probabilities of a batch sharded over simulated CPU devices; used by
tests/test_sharding.py in a process of its own (XLA fixes the device count when JAX starts).

    python tests/sharded_logprobs.py DEVICES OUT.json

Writes, under ``"dp"``, for the batch split over 1 device and over all ``DEVICES`` (data
parallel, the parameters replicated): the compiled forward-and-backward pass's collectives
(what crosses devices), its per-device temporary memory, and the largest difference from the
same computation unsharded. Under ``"fsdp"``, with the parameters split over the devices too (a
4,096-token vocabulary): the temporary memory with the LM head computed vocabulary-parallel and
without, and the largest differences of the log-probabilities and of the gradient from the
unsharded computation. (One process for all of it: each costs a few CPU-seconds to start.)
"""

from __future__ import annotations

import json
import os
import sys


def _start_jax(devices: int) -> None:
    # After the XLA flags this process inherits (the suite's quick compile): the last
    # value of a flag wins.
    flags = os.environ.get("XLA_FLAGS", "")
    os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={devices}"
    from marin_rl_core.deferred_imports import defer

    defer()  # as in marinrl's own processes: what levanter imports and these need not
    os.environ["JAX_PLATFORMS"] = "cpu"


def _problem(vocab: int, rows: int, block_tokens: int):  # type: ignore[no-untyped-def]
    """The default model with a ``vocab``-token vocabulary, a ``[rows, 64]`` batch of ids, and
    a weighted sum of its log-probabilities (computed ``block_tokens`` tokens per device per
    block) to differentiate, returning the log-probabilities too."""
    from types import SimpleNamespace

    import haliax as hax
    import jax
    import jax.numpy as jnp
    import numpy as np

    from marin_rl_core.config import ModelConfig
    from marin_rl_core.models.build import build_model
    from marin_rl_core.models.logprobs import next_token_logprobs_and_entropy

    model = build_model(
        ModelConfig(max_seq_len=64), SimpleNamespace(vocab_size=vocab), key=jax.random.PRNGKey(0)
    )
    rng = np.random.default_rng(0)
    ids = hax.named(
        jnp.asarray(rng.integers(4, vocab, size=(rows, 64)), jnp.int32), ("batch", "position")
    )
    weights = jnp.asarray(rng.normal(size=(rows, 64)), jnp.float32)

    def loss(m, ids):  # type: ignore[no-untyped-def]
        logprobs, _ = next_token_logprobs_and_entropy(m, ids, block_tokens=block_tokens)
        return jnp.sum(logprobs.array * weights), logprobs.array

    return model, ids, loss


def main() -> None:
    devices, out = int(sys.argv[1]), sys.argv[2]
    _start_jax(devices)
    import equinox as eqx

    from marin_rl_core.models.tokenizer import ArithmeticTokenizer

    # Blocks of 32 tokens per device: 32 // (32 / devices) positions of every row at a time.
    model, ids, loss = _problem(ArithmeticTokenizer().vocab_size, rows=32, block_tokens=32)
    step = eqx.filter_jit(eqx.filter_value_and_grad(loss, has_aux=True))
    (_, plain), _ = step(model, ids)
    dp = {str(n): data_parallel(n, model, ids, step, plain) for n in sorted({1, devices})}
    got = {"dp": dp, "fsdp": fsdp()}
    with open(out, "w") as f:
        json.dump(got, f)


def data_parallel(devices, model, ids, step, plain) -> dict:  # type: ignore[no-untyped-def]
    """``step`` on ``ids`` split over the first ``devices`` devices, against its unsharded
    log-probabilities ``plain`` (see the module docstring)."""
    import haliax as hax
    import jax
    import numpy as np

    mesh = jax.sharding.Mesh(np.array(jax.devices()[:devices]), ("data",))
    with hax.partitioning.set_mesh(mesh), hax.axis_mapping({"batch": "data"}):
        sharded_ids = hax.shard(ids)
        compiled = step.lower(model, sharded_ids).lowered.compile()
        (_, sharded), _ = step(model, sharded_ids)
    text = compiled.as_text()
    collectives = sorted(
        {op for op in ("all-gather", "all-to-all", "collective-permute") if f" {op}(" in text}
    )
    stats = compiled.memory_analysis()
    return {
        "collectives": collectives,
        "temp_bytes": int(stats.temp_size_in_bytes),
        "max_difference": float(np.abs(np.asarray(sharded) - np.asarray(plain)).max()),
    }


def fsdp() -> dict:
    """The parameters split over every device too (see the module docstring)."""
    import equinox as eqx
    import haliax as hax
    import jax
    import numpy as np

    from marin_rl_core.models.logprobs import lm_head_split

    model, ids, loss = _problem(4096, rows=16, block_tokens=64)
    step = eqx.filter_jit(eqx.filter_value_and_grad(loss, has_aux=True))
    (_, plain), plain_grad = step(model, ids)

    def lm_head_grad(grad):  # type: ignore[no-untyped-def]
        return np.asarray(grad.get_lm_head().rearrange(("embed", "vocab")).array)

    mesh = jax.sharding.Mesh(np.array(jax.devices()), ("data",))
    got = {}
    # As levanter's trainer does: parameters split over their embed axis, the batch over its
    # rows while computing.
    with hax.partitioning.set_mesh(mesh), hax.axis_mapping({"batch": "data"}):
        sharded_model = hax.shard(model, {"embed": "data"})
        sharded_ids = hax.shard(ids)
        for split in (False, True):
            # A function of its own each time (jit caches by function): the switch is read
            # while tracing.
            def fresh_loss(m, ids):  # type: ignore[no-untyped-def]
                return loss(m, ids)

            fresh = eqx.filter_jit(eqx.filter_value_and_grad(fresh_loss, has_aux=True))
            with lm_head_split(split):
                compiled = fresh.lower(sharded_model, sharded_ids).lowered.compile()
                (_, sharded), grad = fresh(sharded_model, sharded_ids)
            got[str(split)] = {
                "temp_bytes": int(compiled.memory_analysis().temp_size_in_bytes),
                "max_difference": float(np.abs(np.asarray(sharded) - np.asarray(plain)).max()),
                "max_grad_difference": float(
                    np.abs(lm_head_grad(grad) - lm_head_grad(plain_grad)).max()
                ),
                "grad_scale": float(np.abs(lm_head_grad(plain_grad)).max()),
            }
    return got


if __name__ == "__main__":
    main()
