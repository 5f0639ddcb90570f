"""The ``kv`` engine's compiled half: the model's forward pass over a KV cache in slots, prefill,
decode rounds and token sampling (the host loop that drives them is
:mod:`marin_rl_core.rollout.kv_engine`).

The forward pass is levanter's Llama decoder layer (its modules: norms, projections, rotary
embeddings, q/k norms, the MLP) with attention over the cache written here: keys and values of
a row are contiguous per head (``[layer, slot, kv_head, position, head_size]``), and a decode step
attends over the first ``window`` positions only.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import equinox as eqx
import haliax as hax
import jax
import jax.numpy as jnp
from levanter.models.llama import LlamaLMHeadModel
from levanter.models.lm_model import LmHeadModel


class DecodeState(eqx.Module):
    """Every slot's state on the device (``C`` slots of ``S`` positions)."""

    k: jax.Array  # [layer, C, kv_head, S, head_size]: a row's keys are contiguous per head
    v: jax.Array
    tokens: jax.Array  # [C, S] int32: prompt then response
    logprobs: jax.Array  # [C, S] float32, at each response token's position
    length: jax.Array  # [C] tokens so far; the cache holds all but the last
    end: jax.Array  # [C] the length a row stops at (prompt + budget)
    prompt_len: jax.Array  # [C]
    done: jax.Array  # [C] bool: finished (or free)
    temperature: jax.Array  # [C] float32
    stops: jax.Array  # [C, max_stop_tokens] int32
    keys: jax.Array  # [C, 2] uint32 row keys


def check_model(model: LmHeadModel) -> None:
    if not isinstance(model, LlamaLMHeadModel) or not hasattr(model.transformer.layers, "stacked"):
        raise ValueError(
            f"the kv engine runs levanter's Llama-family models (Llama, Qwen2, Qwen3) with "
            f"stacked layers; {type(model).__name__} is not one: use the paged engine"
        )


def kv_shape(model: LlamaLMHeadModel) -> tuple[int, int, int]:
    """(layers, kv heads, head size) of the model's attention."""
    attn = model.transformer.layers.stacked.self_attn.config
    return model.config.num_layers, attn.num_kv_heads, attn.head_size


# --- the model, one layer at a time ---------------------------------------------------------------


def _attend(
    layer: Any, q: hax.NamedArray, keys: jax.Array, values: jax.Array, visible: jax.Array
) -> jax.Array:
    """Attention of ``q`` (batch, position, kv_head, q_heads_per_group, head_size) over ``keys`` /
    ``values`` ``[batch, kv_head, key, head_size]`` where ``visible [batch, position, key]``;
    softmax in float32."""
    config = layer.self_attn.config
    scale = config.scaling_factor or 1.0 / math.sqrt(config.head_size)
    qa = q.rearrange(("batch", "position", "kv_head", "q_heads_per_group", "head_size")).array
    scores = jnp.einsum(
        "btkgd,bksd->bkgts", qa, keys, preferred_element_type=jnp.float32
    ) * jnp.float32(scale)
    if config.logits_soft_cap is not None:
        scores = config.logits_soft_cap * jnp.tanh(scores / config.logits_soft_cap)
    scores = jnp.where(visible[:, None, None], scores, jnp.finfo(jnp.float32).min)
    weights = jax.nn.softmax(scores, axis=-1).astype(values.dtype)
    return jnp.einsum("bkgts,bksd->btkgd", weights, values)


def _finish_layer(layer: Any, x: hax.NamedArray, attended: jax.Array) -> hax.NamedArray:
    """The rest of a decoder layer after attention: output projection, residuals, the MLP."""
    out = hax.named(attended, ("batch", "position", "kv_head", "q_heads_per_group", "head_size"))
    out = out.flatten_axes(("kv_head", "q_heads_per_group"), "heads").astype(x.dtype)
    out = layer.self_attn.o_proj(out)
    if getattr(layer, "post_attn_layernorm", None) is not None:
        out = layer.post_attn_layernorm(out)
    x = x + out
    mlp = layer.mlp(layer.post_attention_layernorm(x))
    if getattr(layer, "post_mlp_layernorm", None) is not None:
        mlp = layer.post_mlp_layernorm(mlp)
    return x + mlp


