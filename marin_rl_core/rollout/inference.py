"""Sampling from the policy with levanter's paged-attention ``InferenceEngine``.

:class:`SamplingEngine` builds one levanter engine (KV cache, decode state) and keeps it for the
life of the process: new weights are swapped in with :meth:`SamplingEngine.update_model`, which
costs nothing (the jitted prefill/decode functions take the model as an argument, so the same
compiled code runs on the new weights as long as their shapes do not change).

Notes on levanter's engine that shaped this wrapper:

* ``InferenceEngine.reset()`` reuses the engine's *initial* decode state, whose buffers were
  donated to the first prefill, so calling it after a ``generate`` fails with a deleted/donated
  buffer error. It is not needed: ``generate`` frees every finished sequence's slot and pages
  on the device and on the host. Should a call ever leave a slot in use (it cannot when every
  sequence ends by ``max_tokens``, as here), the engine is rebuilt from scratch instead.
* The engine's ``generate`` stops after ``ceil(max_seq_len / max_rounds)`` jitted decode loops
  (with a warning when it breaks off). ``max_rounds = max_seq_len - 1`` lets the first loop
  produce every token a response can have, and requests are chunked so that each chunk fits
  in the slots and the prefill buffer at once (nothing waits in the engine's queue).
* Samples of one prompt (``n_generations > 1``) share the prompt's KV pages. In this levanter
  version the clones decode from wrong cache entries once the prompt fills its first page
  (prompt length >= page size): their tokens and logprobs no longer match the model. So each
  sequence gets one page of ``max_seq_len`` tokens (the same KV-cache memory as before), and a
  prompt never reaches a page boundary; ``tests/test_inference.py`` guards this.
* The engine makes its state eagerly, its arrays not committed to a device, and each call
  hands it back committed; XLA compiles a program apart for each kind, so the second call
  compiled the prefill again. The state is committed where it is as soon as the engine is
  built (``tests/test_inference.py`` holds that a second call compiles nothing).
* The sampler reports logprobs of the *tempered* distribution (``log_softmax(logits / T)``; for
  ``T = 0`` the untempered one).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator, Sequence
from typing import Any

import haliax as hax
import jax
import jax.numpy as jnp
import numpy as np
from levanter.inference.engine import InferenceEngine, InferenceEngineConfig, Request
from levanter.inference.jit_scheduler import SeqDecodingParams
from levanter.models.lm_model import LmHeadModel

from marin_rl_core.generation import GenerationRequest, Sample, requests_for
from marin_rl_core.models.build import cast_floating

logger = logging.getLogger(__name__)


def _check_same_shapes(old: LmHeadModel, new: LmHeadModel) -> None:
    same_structure = jax.tree.structure(old) == jax.tree.structure(new)  # type: ignore[operator]
    if not same_structure or any(
        a.shape != b.shape or a.dtype != b.dtype
        for a, b in zip(jax.tree.leaves(old), jax.tree.leaves(new))
    ):
        raise ValueError(
            "update_model needs a model with the same architecture and parameter shapes as "
            "the one the engine was built for; build a new sampler for a different one."
        )


def check_requests(
    requests: Sequence[GenerationRequest],
    *,
    eos_id: int,
    max_seqs: int,
    max_stop_tokens: int,
    max_seq_len: int,
) -> list[list[int]]:
    """Reject a request an engine cannot serve, naming the limit; returns each request's stop
    ids (EOS first, no repeats)."""
    stops = []
    for i, request in enumerate(requests):
        if request.n < 1 or request.n > max_seqs:
            raise ValueError(f"n must be in 1..{max_seqs} (max_seqs), got {request.n}")
        if not 0 < len(request.prompt) < max_seq_len:
            raise ValueError(
                f"prompt {i} has {len(request.prompt)} tokens; prompts need "
                f"1..{max_seq_len - 1} tokens (max_seq_len={max_seq_len})"
            )
        own = list(dict.fromkeys([eos_id, *request.stop_tokens]))
        if len(own) > max_stop_tokens:
            raise ValueError(
                f"{len(own)} stop tokens (EOS included) but the engine was built for at most "
                f"{max_stop_tokens}; pass max_stop_tokens= when building it"
            )
        stops.append(own)
    return stops


def sample_prompts(
    engine: Any, prompts: Sequence[Sequence[int]], **settings: Any
) -> list[list[Sample]]:
    """``engine.generate`` of one request per prompt with shared ``settings`` (those of
    :func:`~marin_rl_core.generation.requests_for`: ``n``, ``temperature``, ``max_tokens``,
    ``stop_tokens``, ``seed``, ``prompt_seeds``); ``result[i][k]`` is the ``k``-th sample of
    ``prompts[i]``."""
    return engine.generate(requests_for(prompts, **settings))


def row_keys(seed: jax.Array, fold: jax.Array, sample: jax.Array) -> jax.Array:
    """Each row's sampling key: ``fold_in(PRNGKey(seed), fold)`` (no fold where ``fold < 0``),
    folded with the sample's index (vectorized over rows)."""

    def one(seed, fold, sample):  # type: ignore[no-untyped-def]
        key = jax.random.PRNGKey(seed)
        key = jnp.where(fold >= 0, jax.random.fold_in(key, fold), key)
        return jax.random.fold_in(key, sample)

    return jax.vmap(one)(seed, fold, sample)


