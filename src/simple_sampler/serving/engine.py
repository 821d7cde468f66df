"""The data plane: an engine that turns token sequences into next-token logits.

The decode loop (``decoder``) drives an :class:`Engine` through five calls and
never looks inside it:

* ``add(seq_id, prompt_ids, max_tokens=None)`` takes a free slot for a new
  sequence; ``max_tokens``, when given, is the most tokens the caller will
  generate for it (the decode loop passes the request's own), so an engine
  that reserves memory per request (TensorRT-LLM's KV-cache blocks) reserves
  for that many instead of the whole context; engines that do not reserve
  ignore it;
* ``step(seq_ids)`` returns logits ``[len(seq_ids), vocab_size]``, float32 or
  the dtype its ``engines.EngineSpec.logits_dtype`` names (the torch and
  static engines' model dtype, the simulated engine's, a prebuilt
  TensorRT-LLM engine's), the next-token distribution
  of exactly those sequences (any subset of the active ones, in the order
  given), so the loop can split the batch into micro-batches;
* ``append(seq_ids, token_ids)`` feeds the sampled tokens back;
* ``release(seq_id)`` frees the slot (finished or cancelled);
* ``length(seq_id)`` is the number of tokens the sequence holds (prompt plus
  appended tokens);
* ``label`` and ``bridge_s`` say what it is and how long its bridge to the
  decode loop took (the llm model reports both).

Optional capabilities are protocols of their own: :class:`ComputesOffHost`
(``off_host``: the forward leaves the host's cores free), :class:`SelfScheduling`
(``wait_ready(seq_ids)``, the subset that has a row now, for an engine that
schedules its own batches; see ``decoder`` and ``trtllm``),
:class:`StepsThen` (``step_then(seq_ids, then)``: device work on the rows
queued behind the forward, for an engine that models its device time),
:class:`SummarizesHotFirst` (``prepare_hot_first`` and ``hot_first_summary``:
the hot-first summary computed where the engine's rows are),
:class:`SplitsSlots` (``split_slots(lanes)``, ``add(..., lane=)``,
``free_in_lane(lane)``: each of the decode loop's lanes keeps its sequences in
a window of slots of its own, for an engine whose step computes a window of
slots whole), :class:`WarmsUp` (``warm_up()``: every decode step's shape
prepared before the first request), :class:`ScoresPrompts`
(``score_prompt(prompt_ids, num_top)``: prompt logprobs) and :class:`Closable`
(``close()``). :class:`SequenceTable` holds what every engine tracks per
sequence and raises the contract's errors.

Every sequence alternates ``step`` and ``append``: after ``add`` or ``append`` it
has tokens the model has not seen yet ("pending"); ``step`` consumes them and
``append`` supplies the next. Stepping a sequence twice without an ``append``
in between is an error.

The engines and their names: ``engines`` (the registry).
"""
from __future__ import annotations

from typing import (TYPE_CHECKING, Callable, Generic, Hashable, Iterator, Protocol, Sequence,
                    TypeVar, runtime_checkable)

if TYPE_CHECKING:  # the contract needs torch only to name step's return type
    import torch

T = TypeVar("T")


class Engine(Protocol):
    """What the decode loop needs from a data plane (see the module docstring)."""

    vocab_size: int
    max_batch_size: int
    max_context: int
    #: what computes the logits, as the llm model's ready line names it (the
    #: simulated engine's says it is simulated)
    label: str
    #: seconds spent bridging rows to the decode loop across processes,
    #: summed (``TrtLlmEngine``'s processor; 0.0 for an in-process engine):
    #: the ``simple_llm_bridge_us_total`` metric
    bridge_s: float

    def add(self, seq_id: Hashable, prompt_ids: Sequence[int],
            max_tokens: int | None = None) -> None: ...

    def step(self, seq_ids: Sequence[Hashable]) -> torch.Tensor: ...

    def append(self, seq_ids: Sequence[Hashable], token_ids: Sequence[int]) -> None: ...

    def release(self, seq_id: Hashable) -> None: ...

    def length(self, seq_id: Hashable) -> int: ...


