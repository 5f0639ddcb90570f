"""``[faults]`` and ``[episodes]``: how a running job meets faults, and the limits on each
episode the rollout side runs (re-exported by :mod:`marin_rl_core.config.schema`)."""

from __future__ import annotations

import attrs

__all__ = ["EpisodesConfig", "FaultsConfig"]


@attrs.frozen(kw_only=True)
class FaultsConfig:
    """How a running job meets faults (docs/faults.md).

    Args:
        stall_timeout_s: the watchdog stops the job (exit code 12, with a final checkpoint) when
            no training step completes for this long, and names the stalled stage and the
            counters that explain it. The first step's wait includes compiling; 0 turns the
            watchdog off.
        worker_restarts: times each rollout worker may be restarted after its process dies
            (Ray restarts the actor; the job goes on). One more death stops the job (exit 13)
            with a final checkpoint.
        restart_backoff_s: wait before handing a restarted worker its work again, doubled at
            each restart of the same worker.
        stop_timeout_s: on Ctrl-C, SIGTERM or a fatal error, how long the trainer gets to write
            its final checkpoint and the workers to stop before the job ends without them.
    """

    stall_timeout_s: float = attrs.field(default=600.0, validator=attrs.validators.ge(0))
    worker_restarts: int = attrs.field(default=3, validator=attrs.validators.ge(0))
    restart_backoff_s: float = attrs.field(default=1.0, validator=attrs.validators.ge(0))
    stop_timeout_s: float = attrs.field(default=120.0, validator=attrs.validators.gt(0))


@attrs.frozen(kw_only=True)
class EpisodesConfig:
    """Limits on each episode the rollout side runs (multi-turn envs; a single-turn env's
    episode is one step). See :mod:`marin_rl_core.rollout.episodes`.

    Args:
        max_turns: actions per episode; an episode still going after this many ends truncated
            (and is trained on). The whole episode also shares ``model.max_seq_len`` tokens.
        step_timeout_s: the longest one env call (``reset``, ``step``, a single-turn env's
            ``score``) may take before it is cut off and its episode fails (counted in
            ``rollout/env_timeouts``); 0 means no limit.
        episode_timeout_s: the longest one episode may take, generation included; 0 means no
            limit.
        generation_cohorts: a multi-turn env's episodes are generated in up to this many
            batches per turn, so that one cohort's env steps (a tool call, a sandbox) overlap
            another's generation; 1 generates every waiting episode at once (lock-step turns).
            Single-turn envs always take one generation call.
        env_processes: build each lesson's env in this many processes of its own, so that an
            env that crashes, hangs or burns CPU cannot take the rollout worker down (a dead
            process fails its episodes and is started again; ``rollout/env_process_restarts``).
            An agent env's programs run there too, each process running its episodes' agents at
            once: their ``openai`` clients then take no CPU time or interpreter lock from the
            worker's sampler (docs/agents.md). 0 runs envs in the rollout worker's process.
        env_threads: plain (not ``async``) ``reset`` and ``step`` calls of different episodes
            run on up to this many threads at once, so that one slow or hung call holds up
            only its own episode; 0 (the default) gives each episode of a batch a thread, so
            the timeouts of hung calls all run at once rather than in waves. A call cut off by
            its timeout keeps its thread (Python cannot stop it) until it returns, if ever; the
            runner starts another, and stops using the env (failing its episodes, with a
            message) while :data:`~marin_rl_core.rollout.env_threads.MAX_HUNG_THREADS` threads are stuck.
            1 makes an env see one call at a time: for envs whose episodes share state that is
            not thread-safe. A single-turn env's ``score`` calls always run one at a time.
        max_episode_tokens: the most tokens the policy samples in one agent episode (all its
            calls together); 0: no limit but ``max_turns`` calls of ``model.max_seq_len``. An
            agent episode's calls are limited to ``max_turns`` as well (docs/agents.md).
        agent_host: the address the agent endpoint listens on (loopback: agents run on the
            rollout worker's machine; ``0.0.0.0`` to let agents elsewhere reach it).
        agent_port: its port; 0 picks a free one (each rollout worker has its own endpoint).
        agent_batch_window_s: how long an agent's call waits for other episodes' calls to be
            sampled with it, unless every running episode has a call waiting already.
        in_flight_weights: take the trainer's newer weights while a batch samples (every 0.5
            s), between decode rounds, without draining the rows in flight (engines that can:
            ``kv``); each rollout records the weight steps it spans and its staleness counts
            from the oldest. Off: new weights between batches only. docs/scaling.md.
    """

    max_turns: int = attrs.field(default=8, validator=attrs.validators.ge(1))
    step_timeout_s: float = attrs.field(default=60.0, validator=attrs.validators.ge(0))
    episode_timeout_s: float = attrs.field(default=600.0, validator=attrs.validators.ge(0))
    generation_cohorts: int = attrs.field(default=2, validator=attrs.validators.ge(1))
    env_processes: int = attrs.field(default=0, validator=attrs.validators.ge(0))
    env_threads: int = attrs.field(default=0, validator=attrs.validators.ge(0))
    max_episode_tokens: int = attrs.field(default=0, validator=attrs.validators.ge(0))
    agent_host: str = "127.0.0.1"
    agent_port: int = attrs.field(
        default=0, validator=[attrs.validators.ge(0), attrs.validators.le(65535)]
    )
    agent_batch_window_s: float = attrs.field(default=0.005, validator=attrs.validators.ge(0))
    in_flight_weights: bool = False
