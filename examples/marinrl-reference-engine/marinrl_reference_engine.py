"""``reference``: an example third-party marinrl generation engine, the simplest correct one.

No KV cache and no batching: each sample is drawn one token at a time, and each token costs one
full forward pass of the policy over that row's tokens so far. That is slow (the work grows with
the square of the length), and it makes the engine contract easy to read off the code:

* **one key per row**: ``fold_in(PRNGKey(seed), fold)`` (no fold when ``fold < 0``), then the
  sample's index, then the token's index. A row's forward pass sees only its own tokens, so the
  same key, prompt and weights give the same samples, whatever else the call holds;
* **stop ids and budget**: a response ends at EOS or one of the request's ``stop_tokens``
  (``stopped``), or after ``max_tokens``, lowered to fit ``max_seq_len``;
* **logprobs equal the trainer's**: the logits are the final hidden state times the LM head in
  float32, as the trainer computes them, and a token's logprob is ``log_softmax(logits / T)``
  (``T = 1`` for greedy rows, ``temperature = 0``: the argmax).

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


def _next_token(model: Any, tokens: Any, last: Any, key: Any, temperature: Any) -> Any:
    """One forward pass over ``tokens [width]`` (a row's tokens, then padding): the token that
    follows position ``last``, drawn with ``key`` at ``temperature``, and its logprob."""
    import haliax as hax
    import jax
    import jax.numpy as jnp
    from levanter.layers.attention import AttentionMask  # the causal mask the trainer uses

    hidden = model.activations(hax.named(tokens, "position"), attn_mask=AttentionMask.causal())
    lm_head = model.get_lm_head().rearrange((model.Embed, model.Vocab)).array
    h = hidden.rearrange(("position", model.Embed)).array[last]
    logits = jnp.dot(h, lm_head, preferred_element_type=jnp.float32)
    greedy = temperature <= 0
    logprobs = jax.nn.log_softmax(logits / jnp.where(greedy, 1.0, temperature))
    token = jnp.where(greedy, jnp.argmax(logits), jax.random.categorical(key, logprobs))
    return token, logprobs[token]


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
        import jax

        for i, r in enumerate(requests):
            if not 1 <= r.n <= self.max_seqs:
                raise ValueError(f"request {i}: n must be in 1..{self.max_seqs} (max_seqs)")
            if not 0 < len(r.prompt) < self.spec.max_seq_len:
                raise ValueError(
                    f"request {i}: a prompt of {len(r.prompt)} tokens; prompts need 1.."
                    f"{self.spec.max_seq_len - 1} tokens (max_seq_len={self.spec.max_seq_len})"
                )
        out = []
        for r in requests:
            key = jax.random.PRNGKey(np.uint32(r.seed % 2**32))
            if r.fold >= 0:
                key = jax.random.fold_in(key, r.fold)
            out.append([self._sample(r, jax.random.fold_in(key, k)) for k in range(r.n)])
        return out

    def _sample(self, request: GenerationRequest, key: Any) -> Sample:
        import jax

        stops = {self.spec.eos_id, *request.stop_tokens}
        budget = min(request.max_tokens, self.spec.max_seq_len - len(request.prompt))
        tokens, new, logprobs = list(request.prompt), [], []
        while len(new) < budget and not (new and new[-1] in stops):
            width = min(max(8, 1 << (len(tokens) - 1).bit_length()), self.spec.max_seq_len)
            row = np.zeros(width, np.int32)
            row[: len(tokens)] = tokens
            token, logprob = self._step(
                self._model, row, np.int32(len(tokens) - 1), jax.random.fold_in(key, len(new)),
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
