"""The ``kv`` engine: a KV cache in slots, decode rounds that stay on the device, continuous
batching.

Rows (one sampled sequence each) live in *slots* of a preallocated cache: ``[layer, slot,
position, kv_head, head_size]`` keys and values, plus each slot's tokens, logprobs, length, end,
temperature, stop ids and sampling key. The host loop of :meth:`KVCacheEngine.generate`:

1. **Admit** waiting prompts into free slots (lowest first). A prompt is prefilled once, in one
   compiled call for a group of prompts, and its keys and values are copied into the slots of its
   ``n`` samples; the first token of each sample is drawn there too.
2. **Decode a round**: one compiled ``while_loop`` of up to ``steps_per_round`` steps over the
   occupied slots; each row stops at its own stop ids or budget, and the loop ends early once
   every row has. One host round trip per round, not per token.
3. **Collect** the rows that finished and free their slots; go back to 1 while prompts wait. A
   batch of mixed lengths therefore does not wait for its longest row: finished slots are refilled
   between rounds.

Shapes are bucketed so that compilations are few and cached: the decode round is compiled per
(slot prefix, attention window) pair, both powers of two; the prefill per (prompts, prompt
length, target slots) bucket. The cache's size comes from a memory budget (a fraction of the
device's free memory, :class:`KVCacheEngine`'s ``memory_fraction``).

Sampling keys are per row and depend only on the request (the seed and the prompt's index, or
the prompt's own seed), the sample's index and the token's index in the response, exactly as in
the dense sampler, so results do not depend on which slots or rounds a row ran in. The logits
come from :func:`~marin_rl_core.models.logprobs.tempered_logits`, the trainer's projection, so the
reported logprobs equal the trainer's up to float rounding.

Models: levanter's Llama family (``LlamaLMHeadModel`` and its subclasses: Llama, Qwen2 via
:class:`~marin_rl_core.models.build.Qwen2LMHeadModel`, Qwen3), with GQA, biased projections and
q/k norms as their attention modules have them.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import os
import threading
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from levanter.models.lm_model import LmHeadModel

from marin_rl_core.generation import GenerationRequest, Sample
from marin_rl_core.rollout.inference import Sampler, check_requests, committed
from marin_rl_core.rollout.kv_decode import (
    DecodeState,
    check_model,
    decode_round,
    kv_shape,
    prefill,
    refill,
)

logger = logging.getLogger(__name__)

MIN_WINDOW = 16
"""The smallest attention window (and prompt-length bucket) a compiled function is made for."""


def prompt_bucket(n: int, most: int) -> int:
    """A prefill's padded prompt length: a power of two up to 64 (at least
    :data:`MIN_WINDOW`), then a multiple of 32, capped at ``most``."""
    if n <= 64:
        return bucket(n, least=MIN_WINDOW, most=most)
    return min(-(-n // 32) * 32, most)


def bucket(n: int, *, least: int = 1, most: int | None = None) -> int:
    """``n`` rounded up to a power of two (at least ``least``), capped at ``most``."""
    size = least
    while size < n:
        size *= 2
    return size if most is None else min(size, most)


# --- the engine -----------------------------------------------------------------------------------


def free_device_bytes(device: Any) -> int:
    """Bytes free on ``device``: its allocator's limit less what is in use, or, for a CPU
    device (no allocator statistics), the host's available memory."""
    stats = None
    try:
        stats = device.memory_stats()
    except Exception:  # noqa: BLE001 - not every backend has statistics
        stats = None
    if stats and "bytes_limit" in stats:
        return int(stats["bytes_limit"]) - int(stats.get("bytes_in_use", 0))
    return int(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))


