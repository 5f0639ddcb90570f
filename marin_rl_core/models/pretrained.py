"""Where a Hugging Face checkpoint comes from, and what its ``config.json`` says.

``model.checkpoint`` is a local directory (written by ``save_pretrained``, or by ``marinrl
export``) or a Hugging Face Hub id such as ``Qwen/Qwen3-0.6B``. A hub id is downloaded once into
the Hugging Face cache (``HF_HOME``) with ``huggingface_hub``; without network the error says so
and names the local-directory alternative. Every process of a job resolves the same spec, so a
worker on another node finds the checkpoint through its own cache.

This module imports no JAX: the driver checks a checkpoint (architecture, vocabulary, context
length) before anything starts.
"""

from __future__ import annotations

import functools
import json
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any

import attrs

from marin_rl_core.errors import ConfigError

if TYPE_CHECKING:
    from marin_rl_core.config.schema import ModelConfig
    from marin_rl_core.models.tokenizer import Tokenizer

SUPPORTED_MODEL_TYPES: dict[str, str] = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}
"""Hugging Face ``model_type`` -> the ``architectures`` entry an exported checkpoint carries.
Every one decodes with the paged KV cache levanter's ``InferenceEngine`` needs."""

_HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*$")
# What a causal LM checkpoint needs; the Hub repo may hold much more (other formats, images).
_HUB_PATTERNS = ["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja", "tokenizer*"]


class CheckpointNotFoundError(ConfigError):
    """``model.checkpoint`` names neither a local checkpoint directory nor a reachable hub id."""


@attrs.frozen(kw_only=True)
class PretrainedInfo:
    """The facts of a checkpoint's ``config.json`` that marinrl checks before a job starts.

    Args:
        path: the local checkpoint directory.
        model_type: Hugging Face ``model_type`` (``"qwen3"``).
        vocab_size: rows of the embedding matrix (may exceed the tokenizer's size: padding).
        max_position_embeddings: the longest sequence the model was built for.
    """

    path: Path
    model_type: str
    vocab_size: int
    max_position_embeddings: int | None


def is_hub_id(spec: str) -> bool:
    """Whether ``spec`` looks like ``org/name`` (and is not an existing local path)."""
    return bool(_HUB_ID.match(spec)) and not Path(spec).expanduser().exists()


@functools.cache
def checkpoint_dir(spec: str) -> Path:
    """The local directory of ``model.checkpoint``: the path itself, or the Hub snapshot of a hub
    id (downloaded on first use).

    Raises:
        CheckpointNotFoundError: a missing path, or a hub id that cannot be fetched (no network,
            unknown repo, gated model), with what to do instead.
    """
    path = Path(spec).expanduser()
    if path.exists():
        if not (path / "config.json").is_file():
            raise CheckpointNotFoundError(
                f"model.checkpoint {spec!r} is not a Hugging Face checkpoint directory (it has no "
                "config.json). Give a directory written by `save_pretrained` or `marinrl export`, "
                "or a hub id such as Qwen/Qwen3-0.6B."
            )
        return path.resolve()
    if not is_hub_id(spec):
        raise CheckpointNotFoundError(
            f"model.checkpoint {spec!r} does not exist. Give a local checkpoint directory or a "
            "Hugging Face hub id (org/name, e.g. Qwen/Qwen3-0.6B)."
        )
    try:
        from huggingface_hub import snapshot_download

        local = snapshot_download(repo_id=spec, allow_patterns=_HUB_PATTERNS, etag_timeout=10)
    except Exception as exc:  # network, auth, missing repo: all end the same way for a user
        raise CheckpointNotFoundError(
            f"could not fetch model.checkpoint {spec!r} from the Hugging Face Hub "
            f"({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}). Without "
            "network access, download it on a machine that has it (`huggingface-cli download "
            f"{spec} --local-dir DIR`), copy DIR here and set model.checkpoint=DIR (or "
            "--model DIR). A gated model also needs `huggingface-cli login`."
        ) from exc
    return Path(local)


def read_pretrained_info(spec: str) -> PretrainedInfo:
    """Resolve ``spec`` (see :func:`checkpoint_dir`) and read its ``config.json``.

    Raises:
        CheckpointNotFoundError: as :func:`checkpoint_dir`.
        ConfigError: an unreadable ``config.json`` or an architecture marinrl cannot train.
    """
    path = checkpoint_dir(spec)
    try:
        raw: dict[str, Any] = json.loads((path / "config.json").read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ConfigError(f"model.checkpoint {spec!r}: cannot read config.json: {exc}") from exc
    model_type = str(raw.get("model_type", ""))
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ConfigError(
            f"model.checkpoint {spec!r} is a {model_type or 'model without model_type'!r} "
            f"checkpoint; marinrl trains {', '.join(sorted(SUPPORTED_MODEL_TYPES))} models "
            "(docs/hf-models.md lists them)."
        )
    if not isinstance(raw.get("vocab_size"), int):
        raise ConfigError(f"model.checkpoint {spec!r}: config.json has no integer vocab_size")
    max_pos = raw.get("max_position_embeddings")
    return PretrainedInfo(
        path=path,
        model_type=model_type,
        vocab_size=int(raw["vocab_size"]),
        max_position_embeddings=int(max_pos) if isinstance(max_pos, int) else None,
    )


def check_vocab(config: ModelConfig, tokenizer: Tokenizer) -> None:
    """Refuse a tokenizer that does not fit ``config.checkpoint``'s vocabulary.

    The checkpoint's own tokenizer may have fewer tokens than the model has embedding rows
    (checkpoints pad their vocabulary); never more. Any other tokenizer must match the model's
    vocabulary size exactly. ``model.resize_vocab = true`` resizes the model to the tokenizer
    instead (new rows are initialised, extra rows dropped).

    Raises:
        ConfigError: naming both sizes and the two ways out.
    """
    if not config.checkpoint or config.resize_vocab:
        return
    info = read_pretrained_info(config.checkpoint)
    own = config.tokenizer in ("auto", config.checkpoint) or (
        Path(config.tokenizer).expanduser().is_dir()
        and Path(config.tokenizer).expanduser().resolve() == checkpoint_dir(config.checkpoint)
    )
    n, rows = tokenizer.vocab_size, info.vocab_size
    if n > rows or (not own and n != rows):
        raise ConfigError(
            f"model.tokenizer {config.tokenizer!r} has {n} tokens but the model of "
            f"model.checkpoint {config.checkpoint!r} has a vocabulary of {rows}. Use the "
            'checkpoint\'s own tokenizer (model.tokenizer = "auto", the default), or set '
            "model.resize_vocab = true to resize the model's vocabulary to the tokenizer."
        )


def context_length(config: ModelConfig) -> int | None:
    """The longest sequence ``config``'s model was built for: a checkpoint's
    ``max_position_embeddings`` (``None`` when it does not say); ``None`` for a fresh model,
    whose rotary embeddings have no limit of their own."""
    if not config.checkpoint:
        return None
    return read_pretrained_info(config.checkpoint).max_position_embeddings


__all__ = [
    "CheckpointNotFoundError",
    "PretrainedInfo",
    "SUPPORTED_MODEL_TYPES",
    "check_vocab",
    "checkpoint_dir",
    "context_length",
    "is_hub_id",
    "read_pretrained_info",
]
