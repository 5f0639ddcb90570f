"""The policy model: a levanter Llama built from :class:`~marin_rl_core.config.ModelConfig` (or a
Hugging Face architecture levanter has), the run's initial policy, and Hugging Face checkpoint
load/save. Log-probabilities are in :mod:`marin_rl_core.models.logprobs`.
"""

from __future__ import annotations

import dataclasses
import logging
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any

import equinox as eqx
import haliax as hax
import haliax.nn as hnn
import jax
import jax.numpy as jnp
import numpy as np
from haliax import Axis
from levanter.models.llama import LlamaConfig, LlamaEmbedding, LlamaLMHeadModel, LlamaTransformer
from levanter.models.lm_model import LmHeadModel
from levanter.models.qwen import QwenConfig

from marin_rl_core.models.packing import VOCAB
from marin_rl_core.models.tokenizer import Tokenizer, load_tokenizer, model_tokenizer

if TYPE_CHECKING:
    from marin_rl_core.config.schema import ModelConfig, RLJobConfig


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
        gradient_checkpointing=config.resolved_gradient_checkpointing,
        scan_layers=True,
    )


def build_model(
    config: ModelConfig,
    tokenizer: Tokenizer | None = None,
    *,
    key: jax.Array,
    dtype: Any = jnp.float32,
) -> LmHeadModel:
    """The initial policy: loaded from ``config.checkpoint`` when set, else initialised from ``key``.

    Args:
        config: the model section of the run config.
        tokenizer: sizes a fresh model's vocabulary and is checked against a checkpoint's;
            defaults to :func:`~marin_rl_core.models.tokenizer.model_tokenizer` of ``config``.
        key: PRNG key for a fresh model (unused when loading a checkpoint).
        dtype: the parameters' dtype. A checkpoint is read straight into it (a rollout worker
            sampling in bfloat16 never holds a float32 copy); a fresh model is initialised in
            float32 and cast, so that every dtype starts from the same weights.
    """
    tokenizer = tokenizer if tokenizer is not None else model_tokenizer(config)
    if config.checkpoint:
        from marin_rl_core.models.pretrained import check_vocab

        check_vocab(config, tokenizer)
        return load_hf_checkpoint(
            config.checkpoint,
            tokenizer=tokenizer,
            resize_vocab=config.resize_vocab,
            dtype=dtype,
            gradient_checkpointing=config.resolved_gradient_checkpointing,
        )
    vocab = Axis(VOCAB, tokenizer.vocab_size)
    # One compiled init instead of hundreds of small eager ops (seconds on a busy CPU).
    model = eqx.filter_jit(LlamaLMHeadModel.init)(vocab, llama_config(config), key=key)
    return model if jnp.dtype(dtype) == jnp.float32 else cast_floating(model, dtype)


@dataclasses.dataclass(frozen=True)
class Qwen2DecodingConfig(QwenConfig):
    """levanter's Qwen2 config, built on its Llama model classes.

    levanter's own ``QwenLMHeadModel`` has no ``decode``/``initial_cache``, so its
    ``InferenceEngine`` cannot sample from it. Qwen2 is Llama with biased q/k/v projections,
    which ``QwenConfig.attention_config`` already asks for, so :class:`Qwen2LMHeadModel` reuses
    ``LlamaLMHeadModel`` (decoding included) with this config. The parameter names and the
    Hugging Face state-dict layout are the same as Qwen2's.
    """

    @property
    def model_type(self) -> type[Qwen2LMHeadModel]:  # type: ignore[override]
        return Qwen2LMHeadModel

    @classmethod
    def from_hf_config(cls, hf_config: Any) -> Qwen2DecodingConfig:
        base = QwenConfig.from_hf_config(hf_config)
        return cls(**{f.name: getattr(base, f.name) for f in dataclasses.fields(base)})


class Qwen2LMHeadModel(LlamaLMHeadModel):
    """A Qwen2 model (see :class:`Qwen2DecodingConfig`)."""

    @classmethod
    def init(cls, Vocab: Axis, config: Qwen2DecodingConfig, *, key: jax.Array) -> Qwen2LMHeadModel:  # type: ignore[override]
        k_t, k_emb = jax.random.split(key, 2)
        transformer = LlamaTransformer.init(config, key=k_t)
        embeddings = LlamaEmbedding.init(Vocab, config, key=k_emb)
        lm_head = (
            None
            if config.tie_word_embeddings
            else hnn.Linear.init(
                In=config.Embed, Out=Vocab, key=k_emb, use_bias=False, out_first=True
            )
        )
        return Qwen2LMHeadModel(transformer, embeddings, lm_head)


