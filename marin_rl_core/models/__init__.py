"""The policy model and everything about it that both sides of the data path share: building and
loading it (:mod:`~marin_rl_core.models.build`, :mod:`~marin_rl_core.models.pretrained`), its
tokenizer and stop ids (:mod:`~marin_rl_core.models.tokenizer`), token rows
(:mod:`~marin_rl_core.models.packing`) and log-probabilities
(:mod:`~marin_rl_core.models.logprobs`). Imports only the top-level contract modules."""
