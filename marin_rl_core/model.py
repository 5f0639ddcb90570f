"""The policy model: a levanter Llama built from :class:`~marin_rl_core.config.ModelConfig`, Hugging
Face checkpoint load/save, and the per-token logprobs the trainer optimises.

Alignment convention (shared with :mod:`marin_rl_core.training_batch`): for token ids
``x[0..T-1]`` the value at position ``t`` belongs to the prediction made *at* ``t`` of the *next*
token ``x[t+1]``, so ``next_token_logprobs(...)[t] = log p(x[t+1] | x[0..t])`` and the last
position holds 0.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import equinox as eqx
import haliax as hax
import haliax.nn as hnn
import jax
import jax.numpy as jnp
import numpy as np
from haliax import Axis, NamedArray
from levanter.layers.attention import AttentionMask
from levanter.models.llama import LlamaConfig, LlamaLMHeadModel
from levanter.models.lm_model import LmHeadModel

from marin_rl_core.config import ModelConfig
from marin_rl_core.tokenizer import Tokenizer, load_tokenizer

VOCAB = "vocab"
POS = "position"
BATCH = "batch"


def llama_config(config: ModelConfig) -> LlamaConfig:
    """The levanter ``LlamaConfig`` of a fresh model of ``config``'s shape."""
    if config.hidden_dim % config.num_heads:
        raise ValueError(
            f"model.hidden_dim ({config.hidden_dim}) must be a multiple of model.num_heads "
            f"({config.num_heads})"
        )
    return LlamaConfig(
        seq_len=config.max_seq_len,
        hidden_dim=config.hidden_dim,
        intermediate_dim=config.intermediate_dim,
        num_layers=config.num_layers,
        num_heads=config.num_heads,
        num_kv_heads=config.num_kv_heads,
        # Tiny models: recomputation costs more than the activations it saves.
        gradient_checkpointing=False,
        scan_layers=True,
    )


def build_model(
    config: ModelConfig, tokenizer: Tokenizer | None = None, *, key: jax.Array
) -> LmHeadModel:
    """The initial policy: loaded from ``config.checkpoint`` when set, else initialised from ``key``.

    Args:
        config: the model section of the run config.
        tokenizer: sizes the vocabulary; defaults to ``load_tokenizer(config.tokenizer)``.
        key: PRNG key for a fresh model (unused when loading a checkpoint).
    """
    tokenizer = tokenizer if tokenizer is not None else load_tokenizer(config.tokenizer)
    if config.checkpoint:
        return load_hf_checkpoint(config.checkpoint, tokenizer=tokenizer)
    vocab = Axis(VOCAB, tokenizer.vocab_size)
    # One compiled init instead of hundreds of small eager ops (seconds on a busy CPU).
    return eqx.filter_jit(LlamaLMHeadModel.init)(vocab, llama_config(config), key=key)


# Hugging Face model_type -> levanter config class (all decode with the paged KV cache that
# the InferenceEngine needs). Listed explicitly: asking each levanter config for its converter
# would reach for its reference checkpoint on the Hub.
_LEVANTER_CONFIGS = {
    "llama": ("levanter.models.llama", "LlamaConfig"),
    "mistral": ("levanter.models.mistral", "MistralConfig"),
    "qwen2": ("levanter.models.qwen", "QwenConfig"),
    "qwen3": ("levanter.models.qwen", "Qwen3Config"),
}


def _lev_config_class_for(model_type: str) -> type:
    """The levanter config class whose Hugging Face counterpart has ``model_type``."""
    import importlib

    if model_type not in _LEVANTER_CONFIGS:
        raise ValueError(
            f"checkpoint model_type {model_type!r} is not supported; supported: "
            f"{', '.join(sorted(_LEVANTER_CONFIGS))}"
        )
    module, name = _LEVANTER_CONFIGS[model_type]
    return getattr(importlib.import_module(module), name)


def _checkpoint_mesh() -> Any:
    """A one-axis ("data") mesh over the local devices: levanter's checkpoint code places and
    gathers arrays with sharding constraints that need a mesh in context."""
    mesh = jax.sharding.Mesh(np.array(jax.devices()), (hax.partitioning.ResourceAxis.DATA,))
    return hax.partitioning.set_mesh(mesh)


def load_hf_checkpoint(
    path: str | Path, *, tokenizer: Tokenizer | None = None, dtype: Any = jnp.float32
) -> LmHeadModel:
    """Load a local Hugging Face checkpoint directory (``config.json`` + safetensors) with
    levanter's ``HFCheckpointConverter``.

    Args:
        path: the checkpoint directory. Nothing is downloaded.
        tokenizer: sizes the vocabulary (the model is resized to it when the checkpoint's
            differs); defaults to the tokenizer saved in ``path``.
        dtype: parameter dtype.

    Raises:
        ValueError: when ``path`` is not a checkpoint directory or its architecture is unknown.
    """
    from levanter.compat.hf_checkpoints import HFCheckpointConverter
    from transformers import AutoConfig

    path = Path(path).expanduser()
    if not (path / "config.json").is_file():
        raise ValueError(
            f"model.checkpoint {str(path)!r} is not a Hugging Face checkpoint directory "
            "(no config.json); give a local directory written by `save_pretrained`."
        )
    if tokenizer is None:
        tokenizer = load_tokenizer(str(path))
    model_type = json.loads((path / "config.json").read_text()).get("model_type", "")
    lev_config_cls = _lev_config_class_for(model_type)
    hf_config_cls = type(AutoConfig.for_model(model_type))
    converter = HFCheckpointConverter(
        lev_config_cls,
        reference_checkpoint=str(path),
        HfConfigClass=hf_config_cls,
        tokenizer=tokenizer.to_hf(),
    )
    lev_config = converter.config_from_hf_checkpoint(str(path))
    if hasattr(lev_config, "gradient_checkpointing"):
        lev_config = dataclasses.replace(lev_config, gradient_checkpointing=False)
    with _checkpoint_mesh():
        return converter.load_pretrained(
            lev_config.model_type, ref=str(path), config=lev_config, dtype=dtype
        )


