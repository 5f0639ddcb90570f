"""The plain JAX generation loop `bench/generation.py` measures the engines against: what a user
would write in an afternoon instead of using an engine (issue 48's "plain JAX loop" row).

The model's weights as plain arrays, prompts left-padded to one width, a KV cache per layer of
the whole sequence length, prefill then every decode step in one ``jax.lax.fori_loop`` inside
one jit; every row samples to its budget (no stop tokens, no batching of mixed lengths, no
memory budget). Attention is an einsum over the whole cache with a mask, softmax in float32.
Runs levanter's Llama-family models (Llama, Qwen2, Qwen3: q/k norms where the model has them)
without levanter's modules, so it is also a check of them: :func:`greedy_agrees` compares its
greedy tokens with an engine's.
"""

from __future__ import annotations

import functools
import math
import statistics
import time
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np


def _axes(spec: Any) -> tuple[Any, ...]:
    return tuple(spec) if isinstance(spec, Sequence) else (spec,)


def weights(model: Any) -> dict[str, Any]:
    """The arrays of a levanter Llama-family model: projections ``[layer, out, in]``."""

    def matrix(linear: Any) -> jax.Array:
        out, inn = _axes(linear.Out), _axes(linear.In)
        w = (linear.weight * linear.reparam.active_scale).rearrange(("layer", *out, *inn)).array
        return w.reshape(w.shape[0], math.prod(a.size for a in out), -1)

    def vector(norm: Any) -> jax.Array | None:
        return None if norm is None else norm.weight.rearrange(("layer", *_axes(norm.axis))).array

    stacked = model.transformer.layers.stacked
    attn = stacked.self_attn
    return dict(
        embed=model.embeddings.token_embeddings.weight.rearrange((model.Vocab, model.Embed)).array,
        ln1=vector(stacked.input_layernorm),
        ln2=vector(stacked.post_attention_layernorm),
        q=matrix(attn.q_proj),
        k=matrix(attn.k_proj),
        v=matrix(attn.v_proj),
        o=matrix(attn.o_proj),
        q_norm=vector(getattr(attn, "q_norm", None)),
        k_norm=vector(getattr(attn, "k_norm", None)),
        gate=matrix(stacked.mlp.gate_proj),
        up=matrix(stacked.mlp.up_proj),
        down=matrix(stacked.mlp.down_proj),
        norm=model.transformer.norm.weight.array,
        head=model.get_lm_head().rearrange((model.Vocab, model.Embed)).array,
    )


def _rms(x: jax.Array, w: jax.Array, eps: float) -> jax.Array:
    xf = x.astype(jnp.float32)
    return (xf * jax.lax.rsqrt(jnp.mean(xf * xf, -1, keepdims=True) + eps)).astype(x.dtype) * w