def _lev_config_class_for(model_type: str) -> type:
    """The levanter config class whose Hugging Face counterpart has ``model_type``."""
    import importlib

    # Listed explicitly: asking each levanter config for its converter would reach for its
    # reference checkpoint on the Hub.
    levanter_configs = {
        "llama": ("levanter.models.llama", "LlamaConfig"),
        "qwen2": ("marin_rl_core.models.build", "Qwen2DecodingConfig"),
        "qwen3": ("levanter.models.qwen", "Qwen3Config"),
    }
    if model_type not in levanter_configs:
        raise ValueError(
            f"checkpoint model_type {model_type!r} is not supported; supported: "
            f"{', '.join(sorted(levanter_configs))}"
        )
    module, name = levanter_configs[model_type]
    return getattr(importlib.import_module(module), name)


def initial_model(config: RLJobConfig, tokenizer: Any, *, dtype: Any = "float32") -> Any:
    """The run's initial policy, its parameters in ``dtype``; every process that calls this
    gets identical weights (in that dtype)."""
    return build_model(config.model, tokenizer, key=jax.random.PRNGKey(config.seed), dtype=dtype)


def cast_floating(tree: Any, dtype: Any) -> Any:
    """``tree`` with its floating-point arrays in ``dtype`` (others, and arrays already in it,
    unchanged)."""
    dtype = jnp.dtype(dtype)

    def cast(x: Any) -> Any:
        if isinstance(x, jax.Array | np.ndarray) and jnp.issubdtype(x.dtype, jnp.floating):
            return x if x.dtype == dtype else jnp.asarray(x, dtype=dtype)
        return x

    return jax.tree.map(cast, tree)


def publish_copy(tree: Any, dtype: Any) -> Any:
    """A copy of ``tree`` with its floating-point arrays in ``dtype``, in buffers of its own:
    nothing done to ``tree`` afterwards (a train step donating it) changes or frees the copy.
    Dispatched asynchronously: it returns at once, the copies are made on the device while
    the caller goes on (what the trainer hands its weight server)."""
    dtype = jnp.dtype(dtype)

    def copy(x: Any) -> Any:
        if not isinstance(x, jax.Array):
            return x
        if jnp.issubdtype(x.dtype, jnp.floating) and x.dtype != dtype:
            return x.astype(dtype)  # a new buffer
        return jax.device_put(x, x.sharding, may_alias=False)

    return jax.tree.map(copy, tree)


def local_data_mesh() -> Any:
    """A one-axis ("data") mesh over this process's devices: what a replicated copy of a model
    (a checkpoint read outside the trainer's mesh) is placed on."""
    return jax.sharding.Mesh(np.array(jax.devices()), (hax.partitioning.ResourceAxis.DATA,))


def _checkpoint_mesh() -> Any:
    """A one-axis ("data") mesh over the local devices: levanter's checkpoint code places and
    gathers arrays with sharding constraints that need a mesh in context."""
    return hax.partitioning.set_mesh(local_data_mesh())


class _Quiet(logging.Filter):
    """A context manager that drops one logger's records containing ``text``."""

    def __init__(self, logger_name: str, text: str):
        super().__init__()
        self._logger, self._text = logging.getLogger(logger_name), text

    def filter(self, record: logging.LogRecord) -> bool:
        return self._text not in record.getMessage()

    def __enter__(self) -> None:
        self._logger.addFilter(self)

    def __exit__(self, *exc: object) -> None:
        self._logger.removeFilter(self)


