"""The rollout side: the rollout worker (:mod:`~marin_rl_core.rollout.worker`), the manager that
turns lessons into batches (:mod:`~marin_rl_core.rollout.manager`), episodes and their env
threads and processes (:mod:`~marin_rl_core.rollout.episodes`,
:mod:`~marin_rl_core.rollout.env_pool`) and the samplers (:mod:`~marin_rl_core.rollout.inference`).
Never imports :mod:`marin_rl_core.learner`."""