def _rope(x: jax.Array, pos: jax.Array, theta: float) -> jax.Array:
    """Rotary embeddings of ``x [B, T, heads, d]`` at ``pos [B, T]`` (rotate-half layout)."""
    d = x.shape[-1]
    inv = 1.0 / theta ** (jnp.arange(0, d, 2, dtype=jnp.float32) / d)
    freqs = pos[..., None].astype(jnp.float32) * inv
    emb = jnp.concatenate([freqs, freqs], -1)[:, :, None, :]
    cos, sin = jnp.cos(emb).astype(x.dtype), jnp.sin(emb).astype(x.dtype)
    rotated = jnp.concatenate([-x[..., d // 2 :], x[..., : d // 2]], -1)
    return x * cos + rotated * sin


def _forward(w, caches, ids, pos, start, valid, *, kv_heads, head_dim, eps, theta):  # type: ignore[no-untyped-def]
    """Hidden states of ``ids [B, T]`` at cache positions ``start..start+T``; returns them and
    the caches (per layer ``[B, S, kv_heads, head_dim]``) with those positions written."""
    b, t = ids.shape
    h = w["embed"][ids]
    keys_at = jnp.arange(caches[0][0].shape[1])
    visible = (keys_at[None, None, :] <= start + jnp.arange(t)[None, :, None]) & valid[:, None, :]
    new_caches = []
    for layer, (k_cache, v_cache) in enumerate(caches):
        a = _rms(h, w["ln1"][layer], eps)
        q = (a @ w["q"][layer].T).reshape(b, t, kv_heads, -1, head_dim)
        k = (a @ w["k"][layer].T).reshape(b, t, kv_heads, head_dim)
        v = (a @ w["v"][layer].T).reshape(b, t, kv_heads, head_dim)
        if w["q_norm"] is not None:
            q, k = _rms(q, w["q_norm"][layer], eps), _rms(k, w["k_norm"][layer], eps)
        q = _rope(q.reshape(b, t, -1, head_dim), pos, theta).reshape(q.shape)
        k = _rope(k, pos, theta)
        k_cache = jax.lax.dynamic_update_slice(k_cache, k.astype(k_cache.dtype), (0, start, 0, 0))
        v_cache = jax.lax.dynamic_update_slice(v_cache, v.astype(v_cache.dtype), (0, start, 0, 0))
        new_caches.append((k_cache, v_cache))
        scores = jnp.einsum("btkgd,bskd->bkgts", q, k_cache, preferred_element_type=jnp.float32)
        scores = jnp.where(visible[:, None, None], scores / math.sqrt(head_dim), -1e30)
        probs = jax.nn.softmax(scores, -1).astype(v_cache.dtype)
        out = jnp.einsum("bkgts,bskd->btkgd", probs, v_cache).reshape(b, t, -1)
        h = h + out.astype(h.dtype) @ w["o"][layer].T
        m = _rms(h, w["ln2"][layer], eps)
        h = h + (jax.nn.silu(m @ w["gate"][layer].T) * (m @ w["up"][layer].T)) @ w["down"][layer].T
    return _rms(h, w["norm"], eps), new_caches


@functools.partial(jax.jit, static_argnames=("new_tokens", "seq_len", "greedy", "shape"))
def generate(w, ids, valid, key, *, new_tokens, seq_len, greedy, shape):  # type: ignore[no-untyped-def]
    """``new_tokens`` tokens for each row of ``ids [B, P]`` (left-padded; ``valid`` marks the
    real tokens): prefill, then a ``fori_loop`` of decode steps, all on the device."""
    layers, kv_heads, head_dim, eps, theta = shape
    b, p = ids.shape
    dims = dict(kv_heads=kv_heads, head_dim=head_dim, eps=eps, theta=theta)
    cache = jnp.zeros((b, seq_len, kv_heads, head_dim), w["k"].dtype)
    caches = [(cache, cache) for _ in range(layers)]
    valid_cache = jnp.zeros((b, seq_len), bool).at[:, :p].set(valid)
    pos = jnp.maximum(jnp.cumsum(valid, -1) - 1, 0)

    def draw(hidden, key):  # type: ignore[no-untyped-def]
        logits = jnp.einsum("be,ve->bv", hidden, w["head"], preferred_element_type=jnp.float32)
        return jnp.argmax(logits, -1) if greedy else jax.random.categorical(key, logits)

    hidden, caches = _forward(w, caches, ids, pos, 0, valid_cache, **dims)
    keys = jax.random.split(key, new_tokens)
    first = draw(hidden[:, -1], keys[0]).astype(jnp.int32)
    out = jnp.zeros((b, new_tokens), jnp.int32).at[:, 0].set(first)
    lengths = valid.sum(-1)

    def step(i, carry):  # type: ignore[no-untyped-def]
        out, caches, valid_cache = carry
        at = p + i - 1  # the cache position of the token fed this step
        valid_cache = valid_cache.at[:, at].set(True)
        fed = jax.lax.dynamic_slice_in_dim(out, i - 1, 1, axis=1)
        hidden, caches = _forward(
            w, caches, fed, (lengths + i - 1)[:, None], at, valid_cache, **dims
        )
        token = draw(hidden[:, 0], keys[i]).astype(jnp.int32)
        return out.at[:, i].set(token), caches, valid_cache

    out, _, _ = jax.lax.fori_loop(1, new_tokens, step, (out, caches, valid_cache))
    return out


def _batch(prompts: Sequence[Sequence[int]]) -> tuple[np.ndarray, np.ndarray]:
    width = max(len(p) for p in prompts)
    ids = np.zeros((len(prompts), width), np.int32)
    valid = np.zeros((len(prompts), width), bool)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :], valid[i, width - len(p) :] = p, True
    return ids, valid


def _shape(model: Any) -> tuple[Any, ...]:
    config = model.config
    attn = model.transformer.layers.stacked.self_attn.config
    return (
        config.num_layers,
        attn.num_kv_heads,
        attn.head_size,
        float(config.layer_norm_epsilon),
        float(config.rope.theta),
    )


def run(model: Any, prompts: Sequence[Sequence[int]], new_tokens: int, *, seq_len: int, greedy: bool = False, seed: int = 0, w: dict[str, Any] | None = None) -> np.ndarray:  # fmt: skip
    """``[rows, new_tokens]`` tokens the plain loop samples for ``prompts``; ``w``: the model's
    :func:`weights`, taken once by a caller that runs many times (taking them copies every
    projection)."""
    ids, valid = _batch(prompts)
    out = generate(
        weights(model) if w is None else w,
        jnp.asarray(ids),
        jnp.asarray(valid),
        jax.random.PRNGKey(seed),
        new_tokens=new_tokens,
        seq_len=seq_len,
        greedy=greedy,
        shape=_shape(model),
    )
    return np.asarray(jax.device_get(out))


def time_plain(model: Any, prompts: Sequence[Sequence[int]], tokens: int, repeats: int, *, seq_len: int) -> tuple[float, int]:  # fmt: skip
    """(median seconds, tokens generated) of the plain loop, after a compiling call; the weights
    are taken once, outside the timed calls (as an engine holds its own)."""
    w = weights(model)
    run(model, prompts, tokens, seq_len=seq_len, seed=1000, w=w)
    times = []
    for r in range(repeats):
        start = time.perf_counter()
        out = run(model, prompts, tokens, seq_len=seq_len, seed=r, w=w)
        times.append(time.perf_counter() - start)
    return statistics.median(times), int(out.size)


def greedy_agrees(model: Any, engine: Any, prompts: Sequence[Sequence[int]], tokens: int, *, seq_len: int) -> tuple[int, int]:  # fmt: skip
    """(tokens equal, tokens compared) of the plain loop's greedy samples and ``engine``'s,
    each row up to its first difference (float rounding may part them later)."""
    from marin_rl_core.rollout.inference import sample_prompts

    plain = run(model, prompts, tokens, seq_len=seq_len, greedy=True)
    theirs = sample_prompts(engine, prompts, n=1, temperature=0.0, max_tokens=tokens, seed=0)
    equal = 0
    for row, group in zip(plain, theirs):
        sampled = np.asarray(group[0].tokens)
        for a, b in zip(row, sampled):
            if a != b:
                break
            equal += 1
    return equal, plain.size