class KVCacheEngine(Sampler):
    """Generates ``n`` samples per prompt with a KV cache in slots; see the module docstring.

    Same interface and guarantees as the other samplers (``tests/test_inference.py`` holds them
    all to the same tests): ``result[i][k]`` is the ``k``-th sample of prompt ``i``; the seed (or
    ``prompt_seeds``) fixes the samples; logprobs are of the tempered distribution and equal the
    trainer's.

    Args:
        model, max_seq_len, eos_id, max_stop_tokens, compute_dtype, mesh, axis_mapping: as for
            :class:`~marin_rl_core.rollout.inference.SamplingEngine`.
        max_seqs: the most slots (rows decoded at once); fewer when the memory budget holds
            fewer.
        memory_fraction: the share of the device's free memory (after the weights) the engine
            may take: a copy of the decoder layers' weights while it decodes, then the KV cache
            and logits of as many slots as fit (up to ``max_seqs``).
        steps_per_round: decode steps per host round trip while prompts wait for a slot (with
            none waiting a round runs until its rows are done).
        max_prefill_tokens: prompt tokens (padded) prefilled in one call.
    """

    name = "kv"
    in_flight_weights = True
    """:meth:`update_model` may be called from another thread while rows decode: the new
    weights take effect at the next round (or prefill), rows in flight go on with them, and each
    :class:`~marin_rl_core.generation.Sample` says which weight steps sampled it."""

    def __init__(
        self,
        model: LmHeadModel,
        *,
        max_seq_len: int,
        eos_id: int,
        max_seqs: int = 256,
        max_stop_tokens: int = 4,
        compute_dtype: Any = jnp.float32,
        mesh: Any = None,
        axis_mapping: Any = None,
        memory_fraction: float = 0.5,
        steps_per_round: int = 32,
        max_prefill_tokens: int = 8192,
        **_: Any,
    ) -> None:
        check_model(model)
        super().__init__(
            model,
            max_seq_len=max_seq_len,
            eos_id=eos_id,
            max_stop_tokens=max_stop_tokens,
            compute_dtype=compute_dtype,
            mesh=mesh,
            axis_mapping=axis_mapping,
        )
        self.steps_per_round = max(1, int(steps_per_round))
        self.max_prefill_tokens = max(int(max_prefill_tokens), max_seq_len)
        layers, kv_heads, head_size = kv_shape(model)
        per_slot = 2 * layers * max_seq_len * kv_heads * head_size * self.compute_dtype.itemsize
        per_slot += max_seq_len * 8  # tokens and logprobs
        per_slot += 2 * 4 * model.Vocab.size  # a decode step's float32 logits, and their scaling
        # A decode round holds one copy of the decoder layers' weights (kv_decode._layers).
        layer_bytes = sum(
            x.nbytes for x in jax.tree.leaves(self._model.transformer.layers) if eqx.is_array(x)
        )
        free = free_device_bytes(jax.devices()[0])
        budget = int(memory_fraction * free) - layer_bytes
        fits = max(budget, 0) // per_slot
        if fits < 1:
            from marin_rl_core.errors import ConfigError

            # A job's set-up error, before any step (a colocated trainer's state is in `free`).
            raise ConfigError(
                f"the kv engine needs {per_slot / 2**20:.1f} MiB per sequence of {max_seq_len} "
                f"tokens (its KV cache and logits) and {layer_bytes / 2**20:.0f} MiB for a copy "
                f"of the decoder layers, but its budget is {memory_fraction * free / 2**20:.0f} "
                f"MiB ({memory_fraction} of the device's {free / 2**20:.0f} MiB free): raise "
                "model.inference_memory_fraction or lower model.max_seq_len (a colocated job: "
                "or make the trainer's state smaller, docs/colocation.md#sizing-memory)"
            )
        self.max_seqs = int(min(max_seqs, fits))
        self.cache_bytes = self.max_seqs * per_slot
        self._state: DecodeState | None = None
        # The host's copy of each slot's progress, read back after every prefill and round.
        self._done = np.ones(self.max_seqs, bool)
        self._lengths = np.ones(self.max_seqs, np.int32)
        self._ends = np.ones(self.max_seqs, np.int32)
        # The weights and their step, swapped together (update_model may run on another thread).
        self._weights_lock = threading.Lock()
        self._weight_step: int | None = None
        self._version = 0  # bumped by every update_model
        self._slot_version = np.zeros(self.max_seqs, np.int64)  # the weights of each slot's cache
        self._first_step = np.zeros(self.max_seqs, np.int64)  # each slot's oldest weight step
        self._last_step = np.zeros(self.max_seqs, np.int64)  # and newest
        self.rounds = 0  # decode rounds run, for benches and tests
        self.prefills = 0
        self.refills = 0  # groups of rows whose caches new weights recomputed

    @property
    def slots(self) -> int:
        return self.max_seqs

    def update_model(self, model: LmHeadModel, *, weight_step: int | None = None) -> None:
        """Sample from ``model`` (the weights of trainer step ``weight_step``) from the next
        prefill or decode round on, even while a call decodes (see :attr:`in_flight_weights`).
        Placing the new weights happens on the caller's thread; rows in flight are not
        drained."""
        model = self._checked(model)
        with self._weights_lock:
            self._model, self._weight_step = model, weight_step
            self._version += 1

    def _weights(self) -> tuple[LmHeadModel, int | None, int]:
        with self._weights_lock:
            return self._model, self._weight_step, self._version

    def _empty_state(self) -> DecodeState:
        layers, kv_heads, head_size = kv_shape(self._model)
        c, s = self.max_seqs, self.max_seq_len
        shape = (c, kv_heads, s, head_size)
        keys_shape = (c, kv_heads, head_size, s)

        @jax.jit
        def make() -> DecodeState:
            return DecodeState(
                k=tuple(jnp.zeros(keys_shape, self.compute_dtype) for _ in range(layers)),
                v=tuple(jnp.zeros(shape, self.compute_dtype) for _ in range(layers)),
                tokens=jnp.zeros((c, s), jnp.int32),
                logprobs=jnp.zeros((c, s), jnp.float32),
                length=jnp.ones(c, jnp.int32),
                end=jnp.ones(c, jnp.int32),
                prompt_len=jnp.zeros(c, jnp.int32),
                done=jnp.ones(c, bool),
                temperature=jnp.ones(c, jnp.float32),
                stops=jnp.zeros((c, self.max_stop_tokens), jnp.int32),
                keys=jnp.zeros((c, 2), jnp.uint32),
            )

        with self._on_mesh():
            state = make()
        sharding = self._cache_sharding(kv_heads)
        if sharding is None:
            # Committed, as the state every prefill and round returns is: the first prefill
            # then runs the program the later ones run (see Sampler._place).
            return jax.tree.map(committed, state)
        return dataclasses.replace(
            state,
            k=tuple(jax.device_put(x, sharding) for x in state.k),
            v=tuple(jax.device_put(x, sharding) for x in state.v),
        )

    def _cache_sharding(self, kv_heads: int) -> Any:
        """The caches split over the devices the model's key/value heads are split over
        (tensor parallelism), or ``None``: one device, or heads that do not divide."""
        axis = self.axis_mapping.get("kv_head")
        if self.mesh is None or axis is None:
            return None
        if kv_heads % self.mesh.shape[axis]:
            return None
        from jax.sharding import NamedSharding, PartitionSpec

        return NamedSharding(self.mesh, PartitionSpec(None, axis, None, None))

    def generate(self, requests: Sequence[GenerationRequest]) -> list[list[Sample]]:
        """Sample every request (each with its own settings) through the slots: continuous
        batching over all of them. ``result[i][k]`` is the ``k``-th sample of ``requests[i]``."""
        future: concurrent.futures.Future[list[list[Sample]]] = concurrent.futures.Future()
        future.set_running_or_notify_cancel()
        given = [(requests, future)]
        self._serve(lambda: [given.pop()] if given else [], streaming=False)
        return future.result()

    def serve(self, poll: Callable[[], Sequence[tuple[Sequence[GenerationRequest], Any]]]) -> None:
        """Serve submissions until none waits and no slot is busy: ``poll()`` (called before
        every round) returns the ``(requests, future)`` pairs submitted since, and each future
        gets its samples as soon as its own last row finishes, while rows of later submissions
        still decode. A submission the engine refuses gets the ``ValueError`` alone. The
        :class:`~marin_rl_core.rollout.generation_queue.GenerationQueue` drives an engine that
        has this method this way: a request that arrives while others decode joins them at the
        next round instead of waiting for the whole call."""
        self._serve(poll, streaming=True)

    def _serve(self, poll: Callable[[], Any], *, streaming: bool) -> None:
        requests: list[GenerationRequest] = []
        stops_of: list[list[int]] = []
        place: list[tuple[_Submission, int]] = []  # each request's submission and index in it
        live_subs: list[_Submission] = []
        waiting: deque[int] = deque()
        owner: list[tuple[int, int] | None] = [None] * self.max_seqs
        if self._state is None:
            self._state = self._empty_state()
        try:
            with self._on_mesh():
                while True:
                    for given, future in poll():
                        given = list(given)
                        try:
                            stops = check_requests(
                                given, eos_id=self.eos_id, max_seqs=self.max_seqs,
                                max_stop_tokens=self.max_stop_tokens,
                                max_seq_len=self.max_seq_len,
                            )  # fmt: skip
                        except ValueError as exc:
                            future.set_exception(exc)
                            continue
                        sub = _Submission(given, future)
                        if not given:
                            future.set_result([])
                            continue
                        live_subs.append(sub)
                        for i, request in enumerate(given):
                            waiting.append(len(requests))
                            requests.append(request)
                            stops_of.append(stops[i])
                            place.append((sub, i))
                    if not waiting and all(o is None for o in owner):
                        return
                    self._admit(requests, stops_of, waiting, owner)
                    self._round(owner, more_coming=streaming or bool(waiting))
                    self._collect(requests, stops_of, place, owner)
        except BaseException as exc:
            # The device state may be half-donated: start from a fresh one next time, and let
            # every unfinished submission know.
            self._state = None
            self._done[:] = True
            for sub in live_subs:
                if not sub.future.done():
                    sub.future.set_exception(exc)
            if not streaming:
                raise

    def _round(self, owner: list[tuple[int, int] | None], *, more_coming: bool) -> None:
        """One decode round of the occupied slots: up to ``steps_per_round`` steps while more
        may come (prompts wait, or a queue feeds the engine), else until every row is done."""
        occupied = [i for i, o in enumerate(owner) if o is not None]
        if not occupied:
            return
        rows = bucket(occupied[-1] + 1, least=8, most=self.max_seqs)
        lengths = self._lengths[:rows]
        live = [i for i in occupied if not self._done[i]]
        if not live:
            return
        left = max(int(self._ends[i] - lengths[i]) for i in live)
        steps = min(self.steps_per_round, left) if more_coming else left
        reach = max(int(lengths[i]) for i in live) + steps
        window = bucket(reach, least=MIN_WINDOW, most=self.max_seq_len)
        model, step, version = self._weights()
        stale = [i for i in live if self._slot_version[i] != version]
        if stale:
            self._refill(model, stale)
            self._slot_version[stale] = version
        self._state, done, length = decode_round(
            model, self._state, jnp.asarray(steps, jnp.int32), rows=rows, window=window
        )
        if step is not None:
            self._last_step[live] = step
        self.rounds += 1
        done, length = jax.device_get((done, length))
        self._done[:rows], self._lengths[:rows] = done, length

    def _refill(self, model: LmHeadModel, slots: list[int]) -> None:
        """New weights arrived while ``slots`` decode: recompute their cached keys and values
        with them (one prefill of their tokens so far, in groups within the prefill budget), so
        that what they sample next is what the new weights sample given their tokens."""
        width = prompt_bucket(max(int(self._lengths[i]) - 1 for i in slots), self.max_seq_len)
        group = max(1, self.max_prefill_tokens // width)
        for at in range(0, len(slots), group):
            chunk = slots[at : at + group]
            padded = np.full(bucket(len(chunk)), self.max_seqs, np.int32)
            padded[: len(chunk)] = chunk
            self._state = refill(model, self._state, jnp.asarray(padded), width=width)
            self.refills += 1

    def _admit(
        self,
        requests: Sequence[GenerationRequest],
        stops_of: list[list[int]],
        waiting: deque[int],
        owner: list[tuple[int, int] | None],
    ) -> None:
        """Prefill as many waiting requests as fit in the free slots and the prefill budget."""
        free = [i for i, o in enumerate(owner) if o is None]
        taken: list[int] = []
        width = 0
        while waiting and requests[waiting[0]].n <= len(free) - sum(requests[r].n for r in taken):
            longest = max(width, len(requests[waiting[0]].prompt))
            padded = prompt_bucket(longest, self.max_seq_len)
            if taken and bucket(len(taken) + 1) * padded > self.max_prefill_tokens:
                break
            width = longest
            taken.append(waiting.popleft())
        if not taken:
            return
        n_prompts = bucket(len(taken))
        padded = prompt_bucket(width, self.max_seq_len)
        prompts = np.zeros((n_prompts, padded), np.int32)
        prompt_len = np.ones(n_prompts, np.int32)
        rows = [(p, r, k) for p, r in enumerate(taken) for k in range(requests[r].n)]
        m = bucket(len(rows))
        slots = np.full(m, self.max_seqs, np.int32)  # padding rows are dropped
        source = np.zeros(m, np.int32)
        end = np.ones(m, np.int32)
        temperature = np.ones(m, np.float32)
        stops = np.zeros((m, self.max_stop_tokens), np.int32)
        seed = np.zeros(m, np.uint32)
        fold = np.full(m, -1, np.int32)
        sample = np.zeros(m, np.int32)
        for p, r in enumerate(taken):
            prompt = requests[r].prompt
            prompts[p, : len(prompt)] = prompt
            prompt_len[p] = len(prompt)
        for j, (p, r, k) in enumerate(rows):
            request = requests[r]
            slot = free[j]
            owner[slot] = (r, k)
            slots[j], source[j], sample[j] = slot, p, k
            budget = min(request.max_tokens, self.max_seq_len - len(request.prompt))
            end[j] = len(request.prompt) + max(budget, 1)
            temperature[j] = request.temperature
            own = stops_of[r]
            stops[j] = own[0]
            stops[j, : len(own)] = own
            seed[j], fold[j] = request.seed, request.fold
            self._done[slot] = False
            self._lengths[slot] = len(request.prompt) + 1
            self._ends[slot] = end[j]
        model, step, version = self._weights()
        self._slot_version[slots[slots < self.max_seqs]] = version
        if step is not None:
            self._first_step[slots[slots < self.max_seqs]] = step
            self._last_step[slots[slots < self.max_seqs]] = step
        self._state = prefill(
            model,
            self._state,
            *(
                jnp.asarray(a)
                for a in (
                    prompts,
                    prompt_len,
                    slots,
                    source,
                    end,
                    temperature,
                    stops,
                    seed,
                    fold,
                    sample,
                )  # fmt: skip
            ),
        )
        self.prefills += 1
        # A row may be done at its first token (a stop, or a budget of one).
        done = np.asarray(jax.device_get(self._state.done))
        self._done[:] = done

    def _collect(
        self,
        requests: Sequence[GenerationRequest],
        stops_of: list[list[int]],
        place: list[tuple[_Submission, int]],
        owner: list[tuple[int, int] | None],
    ) -> None:
        """Free the slots of finished rows; hand each submission whose rows are all done its
        samples."""
        finished = [i for i, o in enumerate(owner) if o is not None and self._done[i]]
        if not finished:
            return
        assert self._state is not None
        tokens, logprobs = jax.device_get((self._state.tokens, self._state.logprobs))
        for slot in finished:
            r, k = owner[slot]  # type: ignore[misc]
            begin = len(requests[r].prompt)
            end = int(self._lengths[slot])
            response = np.asarray(tokens[slot, begin:end], np.int32)
            sub, i = place[r]
            sub.results[i][k] = Sample(
                tokens=response,
                logprobs=np.asarray(logprobs[slot, begin:end], np.float32),
                stopped=response.size > 0 and int(response[-1]) in stops_of[r],
                weight_steps=None
                if self._weight_step is None
                else (int(self._first_step[slot]), int(self._last_step[slot])),
            )
            sub.left -= 1
            if sub.left == 0:
                sub.future.set_result(sub.results)
            owner[slot] = None


class _Submission:
    """The requests of one ``submit`` (or ``generate`` call), their samples as they finish, and
    the future waiting for all of them."""

    def __init__(self, requests: list[GenerationRequest], future: Any):
        self.future = future
        self.results: list[list[Any]] = [[None] * r.n for r in requests]
        self.left = sum(r.n for r in requests)


__all__ = ["KVCacheEngine", "free_device_bytes"]