def _rope_settings(path: str | Path) -> dict[str, Any]:
    """``rope_theta`` (and ``rope_scaling``) of a ``config.json`` written by ``transformers`` 5,
    which keeps them in ``rope_parameters``: ``transformers`` 4 would ignore that key and give
    the model its default theta (10,000 where Qwen3 uses 1,000,000), silently wrong."""
    import json

    raw = json.loads((Path(path) / "config.json").read_text())
    rope = raw.get("rope_parameters")
    if not isinstance(rope, dict) or "rope_theta" in raw or "rope_theta" not in rope:
        return {}
    rope = dict(rope)
    settings: dict[str, Any] = {"rope_theta": float(rope.pop("rope_theta"))}
    if rope.get("rope_type", "default") != "default":
        settings["rope_scaling"] = rope
    return settings


def checkpoint_levanter_config(
    spec: str | Path, *, gradient_checkpointing: bool = False
) -> tuple[Any, int]:
    """``(levanter config, vocabulary size)`` of a Hugging Face checkpoint's model, read from
    its ``config.json`` alone (no weights)."""
    from transformers import AutoConfig

    from marin_rl_core.models.pretrained import read_pretrained_info

    info = read_pretrained_info(str(spec))
    path = str(info.path)
    hf_config = AutoConfig.from_pretrained(path, local_files_only=True, **_rope_settings(path))
    if info.model_type == "qwen2" and not hasattr(hf_config, "no_bias"):
        # levanter's QwenConfig reads a `no_bias` flag (for its MLP) that transformers'
        # Qwen2Config lacks; Qwen2's MLP has no bias.
        hf_config.no_bias = True
    lev_config = _lev_config_class_for(info.model_type).from_hf_config(hf_config)
    if hasattr(lev_config, "gradient_checkpointing"):
        lev_config = dataclasses.replace(lev_config, gradient_checkpointing=gradient_checkpointing)
    return lev_config, int(hf_config.vocab_size)


_LAYER_KEY = re.compile(r"^(model\.layers)\.(\d+)\.(.+)$")


def _layers_stacked_on_host(state_dict: dict[str, Any]) -> dict[str, Any]:
    """``state_dict`` with each decoder-layer tensor's per-layer copies (``model.layers.N.X``)
    stacked into one (``model.layers.X``), as levanter's scanned layers hold them, on the host.

    levanter stacks them inside its compiled load, and XLA's CPU backend stacks bfloat16 arrays
    through float32 temporaries: a 3.4 GB bfloat16 checkpoint (Qwen3-1.7B) peaked at 14 GiB of
    host memory. Here numpy stacks one tensor at a time (the 28 copies of it, then freed), and
    levanter finds nothing left to stack. Only on CPU: an accelerator stacks in its own memory,
    without the detour."""
    if jax.default_backend() != "cpu":
        return state_dict
    groups: dict[tuple[str, str], dict[int, str]] = {}
    for key in state_dict:
        match = _LAYER_KEY.match(key)
        if match:
            groups.setdefault((match.group(1), match.group(3)), {})[int(match.group(2))] = key
    for (prefix, name), keys in groups.items():
        if sorted(keys) != list(range(len(keys))):
            continue  # not one per layer: left to levanter (which says what is missing)
        parts = [np.asarray(state_dict.pop(keys[i])) for i in range(len(keys))]
        stacked = np.stack(parts)
        del parts
        state_dict[f"{prefix}.{name}"] = jnp.asarray(stacked)
        del stacked
    return state_dict