def _qkv(layer: Any, x: hax.NamedArray, pos: hax.NamedArray) -> tuple[Any, jax.Array, jax.Array]:
    q, k, v = layer.self_attn._compute_qkv(layer.input_layernorm(x), key=None, pos_ids=pos)
    order = ("batch", "kv_head", "position", "head_size")
    return q, k.rearrange(order).array, v.rearrange(order).array


def _lm_head(model: LlamaLMHeadModel) -> jax.Array:
    """The LM head as ``[vocab, embed]``: how levanter stores it (tied or not), and the layout
    a CPU multiplies fastest (no transpose of a vocabulary-sized matrix)."""
    return model.get_lm_head().rearrange((model.Vocab, model.Embed)).array


def _logits(hidden: jax.Array, head: jax.Array, temperature: jax.Array) -> jax.Array:
    """The float32 logits of ``hidden [rows, embed]``, divided by each row's temperature (1 for
    greedy rows): :func:`~marin_rl_core.models.logprobs.tempered_logits`' computation with the
    head in ``[vocab, embed]`` layout."""
    logits = jnp.einsum("be,ve->bv", hidden, head, preferred_element_type=jnp.float32)
    return logits.astype(jnp.float32) / _safe(temperature)[:, None]


SAMPLING_BLOCK = 512
"""Vocabulary entries per block of :func:`draw_tokens`' two-level inverse-CDF sampling."""


def _inverse_cdf(logits: jax.Array, u: jax.Array) -> jax.Array:
    """For each row, the token whose probability interval holds ``u [rows]`` in ``[0, 1)``:
    the first token whose cumulative probability exceeds ``u``, found block by block (the sum
    of each block of :data:`SAMPLING_BLOCK` tokens, then the cumulative sum within the chosen
    block), so one uniform number per row draws a token instead of one per vocabulary entry
    (Gumbel-max), and the cumulative sums stay short enough for float32. A token of zero
    probability is never drawn."""
    rows, vocab = logits.shape
    block = min(SAMPLING_BLOCK, vocab)
    pad = -vocab % block
    probs = jnp.exp(logits - jnp.max(logits, axis=-1, keepdims=True))
    probs = jnp.pad(probs, ((0, 0), (0, pad))).reshape(rows, -1, block)
    sums = probs.sum(-1)  # [rows, blocks]
    cumulative = jnp.cumsum(sums, axis=-1)
    target = u * cumulative[:, -1]
    chosen = jnp.minimum(jnp.sum(cumulative <= target[:, None], axis=-1), sums.shape[1] - 1)
    before = jnp.take_along_axis(cumulative - sums, chosen[:, None], axis=-1)[:, 0]
    inner = jnp.take_along_axis(probs, chosen[:, None, None], axis=1)[:, 0]  # [rows, block]
    within = jnp.sum(jnp.cumsum(inner, axis=-1) <= (target - before)[:, None], axis=-1)
    # Rounding may put the target past the block's last token of non-zero probability.
    last = block - 1 - jnp.argmax((inner > 0)[:, ::-1], axis=-1)
    return chosen * block + jnp.minimum(within, last)