@runtime_checkable
class ComputesOffHost(Protocol):
    """Optional capability of an :class:`Engine` that says whether its
    forward leaves the host's cores free (``off_host``: a GPU's, or the
    simulated engine's modelled device time), so that the decode loop's own
    Python can run beside it (``LlmSettings.launch_ahead``). Checked with
    ``isinstance(engine, ComputesOffHost)``; an engine without it counts as
    on the host."""

    off_host: bool


@runtime_checkable
class SelfScheduling(Protocol):
    """Optional capability of an :class:`Engine` that schedules its own
    batches (``trtllm.TrtLlmEngine``): its iterations decide which sequences
    have a row, and the decode loop steps only those. Checked with
    ``isinstance(engine, SelfScheduling)``."""

    def wait_ready(self, seq_ids: Sequence[Hashable], timeout: float = ...) -> list:
        """The ids among ``seq_ids`` with a row to step now, waiting up to
        ``timeout`` seconds while no active sequence has one."""
        ...


@runtime_checkable
class StepsThen(Protocol):
    """Optional capability of an :class:`Engine` whose device time is
    modelled (``simulated.SimulatedEngine``): ``step_then(seq_ids, then)``
    is ``step(seq_ids)`` followed by ``then(rows)`` as device work queued
    behind the forward (the hot-first summary), and returns ``(rows,
    then(rows))``. The engine charges ``then`` its modelled device time, not
    its emulation's CPU time. Any other engine gets ``step_then``, the plain
    sequence."""

    def step_then(self, seq_ids: Sequence[Hashable],
                  then: Callable[[torch.Tensor], T]) -> tuple[torch.Tensor, T]: ...


def step_then(engine: Engine, seq_ids: Sequence[Hashable],
              then: Callable[[torch.Tensor], T]) -> tuple[torch.Tensor, T]:
    """``engine.step(seq_ids)``, then ``then`` of its rows in the same
    thread (where a GPU engine's stream holds them), through the engine's
    own ``step_then`` when it models its device time (:class:`StepsThen`)."""
    if isinstance(engine, StepsThen):
        return engine.step_then(seq_ids, then)
    rows = engine.step(seq_ids)
    return rows, then(rows)


@runtime_checkable
class SummarizesHotFirst(Protocol):
    """Optional capability of an :class:`Engine` that computes the hot-first
    summary (docs/HANDOFF.md) where its rows are: the simulated engine
    models it as device time, the torch engine on CUDA keeps its rows on
    the device and replays the summary there as a CUDA graph. The llm model
    calls ``prepare_hot_first(hot_ids, cold_top)`` once, when its rows cross
    hot-first (after it, ``step``'s rows may be on the engine's device), and
    hands ``hot_first_summary`` to ``hot_first.compact_rows`` as its
    `summary`: ``hot_first.hot_first_summary``'s arguments, the
    ``CompactRows.cpu()`` form back. Checked with
    ``isinstance(engine, SummarizesHotFirst)``."""

    def prepare_hot_first(self, hot_ids, cold_top: int) -> None: ...

    def hot_first_summary(self, logits: torch.Tensor, hot_ids, touched_offsets, touched_ids,
                          temperature, cold_top=0, draws=None): ...


@runtime_checkable
class SplitsSlots(Protocol):
    """Optional capability of an :class:`Engine` whose decode step computes
    a contiguous window of slots whole, the slots it was not asked for
    included (``static_decode.StaticEngine``: fixed shapes for its CUDA
    graphs). Without windows, a lane stepping half the sequences would pay
    for all of them. The decode loop calls ``split_slots(lanes)`` once,
    before any ``add``: the slots are cut into that many windows, one per
    lane. It then admits each sequence to a lane with ``add(..., lane=i)``
    (the lowest free slot of window i), picks the lane by
    ``free_in_lane(i)`` (free slots left in window i) and never moves a
    sequence to another lane. Checked with ``isinstance(engine, SplitsSlots)``."""

    def split_slots(self, lanes: int) -> None: ...

    def free_in_lane(self, lane: int) -> int: ...