def committed(x: Any) -> Any:
    """``x`` (an array) committed to the devices it is on; anything else as it is."""
    if isinstance(x, jax.Array) and not x.committed:
        return jax.device_put(x, x.sharding)
    return x


class Sampler:
    """What both samplers share: the model in the engine's dtype, sharded over an optional mesh,
    and weight swaps that must keep the architecture."""

    def __init__(
        self,
        model: LmHeadModel,
        *,
        max_seq_len: int,
        eos_id: int,
        max_stop_tokens: int,
        compute_dtype: Any,
        mesh: Any,
        axis_mapping: Any,
    ) -> None:
        self.mesh, self.axis_mapping = mesh, dict(axis_mapping or {})
        self.max_seq_len = max_seq_len
        self.eos_id = int(eos_id)
        self.max_stop_tokens = max_stop_tokens
        self.compute_dtype = jnp.dtype(compute_dtype)
        self._model = self._place(model)

    @contextlib.contextmanager
    def _on_mesh(self) -> Iterator[None]:
        if self.mesh is None:
            yield
            return
        with hax.partitioning.set_mesh(self.mesh), hax.axis_mapping(self.axis_mapping):
            yield

    def _place(self, model: LmHeadModel) -> LmHeadModel:
        """``model`` in the engine's dtype, sharded over its mesh (if it has one), its arrays
        committed to their devices either way: weights a transfer delivers are (placed like the
        ones they replace), and XLA compiles a program again for committed arguments where it
        had uncommitted ones, so a warm-up on a model built in the process would compile the
        sampler's programs once for nothing (each again after the first weights came)."""
        model = cast_floating(model, self.compute_dtype)
        if self.mesh is not None:
            with self._on_mesh():
                model = hax.shard(model, self.axis_mapping)
        return jax.tree.map(committed, model)

    @property
    def model(self) -> LmHeadModel:
        return self._model

    def update_model(self, model: LmHeadModel) -> None:
        """Sample from ``model`` from now on. It must have the same structure and shapes as the
        current model (new weights of the same architecture); anything else is rejected. Its
        floating-point parameters are cast to the engine's ``compute_dtype`` and sharded over its
        mesh."""
        self._model = self._checked(model)

    def _checked(self, model: LmHeadModel) -> LmHeadModel:
        """``model`` placed as the engine's (:meth:`_place`), refused unless it has the current
        model's structure and shapes."""
        model = self._place(model)
        _check_same_shapes(self._model, model)
        return model