def load_hf_checkpoint(
    spec: str | Path,
    *,
    tokenizer: Tokenizer | None = None,
    resize_vocab: bool = False,
    dtype: Any = jnp.float32,
    gradient_checkpointing: bool = False,
    heads: dict[str, np.ndarray] | None = None,
) -> LmHeadModel:
    """Load a Hugging Face checkpoint (a local directory or a hub id) with levanter's
    ``HFCheckpointConverter``.

    Args:
        spec: the checkpoint directory or hub id (see :mod:`marin_rl_core.models.pretrained`).
        tokenizer: the run's tokenizer; defaults to the checkpoint's own.
        resize_vocab: resize the model's vocabulary to ``tokenizer``'s size; otherwise the model
            keeps the checkpoint's vocabulary (see :func:`check_vocab`).
        dtype: parameter dtype (the weights are read into it).
        gradient_checkpointing: recompute layer activations in the backward pass.
        heads: for a sequence classifier's checkpoint (``LlamaForSequenceClassification`` and
            the like: ``score.weight`` where a causal LM has its LM head): a dict that gets the
            score head (``heads["score"]``, ``[labels, hidden]``, float32); the model comes back
            with its LM head tied to its embeddings, for its hidden states only
            (:class:`~marin_rl_core.models.reward_model.RewardModel`).

    Raises:
        marin_rl_core.errors.ConfigError: a missing checkpoint or an unsupported architecture.
    """
    from levanter.compat.hf_checkpoints import HFCheckpointConverter
    from transformers import AutoConfig

    from marin_rl_core.models.pretrained import read_pretrained_info

    info = read_pretrained_info(str(spec))
    path = str(info.path)
    if tokenizer is None:
        tokenizer = load_tokenizer(path)
    lev_config_cls = _lev_config_class_for(info.model_type)
    hf_config_cls = type(AutoConfig.for_model(info.model_type))

    class Converter(HFCheckpointConverter):
        def load_state_dict(self, ref: Any = None, dtype: Any = None) -> dict:
            state_dict = super().load_state_dict(ref, dtype)
            if heads is not None:
                from marin_rl_core.errors import ConfigError

                if "score.weight" not in state_dict:
                    raise ConfigError(
                        f"{spec} has no score.weight: not a sequence-classification checkpoint"
                    )
                heads["score"] = np.asarray(state_dict.pop("score.weight"), dtype=np.float32)
                state_dict.pop("lm_head.weight", None)
            return _layers_stacked_on_host(state_dict)

    converter = Converter(
        lev_config_cls,
        reference_checkpoint=path,
        HfConfigClass=hf_config_cls,
        tokenizer=tokenizer.to_hf(),
    )
    lev_config, _ = checkpoint_levanter_config(spec, gradient_checkpointing=gradient_checkpointing)
    if heads is not None:  # no LM head in the file: the embeddings stand in, never read
        lev_config = dataclasses.replace(lev_config, tie_word_embeddings=True)
    # levanter warns whenever the tokenizer has fewer tokens than the model has rows; for a
    # checkpoint's own (padded) vocabulary that is expected, and check_vocab refuses the rest.
    quiet = _Quiet("levanter.compat.hf_checkpoints", "does not match tokenizer vocab size")
    with _checkpoint_mesh(), quiet:
        return converter.load_pretrained(
            lev_config.model_type,
            ref=path,
            config=lev_config,
            dtype=dtype,
            resize_vocab_to_match_tokenizer=resize_vocab,
        )


def save_hf_checkpoint(model: LmHeadModel, path: str | Path, *, tokenizer: Tokenizer) -> None:
    """Write ``model`` as a Hugging Face checkpoint directory that ``transformers`` loads: the
    config of the model's own architecture (Llama, Qwen2, Qwen3 ...), safetensors weights, the
    tokenizer with its chat template, and a ``generation_config.json`` whose EOS ids are the
    tokenizer's stop tokens. :func:`load_hf_checkpoint` reads it back."""
    from levanter.compat.hf_checkpoints import HFCheckpointConverter
    from transformers import GenerationConfig

    from marin_rl_core.models.pretrained import SUPPORTED_MODEL_TYPES

    path = Path(path).expanduser()
    path.mkdir(parents=True, exist_ok=True)
    hf_config = model.config.to_hf_config(model.Vocab.size)
    # The converter copies `architectures` from a reference checkpoint's config; the directory's
    # own config (written first) is that reference, so nothing is fetched from the Hub.
    hf_config.architectures = [SUPPORTED_MODEL_TYPES[hf_config.model_type]]
    hf_config.save_pretrained(str(path))
    converter = HFCheckpointConverter(
        type(model.config),
        reference_checkpoint=str(path),
        HfConfigClass=type(hf_config),
        tokenizer=tokenizer.to_hf(),
    )
    with _checkpoint_mesh():
        converter.save_pretrained(model, str(path), save_reference_code=False, save_tokenizer=True)
    GenerationConfig(
        bos_token_id=tokenizer.bos_id,
        eos_token_id=list(tokenizer.stop_ids),
        pad_token_id=tokenizer.pad_id,
    ).save_pretrained(str(path))


__all__ = [
    "build_model",
    "cast_floating",
    "initial_model",
    "llama_config",
    "load_hf_checkpoint",
    "save_hf_checkpoint",
]
