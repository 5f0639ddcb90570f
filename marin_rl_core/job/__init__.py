"""A run as a Ray job: the driver (:mod:`~marin_rl_core.job.driver`: :class:`RLJob`), the actors it
starts (:mod:`~marin_rl_core.job.actors`), its checks (:mod:`~marin_rl_core.job.checks`), its
watch over the running job (:mod:`~marin_rl_core.job.watch`), the local Ray it starts
(:mod:`~marin_rl_core.job.local_ray`), checkpoint evaluation
(:mod:`~marin_rl_core.job.evaluation`) and the compilation cache
(:mod:`~marin_rl_core.job.compile_cache`)."""

from marin_rl_core.job.driver import JobResult, RLJob

__all__ = ["JobResult", "RLJob"]
