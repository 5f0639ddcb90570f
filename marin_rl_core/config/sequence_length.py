"""The ``model.max_seq_len`` a run on a Hugging Face checkpoint gets when it sets none: derived
from its lessons' prompts (rendered by the run's tokenizer and chat template) and ``max_tokens``."""

from __future__ import annotations

from marin_rl_core.config.converter import lesson_env_config
from marin_rl_core.config.schema import RLJobConfig
from marin_rl_core.errors import ConfigError
from marin_rl_core.models.pretrained import context_length, read_pretrained_info
from marin_rl_core.models.tokenizer import encode_prompt, model_tokenizer
from marin_rl_core.registry import Registry

SEQ_LEN_PROBLEMS = 32
"""Problems per lesson and mode that :func:`derive_max_seq_len` renders to find the longest
prompt."""


def derive_max_seq_len(config: RLJobConfig, registry: Registry) -> tuple[int, str]:
    """The ``model.max_seq_len`` a run on a Hugging Face checkpoint gets when it sets none:
    ``(value, a sentence saying where it comes from)``.

    Each lesson's env poses :data:`SEQ_LEN_PROBLEMS` training and as many eval problems; their
    prompts go through the tokenizer (and chat template) the run uses. A lesson needs its
    longest prompt plus a quarter (at least 8 tokens) for prompts not sampled, plus its
    ``max_tokens`` (train or eval, whichever is larger) once per turn for a multi-turn env
    (``episodes.max_turns`` turns). The run gets the largest need, rounded up to a multiple of
    16 and at most the checkpoint's context length.

    Raises:
        ConfigError: the tokenizer does not load, or an env fails to build or pose problems
            (the message says to set ``model.max_seq_len`` explicitly).
    """
    read_pretrained_info(config.model.checkpoint)  # exists, and an architecture marinrl trains
    try:
        tokenizer = model_tokenizer(config.model)
    except ValueError as exc:
        raise ConfigError(f"$.model.tokenizer: {exc}") from None
    chat = config.model.use_chat_template
    need, longest, where = 0, 0, ""
    for lesson in config.curriculum.lessons:
        name, env_config = lesson_env_config(config, lesson, registry)
        env = None
        try:
            env = registry.get("env", name).build(env_config)
            turns = config.episodes.max_turns if callable(getattr(env, "reset", None)) else 1
            prompts = [
                len(encode_prompt(tokenizer, problem, use_chat_template=chat))
                for mode in ("train", "eval")
                for problem in env.sample_problems(SEQ_LEN_PROBLEMS, mode=mode, seed=0)
            ]
        except Exception as exc:  # noqa: BLE001 - any env failure gets the same advice
            raise ConfigError(
                "model.max_seq_len is derived from the lessons' prompts when a checkpoint is "
                f"used, but lesson {lesson.id!r} (env {name}) failed while posing problems "
                f"({type(exc).__name__}: {exc}). Set model.max_seq_len (prompt tokens + "
                "max_tokens) with --set model.max_seq_len=N, or fix the env"
            ) from None
        finally:
            stop = getattr(env, "shutdown", None)  # close(episode) is per episode
            if callable(stop):
                stop()
        if not prompts:
            continue
        tokens = max(
            config.sampling_for(lesson).max_tokens, config.eval_sampling_for(lesson).max_tokens
        )
        top = max(prompts)
        lesson_need = top + max(8, top // 4) + tokens * turns
        if lesson_need > need:
            need, longest, where = lesson_need, top, lesson.id
    value = -(-max(need, 16) // 16) * 16
    limit = context_length(config.model)
    capped = limit is not None and value > limit
    if capped:
        value = limit  # type: ignore[assignment]
    return value, (
        f"model.max_seq_len = {value}: derived from the lessons' prompts (the longest sampled "
        f"prompt has {longest} tokens, lesson {where}) and max_tokens"
        + (f", capped at the checkpoint's context length ({limit})" if capped else "")
        + "; set model.max_seq_len to choose another"
    )


__all__ = ["SEQ_LEN_PROBLEMS", "derive_max_seq_len"]
