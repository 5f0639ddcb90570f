"""What a generation engine is asked and what it answers: :class:`GenerationRequest`,
:class:`Sample`, and :class:`EngineSpec` (what an engine is built with). The engine contract
itself is :class:`~marin_rl_core.protocols.GenerationEngine`.

A leaf module (numpy and attrs only), like :mod:`marin_rl_core.types`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import attrs
import numpy as np


def _ints(value: Any) -> tuple[int, ...]:
    return tuple(int(v) for v in value)


@attrs.frozen(kw_only=True)
class GenerationRequest:
    """``n`` samples of one prompt, with sampling settings of its own (requests of one call may
    differ in all of them).

    Args:
        prompt: the prompt's token ids.
        n: samples of it.
        temperature: softmax temperature; 0 is greedy.
        max_tokens: the most tokens of one response (an engine lowers it to fit its
            ``max_seq_len``).
        stop_tokens: ids that end a response; the engine's EOS always does.
        seed, fold: the sampling key of the request: ``fold_in(PRNGKey(seed), fold)`` (no fold
            when ``fold < 0``). The same key, prompt and weights give the same samples, whatever
            else is in the call.
    """

    prompt: tuple[int, ...] = attrs.field(converter=_ints)
    n: int = 1
    temperature: float = 1.0
    max_tokens: int = 16
    stop_tokens: tuple[int, ...] = attrs.field(default=(), converter=_ints)
    seed: int = 0
    fold: int = -1


def requests_for(
    prompts: Sequence[Sequence[int]],
    *,
    n: int = 1,
    temperature: float = 1.0,
    max_tokens: int = 16,
    stop_tokens: Sequence[int] = (),
    seed: int = 0,
    prompt_seeds: Sequence[int] | None = None,
) -> list[GenerationRequest]:
    """One request per prompt with shared settings: keyed by ``seed`` and the prompt's index, or
    by each prompt's own seed (``prompt_seeds``: its samples then do not depend on the other
    prompts of the call)."""
    if prompt_seeds is not None and len(prompt_seeds) != len(prompts):
        raise ValueError(f"{len(prompt_seeds)} prompt_seeds for {len(prompts)} prompts")
    return [
        GenerationRequest(
            prompt=prompt,
            n=n,
            temperature=temperature,
            max_tokens=max_tokens,
            stop_tokens=stop_tokens,
            seed=(seed if prompt_seeds is None else int(prompt_seeds[i])) % 2**32,
            fold=i if prompt_seeds is None else -1,
        )
        for i, prompt in enumerate(prompts)
    ]


@attrs.frozen(eq=False)
class Sample:
    """One sampled response.

    Args:
        tokens: int32 response tokens, ending with the stop token when one was hit.
        logprobs: float32, the sampling distribution's logprob of each token (tempered:
            ``log_softmax(logits / T)``; untempered for greedy rows).
        stopped: whether the response ended with a stop token (``False``: it hit its budget;
            the rollout is then *truncated*).
        weight_steps: ``(oldest, newest)``: the weight steps that sampled its tokens, from an
            engine that takes new weights while rows decode (``in_flight_weights``); ``None``:
            one set of weights sampled it, the one the caller gave the engine before the call.
    """

    tokens: np.ndarray
    logprobs: np.ndarray
    stopped: bool
    weight_steps: tuple[int, int] | None = None


@attrs.frozen(kw_only=True)
class EngineSpec:
    """What the rollout side builds a generation engine with (an engine plugin's ``build(config,
    spec)`` gets it).

    Args:
        model: the policy: a levanter ``LmHeadModel`` in the trainer's parameter structure.
        max_seq_len: the most tokens (prompt + response) of one sequence.
        eos_id: the tokenizer's end-of-sequence id, always a stop token.
        max_seqs: the most sequences one ``generate`` call asks for at once (an engine may
            serve more in several passes).
        max_stop_tokens: the most stop ids (EOS included) a request has.
        compute_dtype: ``"float32"`` or ``"bfloat16"``: the dtype to run in
            (``model.inference_dtype``).
        mesh, axis_mapping: the device mesh and levanter axis mapping to shard the model over
            (tensor parallelism, ``model.inference_tensor_parallel``); ``None``: one device.
        memory_fraction: the share of the device's free memory (after the weights) the engine
            may use for its caches (``model.inference_memory_fraction``).
        platform: JAX's platform of the devices (``cpu``, ``gpu``, ``tpu``).
        build_engine: ``build_engine(name)`` builds another registered engine with its default
            config and this spec (the ``auto`` engine picks one this way).
    """

    model: Any
    max_seq_len: int
    eos_id: int
    max_seqs: int = 256
    max_stop_tokens: int = 4
    compute_dtype: str = "float32"
    mesh: Any = None
    axis_mapping: Any = None
    memory_fraction: float = 0.5
    platform: str = "cpu"
    build_engine: Callable[[str], Any] | None = None

    def engine_kwargs(self) -> dict[str, Any]:
        """The keyword arguments marinrl's built-in engines take."""
        return {
            "max_seq_len": self.max_seq_len,
            "eos_id": self.eos_id,
            "max_seqs": self.max_seqs,
            "max_stop_tokens": self.max_stop_tokens,
            "compute_dtype": self.compute_dtype,
            "mesh": self.mesh,
            "axis_mapping": self.axis_mapping,
        }


__all__ = ["EngineSpec", "GenerationRequest", "Sample", "requests_for"]