def save_hf_checkpoint(model: LmHeadModel, path: str | Path, *, tokenizer: Tokenizer) -> None:
    """Write ``model`` as a Hugging Face checkpoint directory (config, safetensors, tokenizer)
    with levanter's ``HFCheckpointConverter``; :func:`load_hf_checkpoint` reads it back."""
    from levanter.compat.hf_checkpoints import HFCheckpointConverter

    path = Path(path).expanduser()
    path.mkdir(parents=True, exist_ok=True)
    hf_config = model.config.to_hf_config(model.Vocab.size)
    # The converter copies `architectures` from a reference checkpoint's config; the directory's
    # own config (written first) is that reference, so nothing is fetched from the Hub.
    hf_config.architectures = ["LlamaForCausalLM"]
    hf_config.save_pretrained(str(path))
    converter = HFCheckpointConverter(
        type(model.config),
        reference_checkpoint=str(path),
        HfConfigClass=type(hf_config),
        tokenizer=tokenizer.to_hf(),
    )
    with _checkpoint_mesh():
        converter.save_pretrained(model, str(path), save_reference_code=False, save_tokenizer=True)


# --- logprobs ------------------------------------------------------------------------------------


def next_token_logprobs_and_entropy(
    model: LmHeadModel,
    input_ids: NamedArray,
    *,
    temperature: float | NamedArray = 1.0,
    key: jax.Array | None = None,
) -> tuple[NamedArray, NamedArray]:
    """Per-position logprob of the next token and entropy of the next-token distribution.

    Args:
        model: the policy.
        input_ids: int ``[..., position]``, right-padded (padding never influences earlier
            positions under the causal mask).
        temperature: the logits are divided by it, matching the sampler's logprobs at that
            temperature (0 means greedy and is treated as 1, as levanter's sampler does). A
            scalar or a named array over the batch axes of ``input_ids``.
        key: dropout key (unused by Llama).

    Returns:
        ``(logprobs, entropy)``, both float32 ``[..., position]``: ``logprobs[t] = log p(x[t+1] |
        x[..t])`` and ``entropy[t]`` the entropy of ``p(. | x[..t])``; the last position is 0.
    """
    pos = input_ids.resolve_axis(POS)
    logits = model(input_ids, attn_mask=AttentionMask.causal(), key=key).astype(jnp.float32)
    if isinstance(temperature, NamedArray):
        safe_t = hax.where(temperature == 0, 1.0, temperature).astype(jnp.float32)
    else:
        safe_t = 1.0 if temperature == 0 else float(temperature)
    log_probs = hnn.log_softmax(logits / safe_t, axis=model.Vocab)
    targets = hax.roll(input_ids, -1, pos)
    token_logprobs = hax.take(log_probs, model.Vocab, targets)
    entropy = -hax.sum(hax.exp(log_probs) * log_probs, axis=model.Vocab)
    not_last = hax.arange(pos) < pos.size - 1
    return hax.where(not_last, token_logprobs, 0.0), hax.where(not_last, entropy, 0.0)


def next_token_logprobs(
    model: LmHeadModel,
    input_ids: NamedArray,
    *,
    temperature: float | NamedArray = 1.0,
    key: jax.Array | None = None,
) -> NamedArray:
    """``log p(x[t+1] | x[..t])`` at each position ``t`` (0 at the last); see
    :func:`next_token_logprobs_and_entropy`."""
    return next_token_logprobs_and_entropy(model, input_ids, temperature=temperature, key=key)[0]


@eqx.filter_jit
def _batch_logprobs(model: LmHeadModel, input_ids: NamedArray, temperature: float) -> NamedArray:
    return next_token_logprobs(model, input_ids, temperature=temperature)


def response_logprobs(
    model: LmHeadModel,
    prompts: Sequence[Sequence[int] | np.ndarray],
    responses: Sequence[Sequence[int] | np.ndarray],
    *,
    max_seq_len: int,
    pad_id: int = 0,
    temperature: float = 1.0,
) -> list[np.ndarray]:
    """The logprob of each response token given its prompt and the response before it, for a
    batch of (prompt, response) pairs: what the sampler reported when it drew them from ``model``.

    Sequences longer than ``max_seq_len`` lose their response's tail; the returned arrays then
    cover only the kept tokens.
    """
    from marin_rl_core.training_batch import pack_sequences

    packed = pack_sequences(prompts, responses, max_seq_len=max_seq_len, pad_id=pad_id)
    ids = hax.named(jnp.asarray(packed.input_ids), (BATCH, POS))
    logprobs = np.asarray(_batch_logprobs(model, ids, temperature).array)
    out = []
    for row, (start, length) in enumerate(zip(packed.response_starts, packed.response_lengths)):
        # Response token j sits at position start + j and is predicted at start + j - 1.
        out.append(logprobs[row, start - 1 : start - 1 + length].astype(np.float32))
    return out


__all__ = [
    "build_model",
    "llama_config",
    "load_hf_checkpoint",
    "next_token_logprobs",
    "next_token_logprobs_and_entropy",
    "response_logprobs",
    "save_hf_checkpoint",
]
