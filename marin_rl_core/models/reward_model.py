"""A learned reward model on levanter: a Hugging Face sequence-classification checkpoint with one
output (``LlamaForSequenceClassification``, ``Qwen2ForSequenceClassification``,
``Qwen3ForSequenceClassification``: a Llama-family body and a ``score`` head ``[1, hidden]``, as
TRL's ``RewardTrainer`` writes them) scoring token sequences (issue 62).

levanter has no sequence-classification models, but its causal LMs are the body: the checkpoint
is loaded as one (:func:`~marin_rl_core.models.build.load_hf_checkpoint` with ``heads``), its
final hidden states (after the last norm) are read at each sequence's last token and multiplied
by the score head, as ``transformers`` does: the last token is the rightmost one that is not
the config's ``pad_token_id`` (the last one when it has none). ``tests/test_reward_model.py``
holds the values to ``transformers``' own.

Sequences are scored ``batch_size`` at a time, right-padded to a power of two (at least 16, at
most ``max_seq_len``) so that a few shapes are compiled once each.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import equinox as eqx
import haliax as hax
import jax.numpy as jnp
import numpy as np

from marin_rl_core.errors import ConfigError

logger = logging.getLogger(__name__)


def classifier_facts(path: Path) -> tuple[int, int | None]:
    """``(labels, pad_token_id)`` of a sequence-classification checkpoint's ``config.json``.

    Raises:
        ConfigError: a checkpoint that is not one (its ``architectures``), or one with more
            than one label (a reward model has a single scalar output).
    """
    try:
        raw: dict[str, Any] = json.loads((path / "config.json").read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ConfigError(f"reward model {str(path)!r}: cannot read config.json: {exc}") from exc
    architectures = [str(a) for a in raw.get("architectures") or []]
    if not any(a.endswith("ForSequenceClassification") for a in architectures):
        raise ConfigError(
            f"reward model {str(path)!r} is a {' / '.join(architectures) or 'model without architectures'}"
            " checkpoint, not a sequence classifier: give one saved from "
            "AutoModelForSequenceClassification with num_labels=1 (TRL's RewardTrainer writes them)"
        )
    labels = len(raw["id2label"]) if isinstance(raw.get("id2label"), dict) else 2
    labels = int(raw.get("num_labels", labels))
    if labels != 1:
        raise ConfigError(
            f"reward model {str(path)!r} has {labels} outputs (num_labels); a reward model has "
            "one: a scalar score"
        )
    pad = raw.get("pad_token_id")
    return labels, pad if isinstance(pad, int) else None


@eqx.filter_jit
def _values(model: Any, head: jnp.ndarray, ids: hax.NamedArray, last: jnp.ndarray) -> jnp.ndarray:
    """The score head at position ``last[i]`` of each row ``i`` of ``ids`` ``[batch, position]``."""
    from levanter.layers.attention import AttentionMask

    hidden = model.activations(ids, attn_mask=AttentionMask.causal())
    batch, pos = ids.axes
    array = hidden.rearrange((batch, pos, ...)).array
    picked = array[jnp.arange(array.shape[0]), last].astype(jnp.float32)
    return picked @ head


class RewardModel:
    """A sequence-classification checkpoint's scalar score of token sequences.

    Args:
        path: the checkpoint directory (its tokenizer is :attr:`tokenizer`).
        dtype: the body's weights and compute (``"float32"``, ``"bfloat16"``).
        max_seq_len: the longest sequence scored (longer ones are the caller's to refuse).
        batch_size: sequences per forward pass.
    """

    def __init__(
        self,
        path: str | Path,
        *,
        dtype: str = "float32",
        max_seq_len: int = 2048,
        batch_size: int = 8,
    ):
        from marin_rl_core.models.build import load_hf_checkpoint
        from marin_rl_core.models.pretrained import checkpoint_dir
        from marin_rl_core.models.tokenizer import load_tokenizer

        start = time.monotonic()
        self.path = checkpoint_dir(str(path))
        _, self.pad_id = classifier_facts(self.path)
        self.tokenizer = load_tokenizer(str(self.path))
        heads: dict[str, np.ndarray] = {}
        self.model = load_hf_checkpoint(
            self.path, tokenizer=self.tokenizer, dtype=jnp.dtype(dtype), heads=heads
        )
        self.head = jnp.asarray(heads["score"][0])
        self.max_seq_len = int(max_seq_len)
        self.batch_size = max(1, int(batch_size))
        logger.info("reward model %s loaded in %.1f s", self.path, time.monotonic() - start)

    @staticmethod
    def check(path: str | Path) -> None:
        """Refuse what is not a one-output sequence classifier's checkpoint directory, before
        anything loads (:class:`~marin_rl_core.errors.ConfigError` naming what it is)."""
        classifier_facts(Path(path).expanduser())

    def _last(self, row: Sequence[int]) -> int:
        """The position ``transformers`` reads: the rightmost token that is not the pad id."""
        if self.pad_id is None:
            return len(row) - 1
        kept = np.flatnonzero(np.asarray(row) != self.pad_id)
        return int(kept[-1]) if kept.size else 0

    def score(self, rows: Sequence[Sequence[int]]) -> list[float]:
        """Each token sequence's score (every row at most :attr:`max_seq_len` tokens, at least
        one)."""
        from haliax import Axis

        from marin_rl_core.models.packing import BATCH, POS

        if any(not 0 < len(r) <= self.max_seq_len for r in rows):
            raise ValueError(f"a row of 0 or more than max_seq_len {self.max_seq_len} tokens")
        out: list[float] = []
        fill = 0 if self.pad_id is None else self.pad_id
        for start in range(0, len(rows), self.batch_size):
            chunk = rows[start : start + self.batch_size]
            width = min(self.max_seq_len, max(16, 1 << (max(map(len, chunk)) - 1).bit_length()))
            ids = np.full((self.batch_size, width), fill, np.int32)
            last = np.zeros(self.batch_size, np.int32)
            for i, row in enumerate(chunk):
                ids[i, : len(row)] = row
                last[i] = self._last(row)
            named = hax.named(jnp.asarray(ids), (Axis(BATCH, self.batch_size), Axis(POS, width)))
            values = np.asarray(_values(self.model, self.head, named, jnp.asarray(last)))
            out.extend(float(v) for v in values[: len(chunk)])
        return out


__all__ = ["RewardModel", "classifier_facts"]
