"""``reference``: an example third-party marinrl generation engine, the simplest correct one.

No KV cache and no batching: each sample is drawn one token at a time, and each token costs one
full forward pass of the policy over that row's tokens so far. That is slow (the work grows with
the square of the length), and it makes the engine contract easy to read off the code:

* **one key per row**: ``fold_in(PRNGKey(seed), fold)`` (no fold when ``fold < 0``), then the
  sample's index (``row_keys``); token ``j`` is drawn with ``fold_in(row_key, j)``
  (``draw_next_tokens``). A row's forward pass sees only its own tokens, so the same key, prompt
  and weights give the same samples, whatever else the call holds;
* **stop ids and budget**: a response ends at EOS or one of the request's ``stop_tokens``
  (``stopped``), or after ``max_tokens``, lowered to fit ``max_seq_len``; a request the engine
  cannot serve is refused naming the limit (``check_requests``);
* **logprobs equal the trainer's**: the logits are the trainer's (``next_token_logits``: the
  same forward pass and float32 projection), and a token's logprob is ``log_softmax(logits /
  T)`` (``T = 1`` for greedy rows, ``temperature = 0``: the argmax).

These four helpers are marinrl's public API for engine authors; with them the samples are the
built-in ``dense`` engine's, token for token.

Each padded length (a power of two, at least 8) compiles once. Try it::

    pip install ./examples/marinrl-reference-engine
    marinrl run --engine reference
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import attrs
import numpy as np

from marin_rl_core import (
    EnginePlugin,
    EngineSpec,
    FeatureNotAvailableError,
    GenerationRequest,
    Sample,
    hookimpl,
)


@attrs.frozen(kw_only=True)
class ReferenceEngineConfig:
    """No settings."""


def _next_token(model: Any, tokens: Any, last: Any, key: Any, step: Any, temperature: Any) -> Any:
    """One forward pass over ``tokens [width]`` (a row's tokens, then padding): the token that
    follows position ``last``, drawn with ``fold_in(key, step)`` at ``temperature``, and its
    logprob."""
    from marin_rl_core import draw_next_tokens, next_token_logits

    logits = next_token_logits(model, tokens[None], last[None])
    token, logprob = draw_next_tokens(logits, key[None], step[None], temperature[None])
    return token[0], logprob[0]


class ReferenceEngine:
    """A :class:`marin_rl_core.GenerationEngine` on one device."""

    def __init__(self, config: ReferenceEngineConfig, spec: EngineSpec):
        import equinox as eqx

        if spec.mesh is not None:
            raise FeatureNotAvailableError(
                "the reference engine runs on one device; set model.inference_tensor_parallel "
                "= 1, or pick another engine (--engine kv)"
            )
        self.spec, self.max_seqs = spec, spec.max_seqs
        self._step = eqx.filter_jit(_next_token)
        self._model = self._cast(spec.model)

    def _cast(self, model: Any) -> Any:
        """``model`` with its floating-point arrays in the spec's ``compute_dtype``."""
        import equinox as eqx
        import jax
        import jax.numpy as jnp

        dtype = jnp.dtype(self.spec.compute_dtype)
        return jax.tree.map(lambda x: x.astype(dtype) if eqx.is_inexact_array(x) else x, model)

    @property
    def model(self) -> Any:
        return self._model

    def update_model(self, model: Any) -> None:
        self._model = self._cast(model)

    def generate(self, requests: Sequence[GenerationRequest]) -> list[list[Sample]]:
        from marin_rl_core import check_requests, row_keys

        stops = check_requests(
            requests, eos_id=self.spec.eos_id, max_seqs=self.max_seqs,
            max_stop_tokens=self.spec.max_stop_tokens, max_seq_len=self.spec.max_seq_len,
        )  # fmt: skip
        out = []
        for r, own in zip(requests, stops):
            n = np.arange(r.n, dtype=np.int32)
            keys = row_keys(
                np.full(r.n, r.seed % 2**32, np.uint32), np.full(r.n, r.fold, np.int32), n
            )
            out.append([self._sample(r, set(own), keys[k]) for k in range(r.n)])
        return out

    def _sample(self, request: GenerationRequest, stops: set[int], key: Any) -> Sample:
        budget = min(request.max_tokens, self.spec.max_seq_len - len(request.prompt))
        tokens, new, logprobs = list(request.prompt), [], []
        while len(new) < budget and not (new and new[-1] in stops):
            width = min(max(8, 1 << (len(tokens) - 1).bit_length()), self.spec.max_seq_len)
            row = np.zeros(width, np.int32)
            row[: len(tokens)] = tokens
            token, logprob = self._step(
                self._model, row, np.int32(len(tokens) - 1), key, np.int32(len(new)),
                np.float32(request.temperature),
            )  # fmt: skip
            tokens.append(int(token))
            new.append(int(token))
            logprobs.append(float(logprob))
        return Sample(
            tokens=np.asarray(new, np.int32),
            logprobs=np.asarray(logprobs, np.float32),
            stopped=bool(new) and new[-1] in stops,
        )


@hookimpl
def marinrl_register_engines():
    yield EnginePlugin(
        name="reference",
        summary="One full forward pass per sampled token, no KV cache: the simplest correct "
        "engine (example; slow).",
        config_class=ReferenceEngineConfig,
        build=ReferenceEngine,
    )
