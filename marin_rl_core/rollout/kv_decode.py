"""The ``kv`` engine's compiled half: the model's forward pass over a KV cache in slots, prefill,
decode rounds and token sampling (the host loop that drives them is
:mod:`marin_rl_core.rollout.kv_engine`).

The forward pass is levanter's Llama decoder layer (its modules: norms, projections, rotary
embeddings, q/k norms, the MLP's activation) with the matmuls and the attention over the cache
written here: keys are kept transposed (``[layer, slot, kv_head, head_size, position]``) and
values as ``[layer, slot, kv_head, position, head_size]``, the layouts attention multiplies
without copies, and a decode step attends over the first ``window`` positions only.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Sequence
from typing import Any

import equinox as eqx
import haliax as hax
import jax
import jax.numpy as jnp
from levanter.lora import LoraLinear
from levanter.models.llama import LlamaLMHeadModel
from levanter.models.lm_model import LmHeadModel

from marin_rl_core.rollout.inference import row_keys
from marin_rl_core.rollout.next_token import draw_next_tokens


class DecodeState(eqx.Module):
    """Every slot's state on the device (``C`` slots of ``S`` positions)."""

    k: tuple[jax.Array, ...]  # per layer [C, kv_head, head_size, S]: transposed, as read
    v: tuple[jax.Array, ...]  # per layer [C, kv_head, S, head_size]
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
#
# Activations are plain arrays ``[batch, position, ...]``; levanter's modules do the elementwise
# work (norms, rotary embeddings, the MLP's activation) on named views of them, and every matmul
# is an einsum against the weight in the layout levanter stores it (``[out..., in...]``), reshaped
# to 2-D: no weight is transposed or copied per step (XLA's CPU backend copied each projection's
# weight on every call when haliax multiplied by its multi-axis form).


def _axes(spec: Any) -> tuple[Any, ...]:
    return tuple(spec) if isinstance(spec, Sequence) else (spec,)


def _out(linear: Any) -> tuple[Any, ...]:
    """The output axes of a linear layer (a LoRA layer's: its frozen layer's)."""
    return _axes((linear.wrapped if isinstance(linear, LoraLinear) else linear).Out)


def _project(linear: Any, x: jax.Array) -> jax.Array:
    """``linear(x)`` for ``x [..., in]``: returns ``[..., *out]`` (the module's ``Out`` axes).
    A LoRA layer (levanter's ``LoraLinear``: a colocated LoRA job's sampler) adds its adapter's
    ``scale * B (A x)`` to the frozen layer's output, as the trainer computes it."""
    if isinstance(linear, LoraLinear):
        low = linear.lora
        y = _project(linear.wrapped, x)
        delta = _project(low.lora_B, _project(low.lora_A, x).reshape(*x.shape[:-1], -1))
        return y + (delta * low.scale).astype(y.dtype)
    out_axes, in_axes = _axes(linear.Out), _axes(linear.In)
    weight = (linear.weight * linear.reparam.active_scale).rearrange((*out_axes, *in_axes)).array
    weight = weight.reshape(math.prod(a.size for a in out_axes), -1)
    y = jnp.einsum("ni,oi->no", x.reshape(-1, weight.shape[1]), weight)
    if linear.bias is not None:
        y = y + linear.bias.rearrange(out_axes).array.reshape(-1)
    return y.reshape(*x.shape[:-1], *(a.size for a in out_axes))


def _named(x: jax.Array, *names: str) -> hax.NamedArray:
    return hax.named(x, ("batch", "position", *names))


def _qkv(layer: Any, x: jax.Array, pos: hax.NamedArray) -> tuple[jax.Array, ...]:
    """Queries ``[batch, kv_head, group, position, head_size]``, keys transposed ``[batch,
    kv_head, head_size, position]`` and values ``[batch, kv_head, position, head_size]`` of one
    layer, normed and rotated as levanter's ``Attention`` does."""
    attn = layer.self_attn
    h = layer.input_layernorm(_named(x, "embed")).array
    q = _named(_project(attn.q_proj, h), *(a.name for a in _out(attn.q_proj)))
    k = _named(_project(attn.k_proj, h), *(a.name for a in _out(attn.k_proj)))
    v = _named(_project(attn.v_proj, h), *(a.name for a in _out(attn.v_proj)))
    if attn.config.qk_norm is not None:
        q, k = attn.q_norm(q), attn.k_norm(k)
    if attn.rot_embs is not None:
        q = attn.rot_embs(q, pos).astype(q.dtype)
        k = attn.rot_embs(k, pos).astype(k.dtype)
    return (
        q.rearrange(("batch", "kv_head", "q_heads_per_group", "position", "head_size")).array,
        k.rearrange(("batch", "kv_head", "head_size", "position")).array,
        v.rearrange(("batch", "kv_head", "position", "head_size")).array,
    )


