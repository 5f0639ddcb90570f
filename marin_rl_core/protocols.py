"""The protocols every plugin kind implements.

A plugin's ``build`` function (see :mod:`marin_rl_core.hookspecs`) returns an object satisfying
one of these. They are structural (``typing.Protocol``): implement the methods, no base class to
inherit. ``marin_rl_core.testing`` checks them for plugin authors.

A leaf module: model and array types are ``Any`` here so that importing it needs no JAX.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Literal, Protocol, runtime_checkable

import numpy as np

from marin_rl_core.loss_plan import LOSS_AGGREGATIONS, LossPlan, loss_plan  # noqa: F401
from marin_rl_core.types import (
    Action,
    LessonStats,
    Problem,
    ReceivedWeights,
    RewardInput,
    RolloutBatch,
    RolloutGroup,
    Score,
    Step,
)

Mode = Literal["train", "eval"]


@runtime_checkable
class Env(Protocol):
    """A source of problems and a grader for the policy's answers.

    The rollout side asks for problems, samples responses with the current policy, and asks the
    env to score each one. Envs know nothing of workers, weights or metadata. ``score`` may raise
    for a malformed problem or response: the rollout side then drops that one problem, counts it
    in the ``env_errors`` metric, and carries on.

    Optional: ``answer(problem, response) -> str | None``, the response's answer in a canonical
    form (responses whose answers agree give the same string; ``None``: it has none), for
    ``marinrl eval``'s majority vote (maj@k).
    """

    def sample_problems(self, n: int, *, mode: Mode, seed: int) -> list[Problem]:
        """Return ``n`` problems. ``mode="eval"`` draws from a held-out split that training
        never sees; an env whose held-out split has fewer than ``n`` problems may return all of
        them, each once, instead. The same ``seed`` gives the same problems."""
        ...

    def score(self, problem: Problem, response: str) -> float | Score:
        """Return the reward of ``response`` (decoded text, stop token removed) for ``problem``:
        a float, or a :class:`~marin_rl_core.types.Score` holding the reward and metrics to
        report beside it (``Score(0.0, {"format": 1.0, "correct": 0.0})``). Each metric is
        averaged over a batch's rollouts and logged as ``rollout/score/<name>`` for training
        batches and ``eval/<lesson>/<name>`` in evaluation."""
        ...


@runtime_checkable
class Episode(Protocol):
    """One running episode of a :class:`MultiTurnEnv`, made by ``MultiTurnEnv.reset``.

    The framework owns the loop: it samples the policy's action, calls ``step`` with it, appends
    the returned observation's tokens and samples again, until ``done`` or a limit (turns,
    tokens, ``episodes.step_timeout_s`` per step, ``episodes.episode_timeout_s`` per episode).
    ``step`` may be a plain method or ``async def``: an async step (a tool call, a sandbox, a
    remote grader) holds up no other episode. Plain steps run on a worker thread, one at a time
    per env; raising fails the episode (its problem's group is dropped and counted in
    ``env_errors``).
    """

    def step(self, action: Action) -> Step | Awaitable[Step]:
        """React to the policy's ``action``; return the next observation, this turn's reward
        and whether the episode is over."""
        ...


@runtime_checkable
class MultiTurnEnv(Protocol):
    """An env whose episodes take several turns: ``reset`` a problem, then ``step`` actions.

    The problem's ``prompt`` / ``messages`` is the first observation. A single-turn
    :class:`Env` is the one-step special case:
    :func:`marin_rl_core.rollout.episode_state.as_multi_turn` wraps one (the rollout side does so
    itself).

    Optional members:

    * ``close(episode)``: release an episode's resources; called once per episode, however the
      episode ended.
    """

    def sample_problems(self, n: int, *, mode: Mode, seed: int) -> list[Problem]:
        """As :meth:`Env.sample_problems`."""
        ...

    def reset(self, problem: Problem) -> Episode:
        """Start an episode of ``problem`` (called once per sampled episode: the
        ``n_generations_per_prompt`` episodes of a problem each get their own)."""
        ...


@runtime_checkable
class AgentEnv(Protocol):
    """An env whose episode is an agent program: any code written against the OpenAI client.

    For each episode the rollout worker opens an OpenAI-compatible endpoint of the episode's own
    (an :class:`~marin_rl_core.types.AgentEndpoint`: base URL and key) and calls ``run_agent``;
    the program calls ``/v1/chat/completions`` or ``/v1/completions`` as often as it likes (up
    to the episode's limits), and every call is sampled from the current policy, batched with
    the other episodes' calls, and recorded as the exact ids the policy saw and sampled
    (:mod:`marin_rl_core.rollout.transcript`). When the program returns, the episode is
    scored and its calls become its training samples. See docs/agents.md.

    ``run_agent`` may be a plain function (run on a thread of its own: use ``openai.OpenAI``),
    ``async def`` (run on the worker's event loop: use ``openai.AsyncOpenAI``), or return an
    :class:`~marin_rl_core.types.AgentCommand` to run a subprocess. It returns the episode's
    result: a reward (a float or :class:`~marin_rl_core.types.Score`) when the env has no
    ``score``, or anything its ``score(problem, result)`` grades (a subprocess's result is its
    standard output). An agent that raises, exits non-zero or outlives
    ``episodes.episode_timeout_s`` fails its episode (its problem's group is dropped and counted
    in ``env_errors`` / ``env_timeouts``) and nothing else.
    """

    def sample_problems(self, n: int, *, mode: Mode, seed: int) -> list[Problem]:
        """As :meth:`Env.sample_problems`."""
        ...

    def run_agent(self, problem: Problem, endpoint: Any) -> Any:
        """Run one episode of ``problem`` against ``endpoint``; return its result (see the
        class docstring)."""
        ...


def is_agent_env(env: Any) -> bool:
    """Whether ``env`` is an :class:`AgentEnv` (it has ``run_agent``)."""
    return callable(getattr(env, "run_agent", None))


@runtime_checkable
class RewardFunction(Protocol):
    """One term of a combined reward (``[[reward.terms]]``): grades finished episodes.

    ``score`` gets a batch's episodes at once (a judge batches its requests) and returns one
    value per item: a float, or ``None`` where it could not grade one (a judge that timed out
    or answered something unparsable). ``None`` is never read as 0: that episode's problem is
    left out of the batch and counted (``rollout/reward_failures``). An exception fails every
    item of the call alike. The job weighs each term's value and sums them into the reward
    (:mod:`marin_rl_core.rollout.reward_terms`).
    """

    def score(self, items: Sequence[RewardInput]) -> Sequence[float | None]:
        """One value (or ``None``) per item, in order."""


@runtime_checkable
class RLLossModule(Protocol):
    """An RL objective: how a group's rewards become advantages, and the loss on a batch.

    Lifecycle: the trainer calls ``build(reference_model)`` once and uses the returned module;
    the replay buffer calls ``compute_advantages`` as rollouts arrive; the trainer calls
    ``create_loss_fn`` inside its compiled step, each time that step is traced, with the
    reference model the step receives as an argument.

    Optional members:

    * ``plan``: a :class:`LossPlan`: the aggregation, per-token rewards, updates per step,
      frozen policy steps, trainable loss state (a critic) and whole-step preparation the loss
      asks for (absent: ``LossPlan()``). Read once, when the trainer builds the loss.
    """

    @property
    def needs_reference_model(self) -> bool:
        """Whether ``create_loss_fn`` uses the frozen reference model (e.g. for a KL term).
        When ``False`` the trainer passes ``None`` and keeps no reference copy."""
        ...

    def build(self, reference_model: Any) -> RLLossModule:
        """Prepare the module for training; may return ``self``."""
        ...

    def compute_advantages(self, group: RolloutGroup) -> np.ndarray:
        """Return one float32 advantage per rollout of ``group``, in order. NaN drops a rollout
        before it reaches a batch (a group without reward variance, say); paced rollout workers
        generate as many again."""
        ...

    def create_loss_fn(self, reference_model: Any, train_model: Any) -> Callable[..., Any]:
        """Return ``loss_fn(model, batch, *, key) -> TokenLoss``, a pure JAX function of the
        trainable model and a :class:`~marin_rl_core.learner.training_batch.TrainingBatch`:
        per-token losses and metrics that the framework weighs once over the whole step
        (:class:`~marin_rl_core.learner.loss.TokenLoss`). ``train_model`` is the policy being
        trained, for losses that need its structure. (A ``loss_fn`` returning ``(loss,
        metrics)``, the contract before, is refused when the step is traced, with the way to
        migrate.)

        Called while the train step is traced, with ``reference_model`` a traced, sharded
        argument of that step (``None`` unless ``needs_reference_model``): use the model given
        here, never one kept from ``build``, which would be compiled into the step as constants.
        Keep it cheap and free of side effects."""
        ...


@runtime_checkable
class RolloutWriter(Protocol):
    """The rollout workers' end of rollout storage."""

    def write_batch(self, batch: RolloutBatch, *, timeout: float | None = None) -> None:
        """Store ``batch``. Blocks while storage is full (back-pressure) up to ``timeout``
        seconds, then raises ``TimeoutError`` with the batch not stored; once it returns the
        batch will be delivered. Any other exception may leave the batch stored or not: the
        rollout worker writes the same batch again (with backoff), and that must not deliver it
        twice."""
        ...


@runtime_checkable
class RolloutReader(Protocol):
    """The trainer's end of rollout storage.

    Exactly once across restarts: the trainer saves :meth:`position` with each checkpoint (the
    replay buffer holds, or the model has trained on, every batch read up to there) and a
    resumed trainer reads from ``RolloutStorage.reader(position)``: every batch written is
    returned once after the position it was read at, so none is trained on twice or lost."""

    def read_batches(self, *, max_batches: int, timeout: float = 0.0) -> list[RolloutBatch]:
        """Return up to ``max_batches`` batches not returned before, waiting up to ``timeout``
        seconds for the first one; an empty list when none arrived. A call that raises must
        not lose batches: the next call returns them."""
        ...

    def position(self) -> Any:
        """Where this reader is: a JSON-able value after every batch returned so far, which
        ``RolloutStorage.reader(position)`` goes on from."""
        ...

    def checkpointed(self, position: Any) -> None:
        """A checkpoint holding every batch read up to ``position`` is durably written: storage
        may forget those batches (retention). Never raises for a storage problem (log it)."""
        ...

    def trouble(self) -> str:
        """What is wrong with the storage now, in one line naming it (a call unanswered for a
        while, a recent failure that was retried); ``""`` when nothing is. Called from another
        thread while :meth:`read_batches` waits: the watchdog names it when no step completes."""
        ...


@runtime_checkable
class RolloutStorage(Protocol):
    """Where rollouts go between the rollout workers and the trainer.

    Built once by the driver (``build(config, run)``, :class:`~marin_rl_core.types.RunInfo`);
    ``writer()`` and ``reader()`` are called on the worker processes, so the storage object
    must be picklable (a handle, not the data).

    Optionally ``check() -> None``: called by the driver on a storage it built and closed again,
    before the job starts Ray and its workers; raise a
    :class:`~marin_rl_core.errors.MarinRLError` naming what cannot be reached (a bucket that
    does not answer) and the fix, so that a mistyped URL is told in seconds.
    """

    def writer(self, *, name: str = "") -> RolloutWriter:
        """A writer for one rollout worker; ``name`` (``"rollout-3"``) labels its batches where
        the storage shows them."""
        ...

    def reader(self, position: Any = None) -> RolloutReader:
        """The trainer's reader, going on after ``position`` (a value :meth:`RolloutReader.position`
        gave, saved with a checkpoint; ``None``: from the start). A position of another job's
        storage that this one cannot use starts from the start."""
        ...

    def close(self) -> None:
        """Release what the storage holds for the job (called once, by the driver, at the end;
        data meant to outlive the job stays)."""
        ...


@runtime_checkable
class WeightTransferServer(Protocol):
    """The trainer's end: publishes new policy weights."""

    @property
    def address(self) -> str:
        """Where clients connect (e.g. ``grpc://127.0.0.1:PORT``)."""
        ...

    def publish(self, model: Any, *, weight_step: int) -> None:
        """Serve ``model``'s weights as ``weight_step`` (steps increase) without waiting for
        any transfer: the trainer goes on training as soon as this returns.

        ``model`` is the server's own: the trainer hands over a fresh copy (in the inference
        dtype) that no train step donates or writes, so the server may keep it and read it
        later, zero-copy. A trainer over several hosts (``resources.trainer_hosts``) hands its
        process 0's server the model gathered from every host into host memory (numpy
        leaves). Preparing it (a host copy, serialization) happens in the background;
        until it is ready clients keep receiving the previous version, and a client receives
        all of one version or an error, never a mix."""
        ...

    def close(self) -> None: ...


@runtime_checkable
class WeightTransferClient(Protocol):
    """A rollout worker's end: fetches newer weights when there are some.

    Every wait is bounded (the plugin's timeout); an error (no server, a dead or wedged one)
    raises, and the worker goes on sampling with the weights it has and asks again later with
    backoff. Weights that do not fit ``like_model`` raise
    :class:`~marin_rl_core.errors.WeightMismatchError`, which stops the worker."""

    def receive(self, like_model: Any) -> ReceivedWeights | None:
        """Weights newer than the last ones received, shaped like ``like_model``, with what the
        transfer took (:class:`~marin_rl_core.types.ReceivedWeights`); ``None`` if nothing
        newer was published."""
        ...

    def close(self) -> None: ...


@runtime_checkable
class WeightTransfer(Protocol):
    """A mechanism that moves weights trainer → rollout workers across processes."""

    def server(self) -> WeightTransferServer:
        """Start serving (called once, in the trainer process)."""
        ...

    def client(self, address: str) -> WeightTransferClient:
        """Connect to the server at ``address`` (called in each rollout worker process)."""
        ...


@runtime_checkable
class CurriculumPolicy(Protocol):
    """Decides which lesson each rollout batch trains on, from eval and training stats.

    A lesson is *locked* until its dependencies reach their thresholds, then *active*, and
    *graduated* once its eval reward reaches ``stop_threshold``. Graduated lessons are still
    evaluated and sampled less (how much less is the policy's choice).
    """

    def sample_lesson(self, *, seed: int) -> str:
        """Return the id of the lesson to sample next."""
        ...

    def update_eval(self, stats: LessonStats) -> None:
        """Record a full evaluation of one lesson; may unlock or graduate lessons."""
        ...

    def update_training(self, stats: LessonStats) -> None:
        """Record the rewards of a training batch of one lesson."""
        ...

    def lesson_states(self) -> dict[str, str]:
        """``{lesson_id: "locked" | "active" | "graduated"}``."""
        ...

    def state_dict(self) -> dict[str, Any]:
        """JSON-serialisable state, saved beside trainer checkpoints."""
        ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


@runtime_checkable
class GenerationEngine(Protocol):
    """Samples the policy's responses on a rollout worker (``[engine]``, ``--engine NAME``).

    An engine is built once per worker from an :class:`~marin_rl_core.generation.EngineSpec`
    (the policy model, its sequence length, EOS, the mesh, a memory budget) and kept: new weights
    arrive through :meth:`update_model`. ``generate`` is called from one thread at a time, with
    requests from every episode and agent call waiting at that moment; each request carries its
    own sampling settings and key (:class:`~marin_rl_core.generation.GenerationRequest`).

    What marinrl relies on (``tests/test_inference.py`` holds the built-in engines to it, and
    :func:`marin_rl_core.testing.check_engine` checks a third-party one):

    * ``result[i][k]`` is the ``k``-th sample of ``requests[i]``; a response ends at one of its
      stop ids (EOS always) or at its budget, and :attr:`Sample.stopped
      <marin_rl_core.generation.Sample.stopped>` says which;
    * the same key, prompt and weights give the same samples, whatever else the call holds;
    * **logprobs**: each token's logprob under the weights that sampled it, tempered
      (``log_softmax(logits / T)``; untempered for greedy rows), equal to what the trainer
      computes for the same tokens up to float rounding: the importance ratios of every loss
      rest on it. An engine that cannot promise this (a remote server sampling with its own
      kernels, say) is registered with ``EnginePlugin(exact_logprobs=False)``; marinrl then
      uses it for evaluation only and refuses to train with it.

    Optional members:

    * ``serve(poll)``: serve submissions continuously (the generation queue calls it instead of
      ``generate``): ``poll()`` returns the ``(requests, future)`` pairs submitted since the last
      call; a request that arrives while others decode joins them, and each future gets its
      samples as soon as its own rows finish.
    * ``in_flight_weights`` (``True``): ``update_model(model, weight_step=step)`` may be called
      from another thread while it samples (the rollout worker's ``episodes.in_flight_weights``);
      rows in flight go on with the new weights from its next round, their tokens so far re-read
      by them (the ``kv`` engine recomputes their cache), and each
      :class:`~marin_rl_core.generation.Sample` gives the ``weight_steps`` that sampled it.
    """

    max_seqs: int
    """The most rows (samples) one request may ask for."""

    @property
    def model(self) -> Any:
        """The weights the engine samples from, in the trainer's parameter structure (the
        template a weight transfer receives new weights into)."""
        ...

    def update_model(self, model: Any) -> None:
        """Sample from ``model`` (new weights of the same architecture) from the next call on."""
        ...

    def generate(self, requests: Sequence[Any]) -> list[list[Any]]:
        """Sample every :class:`~marin_rl_core.generation.GenerationRequest`; returns their
        :class:`~marin_rl_core.generation.Sample` s. A request it cannot serve (too long a
        prompt, too many samples) raises ``ValueError`` naming the limit."""
        ...