@runtime_checkable
class WarmsUp(Protocol):
    """Optional capability of an :class:`Engine` whose decode steps have a
    fixed set of shapes it prepares once (``static_decode.StaticEngine``: a
    CUDA graph per window and bucket, and with ``compile_decode`` the
    compile). The decode loop calls ``warm_up()`` as it is made, once it has
    split the slots (:class:`SplitsSlots`) and before the first ``add``, so
    that no request waits for a capture and no capture runs while another
    thread launches device work; it returns how many shapes it prepared.
    Checked with ``isinstance(engine, WarmsUp)``."""

    def warm_up(self) -> int: ...


@runtime_checkable
class ScoresPrompts(Protocol):
    """Optional capability of an :class:`Engine` that gives a prompt's
    logprobs (``prompt_scores``: what they are and their shapes): the
    torch and static engines by a forward of their model over the prompt,
    the simulated engine from its bank's rows. ``score_prompt`` holds no
    slot and may be called from another thread while steps run (it waits
    for the running step where the two would share a device's work).
    Checked with ``isinstance(engine, ScoresPrompts)``; a request asking
    for prompt logprobs from an engine without it is refused."""

    def score_prompt(self, prompt_ids: Sequence[int], num_top: int): ...


@runtime_checkable
class Closable(Protocol):
    """Optional capability of an :class:`Engine` that holds resources to free
    at shutdown (worker threads, processes, shared memory). Checked with
    ``isinstance(engine, Closable)``; ``close`` must be idempotent."""

    def close(self) -> None: ...


class SequenceFailed(RuntimeError):
    """Raised by ``step`` (or ``wait_ready``'s caller's next ``step``) when
    the engine reported that some of the stepped sequences failed on its side
    (a request TensorRT-LLM rejected or errored after submission). ``failed``
    maps each failed seq_id to its message. Nothing of the step was consumed:
    the decode loop ends only those sequences with the error and steps the
    others again."""

    def __init__(self, failed: dict):
        self.failed = dict(failed)
        super().__init__("; ".join(f"{seq_id!r}: {message}" for seq_id, message in
                                   self.failed.items()))


S = TypeVar("S")