def attend(
    config: Any, q: jax.Array, keys_t: jax.Array, values: jax.Array, visible: jax.Array
) -> jax.Array:
    """Attention of ``q [b, kv_head, group, t, d]`` over ``keys_t [b, kv_head, d, s]`` and
    ``values [b, kv_head, s, d]`` where ``visible [b, t, s]``, softmax in float32; returns
    ``[b, t, heads * d]`` (heads ordered kv-head-major, as levanter flattens them). ``config``
    is the layer's attention config (its ``head_size``, ``scaling_factor``, ``logits_soft_cap``).

    Two einsums on these layouts, not ``jax.nn.dot_product_attention``: measured side by side
    by ``bench/attention.py`` (docs/plugins.md#kv)."""
    b, k, g, t, d = q.shape
    scale = config.scaling_factor or 1.0 / math.sqrt(config.head_size)
    scores = jnp.matmul(q.reshape(b, k, g * t, d), keys_t, preferred_element_type=jnp.float32)
    scores = scores.reshape(b, k, g, t, -1) * jnp.float32(scale)
    if config.logits_soft_cap is not None:
        scores = config.logits_soft_cap * jnp.tanh(scores / config.logits_soft_cap)
    scores = jnp.where(visible[:, None, None], scores, jnp.finfo(jnp.float32).min)
    weights = jax.nn.softmax(scores, axis=-1).astype(values.dtype)
    out = jnp.matmul(weights.reshape(b, k, g * t, -1), values).reshape(b, k, g, t, d)
    return out.transpose(0, 3, 1, 2, 4).reshape(b, t, k * g * d)


def _finish_layer(layer: Any, x: jax.Array, attended: jax.Array) -> jax.Array:
    """The rest of a decoder layer after attention: output projection, residuals, the MLP."""
    out = _project(layer.self_attn.o_proj, attended.astype(x.dtype))
    if getattr(layer, "post_attn_layernorm", None) is not None:
        out = layer.post_attn_layernorm(_named(out, "embed")).array
    x = x + out
    mlp = layer.mlp
    h = layer.post_attention_layernorm(_named(x, "embed")).array
    gate = mlp.act(_named(_project(mlp.gate_proj, h), "mlp")).array
    out = _project(mlp.down_proj, gate * _project(mlp.up_proj, h))
    if getattr(layer, "post_mlp_layernorm", None) is not None:
        out = layer.post_mlp_layernorm(_named(out, "embed")).array
    return x + out


def _embed(model: LlamaLMHeadModel, ids: jax.Array) -> jax.Array:
    return (
        model.embeddings.embed(hax.named(ids, ("batch", "position")))
        .rearrange(("batch", "position", "embed"))
        .array
    )


def _layers(model: LlamaLMHeadModel) -> list[Any]:
    """Each decoder layer of the stacked ones, sliced statically: the layer loop is unrolled, so
    that every layer multiplies by its own weights and updates its own cache in place. A scan
    over the stack copied each layer's weights and cache window out of it on every step (on
    XLA's CPU backend), and so does a slice inside the decode loop: :func:`decode_round` slices
    before its loop, one copy of the decoder's weights per round (the engine's memory budget
    leaves room for it)."""
    stacked = model.transformer.layers.stacked
    return [
        hax.tree_util.tree_map(
            lambda p, i=i: p["layer", i] if isinstance(p, hax.NamedArray) else p, stacked
        )  # (a LoRA adapter's dropout holds a bool)
        for i in range(model.config.num_layers)
    ]


def _final_norm(model: LlamaLMHeadModel, x: jax.Array) -> jax.Array:
    return model.transformer.norm(_named(x, "embed")).array


def _lm_head(model: LlamaLMHeadModel) -> jax.Array:
    """The LM head as ``[vocab, embed]``: how levanter stores it (tied or not), and the layout
    a CPU multiplies fastest (no transpose of a vocabulary-sized matrix)."""
    return model.get_lm_head().rearrange((model.Vocab, model.Embed)).array