def draw_tokens(
    logits: jax.Array, keys: jax.Array, step: jax.Array, temperature: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """Each row's next token (greedy where ``temperature <= 0``) and its logprob under
    ``logits [rows, vocab]`` (already tempered), drawn with ``fold_in(key, step)``."""
    step_keys = jax.vmap(jax.random.fold_in)(keys, step)
    u = jax.vmap(jax.random.uniform)(step_keys)
    drawn = _inverse_cdf(logits, u)
    token = jnp.where(temperature <= 0, jnp.argmax(logits, axis=-1), drawn).astype(jnp.int32)
    logprob = jnp.take_along_axis(logits, token[:, None], axis=-1)[:, 0] - jax.nn.logsumexp(
        logits, axis=-1
    )
    return token, logprob


def _safe(temperature: jax.Array) -> jax.Array:
    return jnp.where(temperature <= 0, 1.0, temperature)


def _stopped(token: jax.Array, stops: jax.Array) -> jax.Array:
    return jnp.any(token[:, None] == stops, axis=-1)


# --- the compiled functions -----------------------------------------------------------------------


@functools.partial(eqx.filter_jit, donate="all-except-first")
def prefill(
    model: LlamaLMHeadModel,
    state: DecodeState,
    prompts: jax.Array,  # [P, T] right-padded
    prompt_len: jax.Array,  # [P]
    slots: jax.Array,  # [M] target slot of each row (>= C: padding, dropped)
    source: jax.Array,  # [M] the prompt each row samples
    end: jax.Array,  # [M]
    temperature: jax.Array,  # [M]
    stops: jax.Array,  # [M, max_stop_tokens]
    seed: jax.Array,  # [M] uint32
    fold: jax.Array,  # [M] int32, < 0: none
    sample: jax.Array,  # [M] int32
) -> DecodeState:
    """Prefill ``prompts`` once each, copy their keys and values into the rows' slots, and draw
    each row's first token."""
    n_prompts, width = prompts.shape
    ids = hax.named(prompts, ("batch", "position"))
    pos = hax.named(jnp.broadcast_to(jnp.arange(width), prompts.shape), ("batch", "position"))
    causal = jnp.arange(width)[:, None] >= jnp.arange(width)[None, :]
    visible = jnp.broadcast_to(causal, (n_prompts, width, width))
    layers = jnp.arange(model.config.num_layers)

    def layer_fn(carry: Any, layer: Any, index: jax.Array) -> Any:
        x, k_cache, v_cache = carry
        q, k, v = _qkv(layer, x, pos)
        k_cache = k_cache.at[index, slots, :, :width].set(
            k[source].astype(k_cache.dtype), mode="drop"
        )
        v_cache = v_cache.at[index, slots, :, :width].set(
            v[source].astype(v_cache.dtype), mode="drop"
        )
        x = _finish_layer(layer, x, _attend(layer, q, k, v, visible))
        return x, k_cache, v_cache

    x = model.embeddings.embed(ids)
    x, k_cache, v_cache = hax.fold(layer_fn, "layer")(
        (x, state.k, state.v), model.transformer.layers.stacked, layers
    )
    hidden = model.transformer.norm(x).rearrange(("batch", "position", "embed")).array
    last = hidden[jnp.arange(n_prompts), prompt_len - 1]  # [P, embed]
    logits = _logits(last[source], _lm_head(model), temperature)

    def row_key(seed, fold, sample):  # type: ignore[no-untyped-def]
        key = jax.random.PRNGKey(seed)
        key = jnp.where(fold >= 0, jax.random.fold_in(key, fold), key)
        return jax.random.fold_in(key, sample)

    keys = jax.vmap(row_key)(seed, fold, sample)
    token, logprob = draw_tokens(logits, keys, jnp.zeros_like(sample), temperature)
    length = prompt_len[source] + 1
    rows = jnp.zeros((slots.shape[0], state.tokens.shape[1]), jnp.int32)
    rows = rows.at[:, :width].set(prompts[source])
    rows = rows.at[jnp.arange(slots.shape[0]), length - 1].set(token)
    lps = jnp.zeros(rows.shape, jnp.float32).at[jnp.arange(slots.shape[0]), length - 1].set(logprob)
    done = _stopped(token, stops) | (length >= end)

    def put(array: jax.Array, values: jax.Array) -> jax.Array:
        return array.at[slots].set(values.astype(array.dtype), mode="drop")

    return DecodeState(
        k=k_cache,
        v=v_cache,
        tokens=put(state.tokens, rows),
        logprobs=put(state.logprobs, lps),
        length=put(state.length, length),
        end=put(state.end, end),
        prompt_len=put(state.prompt_len, prompt_len[source]),
        done=put(state.done, done),
        temperature=put(state.temperature, temperature),
        stops=put(state.stops, stops),
        keys=put(state.keys, keys),
    )


@functools.partial(eqx.filter_jit, donate="all-except-first")
def decode_round(
    model: LlamaLMHeadModel,
    state: DecodeState,
    max_steps: jax.Array,
    *,
    rows: int,
    window: int,
) -> tuple[DecodeState, jax.Array, jax.Array]:
    """Up to ``max_steps`` decode steps of the first ``rows`` slots, attending over the first
    ``window`` positions, until every row is done. Returns the state and the rows' ``done`` and
    ``length`` (what the host reads back). The caches are updated in place; only the slots'
    small arrays are sliced to ``rows``."""
    head = _lm_head(model)
    layers = jnp.arange(model.config.num_layers)
    index = jnp.arange(rows)
    small = {
        name: getattr(state, name)[:rows]
        for name in ("tokens", "logprobs", "length", "end", "prompt_len", "done")
    }
    temperature, stops, keys = state.temperature[:rows], state.stops[:rows], state.keys[:rows]
    key_pos = jnp.arange(window)
    width = state.tokens.shape[1]

    def step(carry: tuple[Any, ...]) -> tuple[Any, ...]:
        i, k_cache, v_cache, s = carry
        at = jnp.clip(s["length"] - 1, 0, width - 1)  # the position fed this step
        ids = hax.named(s["tokens"][index, at][:, None], ("batch", "position"))
        pos = hax.named(at[:, None], ("batch", "position"))
        visible = (key_pos[None, :] <= at[:, None])[:, None, :]  # [rows, 1, window]

        def layer_fn(carry: Any, layer: Any, li: jax.Array) -> Any:
            x, k_cache, v_cache = carry
            q, k, v = _qkv(layer, x, pos)
            k_cache = k_cache.at[li, index, :, at].set(k[:, :, 0].astype(k_cache.dtype))
            v_cache = v_cache.at[li, index, :, at].set(v[:, :, 0].astype(v_cache.dtype))
            shape = (1, rows, k_cache.shape[2], window, k_cache.shape[4])
            keys = jax.lax.dynamic_slice(k_cache, (li, 0, 0, 0, 0), shape)[0]
            values = jax.lax.dynamic_slice(v_cache, (li, 0, 0, 0, 0), shape)[0]
            x = _finish_layer(layer, x, _attend(layer, q, keys, values, visible))
            return x, k_cache, v_cache

        x = model.embeddings.embed(ids)
        x, k_cache, v_cache = hax.fold(layer_fn, "layer")(
            (x, k_cache, v_cache), model.transformer.layers.stacked, layers
        )
        hidden = model.transformer.norm(x).rearrange(("batch", "position", "embed")).array[:, 0]
        logits = _logits(hidden, head, temperature)
        token, logprob = draw_tokens(logits, keys, s["length"] - s["prompt_len"], temperature)
        live = ~s["done"]
        write = jnp.clip(s["length"], 0, width - 1)
        tokens = s["tokens"].at[index, write].set(jnp.where(live, token, s["tokens"][index, write]))
        logprobs = (
            s["logprobs"]
            .at[index, write]
            .set(jnp.where(live, logprob, s["logprobs"][index, write]))
        )
        length = s["length"] + live
        done = s["done"] | (live & (_stopped(token, stops) | (length >= s["end"])))
        s = {**s, "tokens": tokens, "logprobs": logprobs, "length": length, "done": done}
        return i + 1, k_cache, v_cache, s

    def more(carry: tuple[Any, ...]) -> jax.Array:
        return (carry[0] < max_steps) & ~jnp.all(carry[3]["done"])

    init = (jnp.zeros((), jnp.int32), state.k, state.v, small)
    _, k_cache, v_cache, small = jax.lax.while_loop(more, step, init)
    state = dataclasses.replace(
        state,
        k=k_cache,
        v=v_cache,
        **{name: getattr(state, name).at[:rows].set(value) for name, value in small.items()},
    )
    return state, small["done"], small["length"]