class SequenceTable(Generic[S]):
    """An engine's active sequences by seq_id, with the checks and error
    messages the :class:`Engine` contract fixes for every engine.

    ``S`` is the engine's own per-sequence state; the table never looks
    inside it except through the ``has_pending`` / ``length`` callables the
    engine passes. Not locked: the engine calls it under its own lock.

    * ``add(seq_id, prompt_ids, make)`` checks the prompt (1 to
      ``max_context - 1`` ids in [0, vocab_size)), that the id is new and a
      slot is free, then stores ``make(prompt)`` (the prompt as ints);
    * ``[seq_id]`` is the state, or a KeyError naming the unknown sequence;
    * ``release(seq_id)`` pops the state (None for an unknown id);
    * ``for_step`` / ``for_append`` check a ``step`` / ``append`` call and
      return the states (and tokens).
    """

    def __init__(self, vocab_size: int, max_batch_size: int, max_context: int):
        self.vocab_size, self.max_batch_size, self.max_context = (vocab_size, max_batch_size,
                                                                  max_context)
        self.states: dict[Hashable, S] = {}

    def __len__(self) -> int:
        return len(self.states)

    def __contains__(self, seq_id: Hashable) -> bool:
        return seq_id in self.states

    def __iter__(self) -> Iterator[Hashable]:
        return iter(self.states)

    def __getitem__(self, seq_id: Hashable) -> S:
        try:
            return self.states[seq_id]
        except KeyError:
            raise KeyError(f"unknown sequence {seq_id!r}") from None

    def values(self):
        return self.states.values()

    def check_prompt(self, prompt_ids: Sequence[int]) -> list[int]:
        """``prompt_ids`` as ints; ValueError unless 1 to ``max_context - 1``
        ids (room is left for a generated token), each in [0, vocab_size)."""
        prompt = [int(t) for t in prompt_ids]
        if not 1 <= len(prompt) < self.max_context:
            raise ValueError(f"prompt_ids must hold 1 to {self.max_context - 1} tokens "
                             f"(max_context - 1), got {len(prompt)}")
        check_token_ids("prompt_ids", prompt, self.vocab_size)
        return prompt

    def add(self, seq_id: Hashable, prompt_ids: Sequence[int],
            make: Callable[[list[int]], S]) -> S:
        """Store and return ``make(prompt)`` for a new sequence; ``make`` runs
        only after every check passed. ValueError for a bad prompt
        (``check_prompt``) or a used id, RuntimeError when
        ``max_batch_size`` sequences are active."""
        prompt = self.check_prompt(prompt_ids)
        if seq_id in self.states:
            raise ValueError(f"sequence {seq_id!r} is already active")
        if len(self.states) >= self.max_batch_size:
            raise RuntimeError(f"no free slot: all max_batch_size={self.max_batch_size} "
                               f"slots are taken")
        state = self.states[seq_id] = make(prompt)
        return state

    def release(self, seq_id: Hashable) -> S | None:
        """Forget the sequence; its state, or None for an unknown id (a
        cancel racing the sequence's own finish is harmless)."""
        return self.states.pop(seq_id, None)

    def for_step(self, seq_ids: Sequence[Hashable], has_pending: Callable[[S], bool],
                 length: Callable[[S], int] | None = None) -> list[S]:
        """The states of a ``step``'s ids. ValueError for a repeated id, a
        sequence with nothing pending (stepped again without ``append``) or,
        when ``length`` is given, one already ``max_context`` tokens long;
        KeyError for an unknown id."""
        if len(set(seq_ids)) != len(seq_ids):
            raise ValueError(f"seq_ids must be distinct, got {list(seq_ids)}")
        states = self._states(seq_ids)
        for seq_id, state in zip(seq_ids, states):
            if not has_pending(state):
                raise ValueError(f"sequence {seq_id!r} has no pending token: "
                                 f"append the sampled token before the next step")
        self._check_room(seq_ids, states, length)
        return states

    def for_append(self, seq_ids: Sequence[Hashable], token_ids: Sequence[int],
                   has_pending: Callable[[S], bool],
                   length: Callable[[S], int] | None = None) -> tuple[list[S], list[int]]:
        """(states, tokens as ints) of an ``append``. ValueError when the
        lengths differ, a token is outside [0, vocab_size), a sequence still
        has a pending token or, when ``length`` is given, is already
        ``max_context`` tokens long; KeyError for an unknown id."""
        tokens = [int(t) for t in token_ids]
        if len(tokens) != len(seq_ids):
            raise ValueError(f"token_ids has {len(tokens)} entries for {len(seq_ids)} seq_ids")
        check_token_ids("token_ids", tokens, self.vocab_size)
        states = self._states(seq_ids)
        for seq_id, state in zip(seq_ids, states):
            if has_pending(state):
                raise ValueError(f"sequence {seq_id!r} already has a pending token: "
                                 f"step it before appending another")
        self._check_room(seq_ids, states, length)
        return states, tokens

    def _states(self, seq_ids: Sequence[Hashable]) -> list[S]:
        """The states of ``seq_ids``; KeyError naming the first unknown one.
        Read from the dict directly (the decode loop asks for every row of
        every step), ``__getitem__``'s message only for an unknown id."""
        try:
            return [self.states[seq_id] for seq_id in seq_ids]
        except KeyError:
            return [self[seq_id] for seq_id in seq_ids]

    def _check_room(self, seq_ids: Sequence[Hashable], states: list[S],
                    length: Callable[[S], int] | None) -> None:
        """ValueError naming the first sequence already ``max_context`` tokens long."""
        if length is None:
            return
        for seq_id, state in zip(seq_ids, states):
            if length(state) >= self.max_context:
                raise ValueError(f"sequence {seq_id!r} is at max_context={self.max_context} "
                                 f"tokens")


def check_token_ids(name: str, ids: Sequence[int], vocab_size: int) -> None:
    """ValueError naming ``name`` unless every id is in [0, vocab_size)."""
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"{name} must be token ids in [0, {vocab_size}), got {bad[0]}")