def _logits(hidden: jax.Array, head: jax.Array) -> jax.Array:
    """The float32 logits of ``hidden [rows, embed]``: the trainer's projection
    (:func:`~marin_rl_core.models.logprobs.tempered_logits`) with the head in ``[vocab, embed]``
    layout."""
    return jnp.einsum("be,ve->bv", hidden, head, preferred_element_type=jnp.float32).astype(
        jnp.float32
    )


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
    pos = hax.named(jnp.broadcast_to(jnp.arange(width), prompts.shape), ("batch", "position"))
    causal = jnp.arange(width)[:, None] >= jnp.arange(width)[None, :]
    visible = jnp.broadcast_to(causal, (n_prompts, width, width))
    x = _embed(model, prompts)
    k_caches, v_caches = [], []
    for layer, k_cache, v_cache in zip(_layers(model), state.k, state.v):
        q, k, v = _qkv(layer, x, pos)
        k_caches.append(
            k_cache.at[slots, :, :, :width].set(k[source].astype(k_cache.dtype), mode="drop")
        )
        v_caches.append(
            v_cache.at[slots, :, :width].set(v[source].astype(v_cache.dtype), mode="drop")
        )
        x = _finish_layer(layer, x, attend(layer.self_attn.config, q, k, v, visible))
    hidden = _final_norm(model, x)
    last = hidden[jnp.arange(n_prompts), prompt_len - 1]  # [P, embed]
    logits = _logits(last[source], _lm_head(model))

    keys = row_keys(seed, fold, sample)
    token, logprob = draw_next_tokens(logits, keys, jnp.zeros_like(sample), temperature)
    length = prompt_len[source] + 1
    rows = jnp.zeros((slots.shape[0], state.tokens.shape[1]), jnp.int32)
    rows = rows.at[:, :width].set(prompts[source])
    rows = rows.at[jnp.arange(slots.shape[0]), length - 1].set(token)
    lps = jnp.zeros(rows.shape, jnp.float32).at[jnp.arange(slots.shape[0]), length - 1].set(logprob)
    done = _stopped(token, stops) | (length >= end)

    def put(array: jax.Array, values: jax.Array) -> jax.Array:
        return array.at[slots].set(values.astype(array.dtype), mode="drop")

    return DecodeState(
        k=tuple(k_caches),
        v=tuple(v_caches),
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
def refill(
    model: LlamaLMHeadModel, state: DecodeState, slots: jax.Array, *, width: int
) -> DecodeState:
    """Recompute the keys and values of the first ``width`` positions of ``slots`` (``>= C``:
    padding, dropped) with ``model``: rows in flight continue on new weights as if those had
    sampled their tokens so far (positions past a row's cached ones get values its next decode
    steps overwrite before they are visible)."""
    ids = state.tokens[jnp.clip(slots, 0, state.tokens.shape[0] - 1), :width]
    pos = hax.named(jnp.broadcast_to(jnp.arange(width), ids.shape), ("batch", "position"))
    causal = jnp.arange(width)[:, None] >= jnp.arange(width)[None, :]
    visible = jnp.broadcast_to(causal, (ids.shape[0], width, width))
    x = _embed(model, ids)
    k_caches, v_caches = [], []
    for layer, k_cache, v_cache in zip(_layers(model), state.k, state.v):
        q, k, v = _qkv(layer, x, pos)
        k_caches.append(k_cache.at[slots, :, :, :width].set(k.astype(k_cache.dtype), mode="drop"))
        v_caches.append(v_cache.at[slots, :, :width].set(v.astype(v_cache.dtype), mode="drop"))
        x = _finish_layer(layer, x, attend(layer.self_attn.config, q, k, v, visible))
    return dataclasses.replace(state, k=tuple(k_caches), v=tuple(v_caches))


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
    layers = _layers(model)  # sliced once per round, outside the loop (see _layers)
    index = jnp.arange(rows)
    small = {
        name: getattr(state, name)[:rows]
        for name in ("tokens", "logprobs", "length", "end", "prompt_len", "done")
    }
    temperature, stops, keys = state.temperature[:rows], state.stops[:rows], state.keys[:rows]
    key_pos = jnp.arange(window)
    width = state.tokens.shape[1]

    def step(carry: tuple[Any, ...]) -> tuple[Any, ...]:
        i, k_caches, v_caches, s = carry
        at = jnp.clip(s["length"] - 1, 0, width - 1)  # the position fed this step
        pos = hax.named(at[:, None], ("batch", "position"))
        visible = (key_pos[None, :] <= at[:, None])[:, None, :]  # [rows, 1, window]

        x = _embed(model, s["tokens"][index, at][:, None])
        k_caches, v_caches = list(k_caches), list(v_caches)
        for li, layer in enumerate(layers):
            q, k, v = _qkv(layer, x, pos)
            k_cache = k_caches[li].at[index, :, :, at].set(k[..., 0].astype(k_caches[li].dtype))
            v_cache = v_caches[li].at[index, :, at].set(v[:, :, 0].astype(v_caches[li].dtype))
            k_caches[li], v_caches[li] = k_cache, v_cache
            keys_t, values = k_cache[:rows, :, :, :window], v_cache[:rows, :, :window]
            x = _finish_layer(layer, x, attend(layer.self_attn.config, q, keys_t, values, visible))
        k_caches, v_caches = tuple(k_caches), tuple(v_caches)
        hidden = _final_norm(model, x)[:, 0]
        logits = _logits(hidden, head)
        step = s["length"] - s["prompt_len"]
        token, logprob = draw_next_tokens(logits, keys, step, temperature)
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
        return i + 1, k_caches, v_caches, s

    def more(carry: tuple[Any, ...]) -> jax.Array:
        return (carry[0] < max_steps) & ~jnp.all(carry[3]["done"])

    init = (jnp.zeros((), jnp.int32), state.k, state.v, small)
    _, k_caches, v_caches, small = jax.lax.while_loop(more, step, init)
    state = dataclasses.replace(
        state,
        k=k_caches,
        v=v_caches,
        **{name: getattr(state, name).at[:rows].set(value) for name, value in small.items()},
    )
    return state, small["done"], small["length"]
