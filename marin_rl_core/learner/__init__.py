"""The learner side: the RL loop (:mod:`~marin_rl_core.learner.trainer`), the train step on
levanter (:mod:`~marin_rl_core.learner.step`), the replay buffer
(:mod:`~marin_rl_core.learner.replay_buffer`), training batches
(:mod:`~marin_rl_core.learner.training_batch`), checkpoints
(:mod:`~marin_rl_core.learner.checkpoint`) and Hugging Face export
(:mod:`~marin_rl_core.learner.export`). Never imports :mod:`marin_rl_core.rollout`."""
