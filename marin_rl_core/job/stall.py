"""Why a job made no progress: the report the driver's watch (:mod:`~marin_rl_core.job.watch`)
gives when no training step completed for ``faults.stall_timeout_s``, or when every problem of
the first :data:`FAIL_FAST_BATCHES` batches of each rollout worker was dropped: the trainer's
stage, the rollout side's counters, the likely cause with what to do, the logs and the resume
command."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from marin_rl_core.job.driver import RLJob

FAIL_FAST_BATCHES = 3
"""Before the first training step, a job whose every rollout worker dropped every problem of
this many batches in a row (and wrote none) stops at once, naming the cause."""


def stall_report(
    job: RLJob,
    trainer: Any,
    rollouts: list[Any],
    counters: list[dict[str, Any]],
    step: int,
    stalled: float,
    *,
    first_batches: bool = False,
) -> str:
    """Why no step completed at ``step`` after ``stalled`` seconds: asks the ``trainer`` actor
    for its diagnostics and each of the ``rollouts`` actors for its counters (kept in
    ``counters``, one dict per worker), each answer bounded by 30 s."""
    import ray

    config = job.config
    lines = [
        f"every problem of the first {FAIL_FAST_BATCHES} batches of each rollout worker was "
        f"dropped, so no training step can run; the job stopped at step {step}."
        if first_batches
        else f"no training step completed for {stalled:.0f} s (faults.stall_timeout_s = "
        f"{config.faults.stall_timeout_s:g}); the job stopped at step {step} with a "
        f"checkpoint."
    ]
    try:
        diag = ray.get(trainer.diagnostics.remote(), timeout=30)
        lines.append(
            f"  trainer: {diag['stage']} for {diag['stage_seconds']:.0f} s; it has read "
            f"{diag['rollouts_read']} rollouts, {diag['rollouts_in_buffer']} wait in the "
            f"replay buffer, {diag['dropped_stale']} were dropped as stale"
        )
    except Exception as exc:  # noqa: BLE001 - a report, not a control path
        diag = {}
        lines.append(f"  trainer: no answer ({type(exc).__name__})")
    totals: dict[str, int] = {}
    for i, w in enumerate(rollouts):
        try:
            counters[i] = ray.get(w.counters.remote(), timeout=30)
        except Exception:  # noqa: BLE001
            continue
        for k, v in counters[i].items():
            if isinstance(v, int) and k != "weight_step":
                totals[k] = totals.get(k, 0) + v
    last_error = next((c["last_env_error"] for c in counters if c and c.get("last_env_error")), "")
    limit = config.model.max_seq_len - 1
    lines.append(
        f"  rollout workers: {totals.get('batches_sampled', 0)} batches sampled, "
        f"{totals.get('batches_written', 0)} written to storage; "
        f"{totals.get('prompts_too_long', 0)} prompts dropped as longer than {limit} tokens, "
        f"{totals.get('env_errors', 0)} problems dropped for env errors, "
        f"{totals.get('env_timeouts', 0)} episodes cut off by env timeouts, "
        f"{totals.get('write_errors', 0)} storage write errors (retried)"
    )
    recent = totals.get("recent_empty_batches", 0)
    if diag.get("storage"):
        lines.append(f"  rollout storage: {diag['storage']}")
    if diag.get("storage") and diag.get("stage") == "waiting for rollouts":
        cause = (
            f"the rollout storage is slow or does not answer ({diag['storage']}): check "
            "that the bucket is reachable from every machine; for a slow one raise "
            "storage.call_timeout_s"
        )
    elif totals.get("weight_errors", 0) and (
        totals.get("batches_sampled", 0) == 0 or diag.get("stage") == "publishing weights"
    ):
        weight_error = next(
            (c["last_weight_error"] for c in counters if c and c.get("last_weight_error")),
            "see the logs",
        )
        cause = (
            f"the rollout workers cannot receive weights from the trainer's weight server "
            f"({totals['weight_errors']} failed receives, retried with backoff; latest: "
            f"{weight_error}): check that the workers can reach "
            f"{job.config.weight_transfer.name}'s address (host/advertise_host) and "
            "the trainer's log"
        )
    elif totals.get("batches_sampled", 0) == 0:
        cause = (
            "the rollout workers have not finished a batch: they may still be compiling, or "
            "be stuck; their logs say which"
        )
    elif recent and totals.get("prompts_too_long", 0):
        cause = (
            f"the last {recent} batches were all dropped: prompts longer than {limit} tokens "
            f"(model.max_seq_len = {config.model.max_seq_len}). Raise model.max_seq_len or "
            "give the env shorter prompts"
        )
    elif recent and totals.get("env_errors", 0):
        cause = (
            f"the last {recent} batches were all dropped: the env failed on every problem "
            f"(latest: {last_error or 'see the logs'}; the first error of each lesson, with "
            "its traceback, is in the rollout workers' logs)"
        )
    elif recent and totals.get("env_timeouts", 0):
        cause = (
            f"the last {recent} batches were all dropped: the env's calls timed out "
            f"(episodes.step_timeout_s = {config.episodes.step_timeout_s:g}, "
            f"episode_timeout_s = {config.episodes.episode_timeout_s:g}; latest: "
            f"{last_error or 'see the logs'}). Fix the env's hanging call, or raise the "
            "timeouts if it is only slow"
        )
    elif totals.get("write_errors", 0) and not totals.get("batches_written", 0):
        cause = (
            f"writing to rollout storage keeps failing ({totals['write_errors']} errors, "
            "retried with backoff): the rollout workers' logs name the error"
        )
    elif diag.get("dropped_by_loss") and not diag.get("rollouts_in_buffer"):
        cause = (
            f"the loss dropped every group that arrived ({diag['dropped_by_loss']} "
            "rollouts): within each group the rewards are all equal "
            "(loss.drop_zero_variance_groups): every sample of a problem succeeds or every "
            "one fails, or a group has one sample. Turn it off, raise "
            "sampling.n_generations_per_prompt, or start from lessons the policy solves "
            "some of the time"
        )
    elif diag.get("dropped_stale"):
        cause = (
            "rollouts arrive too stale for the trainer: raise "
            "replay_buffer.max_rollout_step_delay or lower trainer.sync_interval_steps"
        )
    elif diag.get("stage") == "in a training step":
        cause = "the training step itself is slow or stuck; see the trainer's log"
    else:
        cause = "the logs say more"
    lines.append(f"  likely cause: {cause}.")
    lines.append(f"  logs: {job.local_dir / 'logs'}")
    lines.append(f"  once fixed, resume with `{job.resume_command()}`")
    return "\n".join(lines)
