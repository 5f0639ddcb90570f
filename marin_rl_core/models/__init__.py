"""The policy model and everything about it that both sides of the data path share: building and
loading it (:mod:`~marin_rl_core.models.build`, :mod:`~marin_rl_core.models.pretrained`), its
tokenizer and stop ids (:mod:`~marin_rl_core.models.tokenizer`), token rows
(:mod:`~marin_rl_core.models.packing`) and log-probabilities
(:mod:`~marin_rl_core.models.logprobs`). Imports only the top-level contract modules."""

LOGITS_BLOCK_BYTES = 256 * 2**20
"""The most memory one block of float32 logits takes in
:func:`~marin_rl_core.models.logprobs.next_token_logprobs_and_entropy`:
with a 151,936-token vocabulary (Qwen) that is 441 positions per block, so a batch of any size
never holds a whole ``[batch, position, vocab]`` array at once. The forward pass keeps two such
arrays alive (the logits and their exponentials), so its peak is about twice this; 256 MiB keeps
the RL step's peak memory below levanter's cross-entropy step (``bench/step_time.py``)."""