class SamplingEngine(Sampler):
    """Generates ``n`` samples per prompt from a levanter LM, reusable across weight updates.

    Args:
        model: the policy (a levanter ``LmHeadModel`` with ``decode``, e.g. Llama).
        max_seq_len: the most tokens (prompt + response) of one sequence.
        eos_id: the tokenizer's end-of-sequence id, always a stop token.
        max_seqs: sequences decoded at once (prompts x samples per chunk of work).
        max_prefill_tokens: prompt tokens prefilled in one call.
        max_stop_tokens: the most stop tokens (EOS included) a request may have.
        page_size: tokens per KV-cache page; default (and at least) ``max_seq_len``, see the
            module docstring.
        mesh: a device mesh to shard the model over (with ``axis_mapping``); ``None`` keeps it on
            one device. See :func:`inference_mesh`.
        axis_mapping: logical axis -> mesh axis (levanter's compute axis mapping), e.g.
            ``{"heads": "model", "mlp": "model"}`` for tensor parallelism.
        compute_dtype: the dtype the engine runs in: the model's floating-point parameters
            (cast on the way in, here and in :meth:`update_model`) and the KV cache. float32 keeps
            sampler and trainer logprobs identical up to float rounding; bfloat16 halves memory
            and is what accelerators run fastest.
    """

    name = "paged"

    def __init__(
        self,
        model: LmHeadModel,
        *,
        max_seq_len: int,
        eos_id: int,
        max_seqs: int = 256,
        max_prefill_tokens: int = 2048,
        max_stop_tokens: int = 4,
        page_size: int | None = None,
        compute_dtype: jnp.dtype = jnp.float32,
        mesh: Any = None,
        axis_mapping: Any = None,
    ) -> None:
        page_size = max(page_size or max_seq_len, max_seq_len)
        pages_per_seq = -(-max_seq_len // page_size)
        self._config = InferenceEngineConfig(
            max_seq_len=max_seq_len,
            page_size=page_size,
            max_pages=max_seqs * pages_per_seq,
            max_seqs=max_seqs,
            max_seqs_in_prefill=max_seqs,
            max_prefill_size=max_prefill_tokens,
            max_queued_tokens=max(max_seqs, 512),
            max_rounds=max(max_seq_len - 1, 1),
            max_stop_seqs=max_stop_tokens,
            max_stop_tokens=1,
            enable_logprobs=True,
            compute_dtype=compute_dtype,
        )
        super().__init__(
            model,
            max_seq_len=max_seq_len,
            eos_id=eos_id,
            max_stop_tokens=max_stop_tokens,
            compute_dtype=compute_dtype,
            mesh=mesh,
            axis_mapping=axis_mapping,
        )
        with self._on_mesh():
            self._engine = self._new_engine()

    @property
    def max_seqs(self) -> int:
        return int(self._config.max_seqs)

    def _new_engine(self) -> InferenceEngine:
        engine = InferenceEngine.from_model_with_config(
            model=self._model, tokenizer=None, config=self._config
        )
        # Its state is made eagerly, not committed to a device, and every call hands it back
        # committed: XLA compiles a program apart for each, so the second call compiled the
        # whole prefill again (4 s of a bench call's 16 on a 2-core CPU; a large model's
        # prefill on any device). Committed where it is from the start, it compiles once.
        engine.gen_state = jax.tree.map(committed, engine.gen_state)
        return engine

    def update_model(self, model: LmHeadModel) -> None:
        super().update_model(model)
        self._engine.model = self._model

    def generate(self, requests: Sequence[GenerationRequest]) -> list[list[Sample]]:
        """Sample every request (see :class:`~marin_rl_core.protocols.GenerationEngine`):
        ``result[i][k]`` is the ``k``-th sample of ``requests[i]``."""
        stops = check_requests(
            requests, eos_id=self.eos_id, max_seqs=self._config.max_seqs,
            max_stop_tokens=self.max_stop_tokens, max_seq_len=self.max_seq_len,
        )  # fmt: skip
        results: list[list[Sample]] = []
        for chunk_start, chunk in self._chunks(requests):
            batch = []
            for j, request in enumerate(chunk):
                own = stops[chunk_start + j]
                prompt_len = len(request.prompt)
                budget = min(request.max_tokens, self.max_seq_len - prompt_len)
                key = jax.random.PRNGKey(request.seed)
                if request.fold >= 0:
                    key = jax.random.fold_in(key, request.fold)
                params = SeqDecodingParams(
                    max_num_tokens=jnp.asarray(prompt_len + budget, dtype=jnp.int32),
                    stop_tokens=hax.named(
                        jnp.asarray([[t] for t in own], dtype=jnp.int32), ("stop_seq", "position")
                    ),
                    temperature=jnp.asarray(request.temperature, dtype=jnp.float32),
                    key=key,
                )
                batch.append(
                    Request(
                        prompt_tokens=list(request.prompt),
                        request_id=j,
                        decode_params=params,
                        n_generations=request.n,
                        enable_logprobs=True,
                    )
                )
            with self._on_mesh():
                out = self._engine.generate(batch)
                self._check_engine_drained()
            row = 0
            for j, request in enumerate(chunk):
                stop_set = set(stops[chunk_start + j])
                samples = []
                for _ in range(request.n):
                    tokens = np.asarray(out.tokens[row], dtype=np.int32)
                    logprobs = np.asarray(out.logprobs[row], dtype=np.float32)
                    stopped = bool(tokens.size) and int(tokens[-1]) in stop_set
                    samples.append(Sample(tokens=tokens, logprobs=logprobs, stopped=stopped))
                    row += 1
                results.append(samples)
        return results

    def _chunks(self, requests: Sequence[GenerationRequest]):  # type: ignore[no-untyped-def]
        """Consecutive runs of requests whose samples fit in the slots and whose prompt tokens
        fit in the prefill buffer, so each ``generate`` of the engine finishes in one decode
        loop."""
        slots = self._config.max_seqs
        budget = int(self._config.max_prefill_size)
        start = 0
        while start < len(requests):
            end, tokens, rows = start, 0, 0
            while (
                end < len(requests)
                and rows + requests[end].n <= slots
                and tokens + len(requests[end].prompt) <= budget
            ):
                tokens += len(requests[end].prompt)
                rows += requests[end].n
                end += 1
            if end == start:
                raise ValueError(
                    f"prompt {start} ({len(requests[start].prompt)} tokens) does not fit in the "
                    f"prefill buffer of {budget} tokens"
                )
            yield start, requests[start:end]
            start = end

    def _check_engine_drained(self) -> None:
        engine = self._engine
        if len(engine.free_slots) == self._config.max_seqs and not engine.request_queue:
            return
        logger.warning("levanter engine kept sequences after generate; rebuilding its state")
        self._engine = self._new_engine()


__all__ = ["SamplingEngine", "check_requests", "row_keys", "sample_prompts"]
