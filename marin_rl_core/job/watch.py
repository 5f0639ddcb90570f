"""The driver's watch over a running job (:class:`Watch`): the progress bar, rollout worker
restarts, the stall watchdog, fail-fast when no prompt fits, and the orderly stop."""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

from marin_rl_core.errors import (
    MarinRLError,
    StalledError,
    WorkerLostError,
)
from marin_rl_core.job.checks import first_line, run_dir_error
from marin_rl_core.job.stall import FAIL_FAST_BATCHES, stall_report

if TYPE_CHECKING:
    from marin_rl_core.job.driver import RLJob

logger = logging.getLogger(__name__)
_UNSET: Any = object()


class Watch:
    """The driver's view of a running job: progress bar, watchdog, rollout worker restarts and
    bounded stops. Every wait here has a timeout; a dead actor is an error, never a hang."""

    def __init__(
        self,
        job: RLJob,
        trainer: Any,
        rollouts: list[Any],
        hub: Any,
        start: int,
        address: str,
        positions: dict[int, int],
    ):
        self.job, self.trainer, self.rollouts, self.hub = job, trainer, rollouts, hub
        self.faults = job.config.faults
        self.start = self.step = start
        self.train_run = trainer.run.remote()
        # A worker's run connects it to the trainer's weight server, starts it at the batch
        # after the last one the restored checkpoint received, and lets it ask the trainer
        # whether it is short of rollouts (pacing).
        self.run_args = [(address, positions.get(i, 0), trainer) for i in range(len(rollouts))]
        self.runs: dict[int, Any] = {
            i: w.run.remote(*self.run_args[i]) for i, w in enumerate(rollouts)
        }
        self.restarts = [0] * len(rollouts)
        self.due: dict[int, float] = {}  # worker index -> when to hand a restarted worker its run
        # Each worker's process id: a new one after a failed run is a restart (Ray restarts a
        # dead actor itself; a run may also fail while it is being restarted).
        self.pids: list[int | None] = [None] * len(rollouts)
        self.pid_refs: dict[int, Any] = {i: w.process.remote() for i, w in enumerate(rollouts)}
        self.counters: list[dict[str, Any]] = [{} for _ in rollouts]
        # The trainer's own step, asked once a second: train rows reach the metrics hub only
        # every logging.log_every steps, and a slow real-model step times log_every can exceed
        # faults.stall_timeout_s in a healthy job.
        self.step_ref: Any = trainer.step.remote()
        self.host_runs: dict[int, Any] = {}  # trainer host -> its follower's run
        self.host_lost = False

    def follow_hosts(self, followers: list[Any]) -> None:
        """Start the other hosts of a trainer group (``followers``: hosts 1, 2, ...) following
        process 0, and watch them: one that dies stops the job."""
        self.host_runs = {i: f.run.remote() for i, f in enumerate(followers, start=1)}

    def _trainer_step(self) -> int | None:
        """The trainer's step if its last answer has come (then asks again), else ``None``."""
        import ray

        if not ray.wait([self.step_ref], timeout=0)[0]:
            return None
        try:
            step = int(ray.get(self.step_ref))
        except Exception:  # noqa: BLE001 - a dead trainer is reported by its run's result
            return None
        self.step_ref = self.trainer.step.remote()
        return step

    # --- while training -----------------------------------------------------------------------

    def run(self, progress: bool) -> int:
        """Wait for the trainer to finish, driving the progress bar; returns its final step."""
        import ray
        from tqdm import tqdm

        total = self.job.config.trainer.num_train_steps
        bar = tqdm(
            total=total,
            initial=self.start,
            desc="train",
            unit="step",
            disable=not progress,
            dynamic_ncols=True,
        )
        last_progress = next_look = time.monotonic()
        try:
            while True:
                refs = [self.train_run, *self.runs.values(), *self.host_runs.values()]
                done, _ = ray.wait(refs, num_returns=1, timeout=1.0)
                latest = ray.get(self.hub.latest.remote(), timeout=60)
                if "write_error" in latest:  # metrics.jsonl cannot be written: stop, with why
                    failed = latest["write_error"]
                    raise run_dir_error(
                        OSError(failed["errno"], failed["strerror"], failed["path"]),
                        self.job.run_dir,
                        resumable=True,
                    )
                step = max(int(latest.get("train_step", self.start)), self._trainer_step() or 0)
                if step > self.step:
                    self.step, last_progress = step, time.monotonic()
                bar.update(max(0, step - bar.n))
                bar.set_postfix(_postfix(latest), refresh=False)
                for ref in done:
                    if ref is self.train_run:
                        final = self._trainer_result()
                        bar.update(max(0, final - bar.n))
                        return final
                    host = next((i for i, r in self.host_runs.items() if r is ref), None)
                    if host is not None:
                        self._host_ended(host)
                        continue
                    self._rollout_ended(next(i for i, r in self.runs.items() if r is ref))
                self._check_processes()
                self._hand_out_restarts()
                stalled = time.monotonic() - last_progress
                if self.faults.stall_timeout_s and stalled > self.faults.stall_timeout_s:
                    raise StalledError(self.stall_report(stalled))
                if self.step == self.start and time.monotonic() >= next_look:
                    next_look = time.monotonic() + 2.0
                    if self._nothing_can_succeed():
                        raise StalledError(self.stall_report(stalled, first_batches=True))
        finally:
            bar.close()

    def _host_ended(self, host: int) -> None:
        """Trainer host ``host``'s run ended: after process 0 stopped it (fine), with the error
        process 0 meets too, or with its process dead, which leaves the group unable to step."""
        import ray

        ref = self.host_runs.pop(host)
        try:
            ray.get(ref)
        except ray.exceptions.RayActorError as exc:
            self.host_lost = True
            hosts = self.job.config.resources.trainer_hosts
            raise WorkerLostError(
                f"trainer host {host} of {hosts} died at step {self.step} ({first_line(exc)}); "
                "the trainer cannot step without its shards, so the job stops (no final "
                f"checkpoint). Its last checkpoint is kept; resume with "
                f"`{self.job.resume_command()}` (on as many hosts, or another number: "
                f"--set resources.trainer_hosts=N). Its log: "
                f"{self.job.local_dir / 'logs' / f'trainer-{host}.log'}"
            ) from None

    def _trainer_result(self) -> int:
        import ray

        try:
            return int(ray.get(self.train_run))
        except Exception as exc:
            # Process 0 fails when another host of its group dies: name the host that died.
            if self.host_runs:
                done, _ = ray.wait(list(self.host_runs.values()), num_returns=1, timeout=10)
                for ref in done:
                    self._host_ended(next(i for i, r in self.host_runs.items() if r is ref))
            if not isinstance(exc, ray.exceptions.RayActorError):
                raise
            raise WorkerLostError(
                f"the trainer process died at step {self.step} ({first_line(exc)}). Its last "
                f"checkpoint is kept; resume with `{self.job.resume_command()}`. Its log: "
                f"{self.job.local_dir / 'logs' / 'trainer.log'}"
            ) from None

    def _trainer_ended(self, deadline: float) -> bool:
        """Whether the trainer's run has ended, or ends by ``deadline`` without the trainer
        answering a call first (a trainer that answers is alive: its run goes on)."""
        import ray

        try:
            ray.get(self.trainer.step.remote(), timeout=max(0.0, deadline - time.monotonic()))
            answered = True  # (its run may still have ended, with an error of its own)
        except Exception:  # noqa: BLE001 - dead (RayActorError) or not answering
            answered = False
        wait = 0.0 if answered else max(0.0, deadline - time.monotonic())
        return bool(ray.wait([self.train_run], timeout=wait)[0])

    def _rollout_ended(self, i: int) -> None:
        """Rollout worker ``i``'s run ended before training did. Its actor died or is being
        restarted: ask for its process (answered once Ray has it back); its own error: raise."""
        import ray

        ref = self.runs.pop(i)
        try:
            ray.get(ref)
        except ray.exceptions.RayActorError as exc:
            logger.warning("rollout worker %d's run failed: %s", i, first_line(exc))
            self.pid_refs[i] = self.rollouts[i].process.remote()
            return
        except Exception:
            # A worker that lost the trainer (its weight server gone) fails too: the trainer's
            # death, not the worker's symptom of it, is what the user must hear about. A trainer
            # that still answers is alive, and the error is the worker's own (a judge that is
            # down, an env whose every step fails): said at once, not after the 10 s a dead
            # trainer's run gets to end.
            if self._trainer_ended(deadline=time.monotonic() + 10):
                self._trainer_result()
            raise
        log = self.job.local_dir / "logs" / f"rollout-{i}.log"
        raise MarinRLError(
            f"rollout worker {i} stopped before training finished; see {log}"
        )  # a normal return before stop(): should not happen

    def _check_processes(self) -> None:
        """Match each worker's answered process id with the last one: a new process is a
        restart (counted, logged, bounded by ``faults.worker_restarts``), and a worker whose
        run failed gets its run again after the backoff."""
        import ray

        if not self.pid_refs:
            return
        refs = list(self.pid_refs.values())
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=0)
        for i, ref in list(self.pid_refs.items()):
            if ref not in ready:
                continue
            del self.pid_refs[i]
            log = self.job.local_dir / "logs" / f"rollout-{i}.log"
            try:
                pid = int(ray.get(ref))
            except ray.exceptions.ActorUnavailableError:
                self.pid_refs[i] = self.rollouts[i].process.remote()  # still restarting
                continue
            except ray.exceptions.RayActorError as exc:
                died = max(self.restarts[i] + 1, len(self._processes(i)))
                raise WorkerLostError(
                    f"rollout worker {i} died {died} times, more than "
                    f"faults.worker_restarts = {self.faults.worker_restarts} restarts allow "
                    f"({first_line(exc)}). The job stopped with a checkpoint; see {log}, then "
                    f"resume with `{self.job.resume_command()}`."
                ) from None
            previous, self.pids[i] = self.pids[i], pid
            if previous is None:
                # The first answer: the run handed out at the start waited for Ray's restarts
                # of a worker whose process died while setting up; count and log them.
                for dead in (p for p in self._processes(i) if p != pid):
                    self._restarted(i, dead, pid, "while setting up")
            if i in self.runs:
                continue  # a worker that is running
            delay = 0.0
            if previous is not None and pid != previous:
                delay = self._restarted(i, previous, pid)
            self.due[i] = time.monotonic() + delay

    def _processes(self, i: int) -> list[int]:
        """The processes rollout worker ``i`` has had (as they told the metrics hub)."""
        import ray

        try:
            return list(ray.get(self.hub.worker_processes.remote(i), timeout=10))
        except Exception:  # noqa: BLE001 - the count is for the message and the metric only
            return []

    def _restarted(self, i: int, dead: int, pid: int | None, when: str = "") -> float:
        """Count, log and record rollout worker ``i``'s restart (``pid``: its new process,
        ``None`` when training finished before it was back); returns the backoff before its
        work is handed back."""
        self.restarts[i] += 1
        delay = self.faults.restart_backoff_s * 2 ** (self.restarts[i] - 1)
        logger.warning(
            "rollout worker %d died%s (process %d); restart %d of %d (%s)%s",
            i,
            f" {when}" if when else "",
            dead,
            self.restarts[i],
            self.faults.worker_restarts,
            f"process {pid}" if pid is not None else "not waited for: training had finished",
            "" if when else f", its work handed back in {delay:.1f} s",
        )
        self.hub.log.remote(
            {"faults/rollout_worker_restarts": float(sum(self.restarts))},
            step=self.step,
            source="faults",
        )
        return delay

    def _hand_out_restarts(self) -> None:
        now = time.monotonic()
        for i, when in list(self.due.items()):
            if now >= when:
                del self.due[i]
                # Waits for Ray's restart.
                self.runs[i] = self.rollouts[i].run.remote(*self.run_args[i])

    def _nothing_can_succeed(self) -> bool:
        """Before the first step: every rollout worker has dropped every problem of its first
        :data:`FAIL_FAST_BATCHES` batches (prompts too long, the env raising or timing out on
        each) and written none. Nothing suggests the next batches would differ, so the job
        stops now rather than after ``faults.stall_timeout_s``."""
        import ray

        try:
            counters = ray.get([w.counters.remote() for w in self.rollouts], timeout=5)
        except Exception:  # noqa: BLE001 - a worker busy restarting: look again later
            return False
        return all(
            c.get("batches_written", 0) == 0
            and c.get("recent_empty_batches", 0) >= FAIL_FAST_BATCHES
            for c in counters
        )

    def stall_report(self, stalled: float, *, first_batches: bool = False) -> str:
        """Why no step completed (:func:`~marin_rl_core.job.stall.stall_report`)."""
        return stall_report(
            self.job, self.trainer, self.rollouts, self.counters, self.step, stalled,
            first_batches=first_batches,
        )  # fmt: skip

    # --- stopping -----------------------------------------------------------------------------

    def stop_trainer(self) -> int:
        """Ask the trainer to checkpoint and stop; wait at most ``faults.stop_timeout_s``."""
        import ray

        timeout = self.faults.stop_timeout_s
        if self.host_lost:  # a checkpoint needs every host: the last one is what is kept
            return self.step
        try:
            ray.get(self.trainer.stop.remote(), timeout=timeout)
            return int(ray.get(self.train_run, timeout=timeout))
        except ray.exceptions.GetTimeoutError:
            logger.error("the trainer did not stop within %.0f s (faults.stop_timeout_s)", timeout)
        except Exception as exc:  # noqa: BLE001 - already stopping for another reason
            logger.warning("the trainer could not stop cleanly: %s", first_line(exc))
        return self.step

    def stop_rollouts(self) -> list[dict[str, Any]]:
        """Stop every rollout worker; their counters (``{}`` for one that did not answer)."""
        import ray

        for w in self.rollouts:
            w.stop.remote()
        out: list[dict[str, Any]] = []
        deadline = time.monotonic() + self.faults.stop_timeout_s
        for i in range(len(self.rollouts)):
            ref = self.runs.get(i)
            if ref is None and i in self.pid_refs:  # its run failed; its restart not seen yet
                self._died_at_the_end(i, "its run failed")
                out.append(self.counters[i])
                continue
            try:
                if ref is None:
                    raise ValueError("not running")
                out.append(ray.get(ref, timeout=max(deadline - time.monotonic(), 0.1)))
            except ray.exceptions.RayActorError as exc:  # died in the last steps
                self._died_at_the_end(i, first_line(exc))
                out.append(self.counters[i])
            except Exception as exc:  # noqa: BLE001 - a stuck worker at the end
                logger.warning("rollout worker %d did not stop cleanly: %s", i, first_line(exc))
                out.append(self.counters[i])
        return out

    def _died_at_the_end(self, i: int, why: str) -> None:
        """Rollout worker ``i``'s process died while training finished, before the watch saw
        it (its restart, if Ray made one, had no work left): counted and logged as any death."""
        import ray

        ref = self.pid_refs.pop(i, None) or self.rollouts[i].process.remote()
        try:
            pid: int | None = int(ray.get(ref, timeout=10))
        except Exception:  # noqa: BLE001 - out of restarts, or still restarting
            pid = None
        previous = self.pids[i]
        if previous is None or pid == previous:  # the same process: it did not die
            logger.warning("rollout worker %d did not stop cleanly: %s", i, why)
            return
        self._restarted(i, previous, pid, "in the last steps")

    def final_eval(self, step: int) -> dict[str, Any]:
        """Worker 0's eval of the final weights; ``{}`` (with a warning) if it cannot: the
        worker is gone, never gets those weights, or takes longer than
        ``faults.stall_timeout_s`` (an hour with the watchdog off)."""
        import ray

        timeout = self.faults.stall_timeout_s or 3600.0
        address = self.run_args[0][0]
        deadline = time.monotonic() + timeout
        try:
            while True:
                ref = self.rollouts[0].final_eval.remote(step, address, timeout)
                try:
                    return ray.get(ref, timeout=max(deadline - time.monotonic(), 1.0) + 60)
                except ray.exceptions.ActorUnavailableError:
                    # Being restarted after its process died: its constructor will finish.
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.5)
        except ray.exceptions.GetTimeoutError:
            logger.warning(
                "no final eval: rollout worker 0 did not finish it within %.0f s "
                "(faults.stall_timeout_s); `marinrl eval %s` scores the final checkpoint",
                timeout,
                self.job.run_dir,
            )
        except Exception as exc:  # noqa: BLE001 - the run is trained; only its eval is missing
            logger.warning(
                "no final eval (%s); `marinrl eval %s` scores the final checkpoint",
                first_line(exc),
                self.job.run_dir,
            )
        return {}


def _postfix(latest: dict[str, Any]) -> dict[str, str]:
    postfix = {}
    if "reward" in latest:
        postfix["reward"] = f"{latest['reward']:.3f}"
    evals = {
        k.split("/")[1]: v
        for k, v in latest.items()
        if k.startswith("eval/") and k.endswith("/reward")
    }
    if evals:
        postfix["eval"] = " ".join(f"{k}={v:.2f}" for k, v in evals.items())
    turns = latest.get("rollout/turns")
    if isinstance(turns, int | float) and turns > 1:  # multi-turn episodes: how long they run
        postfix["turns"] = f"{turns:.1f}"
        postfix["env_step"] = f"{latest.get('rollout/env_step_seconds', 0.0):.3f}s"
    for key in ("env_errors", "env_timeouts", "prompts_too_long"):  # of the latest batch
        value = latest.get(f"rollout/{key}")
        if isinstance(value, int | float) and value > 0:
            postfix[key] = f"{value:.0f}"
    return postfix
