"""Sampling parameters: a dataclass per request and the columnar batch the
kernels consume. Both are checked by the same rules, so a bad value is
reported with its field, the allowed range and (in a batch) its row.

===================== ========== =================================================
field                 default    allowed
===================== ========== =================================================
temperature           1.0        finite, >= 0; below 1e-5 (as FP32) means greedy
top_k                 0          >= -1; 0 and -1 disable it
top_p                 1.0        (0, 1]; 1 disables it
min_p                 0.0        [0, 1]; 0 disables it
repetition_penalty    1.0        [1e-6, 1e6]; 1 disables it
presence_penalty      0.0        [-2, 2]
frequency_penalty     0.0        [-2, 2]
seed                  None       [0, 2**64); None draws a fresh random seed
step                  len(out)   >= 0: the decoding step the draw is keyed by
logit_bias            {}         token id in [0, V) -> finite value or -inf
min_tokens            0          >= 0; stop_token_ids are banned until reached
stop_token_ids        ()         token ids in [0, V)
prompt/output ids     ()         token ids in [0, V)
===================== ========== =================================================
"""
from __future__ import annotations

import dataclasses
import secrets
from dataclasses import dataclass, field
from typing import Callable, Mapping, NamedTuple, Sequence

import numpy as np

from .histories import HistoryRef, ranges_index

#: Temperatures below this select greedy decoding: vLLM's _SAMPLING_EPS,
#: 1e-5, as the FP32 every tensor interface carries it, so that a client's
#: 1e-5 samples (as in vLLM) and a row is greedy or not alike in the Python
#: API and behind Triton (``is_greedy``).
GREEDY_TEMPERATURE = float(np.float32(1e-5))
PENALTY_LIMIT = 2.0
#: The widest repetition penalty and logit bias. Outside them a sequence's
#: logit can overflow float32 once divided by a temperature near the greedy
#: bound (z = +inf, a refused row), and a refused row fails the sampler call
#: of every request batched with it; a penalty of 1e6 already sends a seen
#: token's logit past any other (OpenAI's biases span [-100, 100]).
#: (the low end is float32's 1e-6, so the FP32 1e-6 a client sends passes)
REPETITION_PENALTY_RANGE = (float(np.float32(1e-6)), 1e6)
BIAS_LIMIT = 1e6
BIAS_ALLOWED = "in [-1e6, 1e6] or -inf"


def bias_allowed(values) -> np.ndarray:
    """The bool mask of logit bias values allowed (BIAS_ALLOWED; -inf bans)."""
    values = np.asarray(values)
    return (np.abs(values) <= BIAS_LIMIT) | (values == -np.inf)


class Interval(NamedTuple):
    """Allowed values from low to high, each end open or closed (NaN never
    passes). Called on a value or numpy array: the bool mask of the allowed
    values. Bounds, not code, so that the sampler's C pass over packed
    records (``sampler_packed``) checks by the same rules."""

    low: float
    high: float
    low_open: bool = False
    high_open: bool = False

    def __call__(self, values) -> np.ndarray:
        values = np.asarray(values)
        above = values > self.low if self.low_open else values >= self.low
        below = values < self.high if self.high_open else values <= self.high
        return above & below


#: >= 0 and finite (integers: >= 0)
NON_NEGATIVE = Interval(0.0, np.inf, high_open=True)


class Param(NamedTuple):
    """One per-row scalar sampling parameter: its ``SamplingBatch`` column
    (dtype), the value that leaves the distribution unchanged (also the
    ``SamplingParams`` default), the predicate a numpy column must pass and the
    allowed range as an error states it, its kind and which values turn it off.

    kind: ``scale`` (temperature: divides the logits), ``penalty`` (reads the
    history) or ``truncation`` (drops tokens from the distribution). Everything
    else is derived from this table: the checks, the batch columns
    (``serving/batch_state``), the schema's tensors (``schema``), the
    hot-first fallback's neutral values (``handoff``), the hot-set eligibility
    (``shvs/hot_vocab.untruncated_rows``), the truncation of the inline path
    and of the baselines; ``tests/test_params_table.py`` pins each.
    """

    name: str
    dtype: type
    neutral: float | int
    rule: Interval
    allowed: str
    kind: str
    #: rows where it changes nothing (None: the column equals ``neutral``)
    off: Callable[[np.ndarray], np.ndarray] | None = None

    @property
    def truncates(self) -> bool:
        return self.kind == "truncation"

    def is_off(self, column) -> np.ndarray:
        column = np.asarray(column)
        return column == self.neutral if self.off is None else self.off(column)


RULES = (
    Param("temperature", np.float64, 1.0, NON_NEGATIVE, "a finite value >= 0", "scale"),
    Param("top_k", np.int64, 0, Interval(-1, np.inf, high_open=True),
          ">= -1 (0 or -1 disables it)", "truncation", off=lambda v: v <= 0),
    Param("top_p", np.float64, 1.0, Interval(0.0, 1.0, low_open=True), "in (0, 1]", "truncation"),
    Param("min_p", np.float64, 0.0, Interval(0.0, 1.0), "in [0, 1]", "truncation"),
    Param("repetition_penalty", np.float64, 1.0, Interval(*REPETITION_PENALTY_RANGE),
          "in [1e-6, 1e6]", "penalty"),
    Param("presence_penalty", np.float64, 0.0, Interval(-PENALTY_LIMIT, PENALTY_LIMIT),
          "in [-2, 2]", "penalty"),
    Param("frequency_penalty", np.float64, 0.0, Interval(-PENALTY_LIMIT, PENALTY_LIMIT),
          "in [-2, 2]", "penalty"),
)
PARAMS = {p.name: p for p in RULES}
#: The truncations, in the order SIMPLE.md applies them (min_p, top_k, top_p).
TRUNCATIONS = tuple(PARAMS[name] for name in ("min_p", "top_k", "top_p"))
assert {p.name for p in TRUNCATIONS} == {p.name for p in RULES if p.truncates}, \
    "a truncating parameter needs its place in TRUNCATIONS"


def is_greedy(temperature):
    """bool, or bool array: the temperature, read as the float32 the kernels
    and the tensor interfaces read it, is below GREEDY_TEMPERATURE. The one
    rule for every path (a float64 1e-5 is not greedy, nor is its FP32)."""
    return np.asarray(temperature, np.float32) < np.float32(GREEDY_TEMPERATURE)


def any_on(batch, kind: str) -> np.ndarray:
    """bool [B]: rows of a ``SamplingBatch`` with a parameter of ``kind`` on."""
    on = np.zeros(len(batch), bool)
    for param in RULES:
        if param.kind == kind:
            on |= ~param.is_off(getattr(batch, param.name))
    return on

def first_violation(name: str, values: np.ndarray, ok: np.ndarray, allowed: str,
                    offsets: np.ndarray | None = None) -> str | None:
    """Error text for the first value failing `ok`, or None. With `offsets`
    (CSR offsets, or None for one value per row) the text names the row."""
    if ok.all():
        return None
    index = int(np.argmin(ok))
    row = index if offsets is None else int(np.searchsorted(offsets, index, side="right")) - 1
    value = values[index]
    value = value.item() if isinstance(value, np.generic) else value
    return f"row {row}: {name} must be {allowed}, got {value!r}"


def first_failed_check(checks) -> str | None:
    """``first_violation`` of the first failing check among `checks`, each
    (name, values, ok, allowed) with one value per row, or None; when all
    pass (every good request), one reduction over them."""
    if np.logical_and.reduce([ok for _, _, ok, _ in checks], axis=None):
        return None
    for name, values, ok, allowed in checks:
        message = first_violation(name, values, ok, allowed)
        if message:
            return message
    return None


def check_token_ids(name: str, ids: np.ndarray, offsets: np.ndarray, vocab_size: int) -> None:
    """Token ids of a CSR list must lie in [0, vocab_size)."""
    message = first_violation(name, ids, (ids >= 0) & (ids < vocab_size),
                              f"token ids in [0, {vocab_size})", offsets)
    if message:
        raise ValueError(message)


@dataclass
class SamplingParams:
    """What one request asks of the sampler (see the module table)."""

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    logit_bias: Mapping[int, float] = field(default_factory=dict)
    min_tokens: int = 0
    stop_token_ids: Sequence[int] = ()

    @property
    def greedy(self) -> bool:
        return bool(is_greedy(self.temperature))

    def validate(self, vocab_size: int | None = None) -> None:
        """Raise ValueError naming the first field out of range: as given,
        and as the kernels read it (float32: a value that overflows or
        rounds out of its range there is refused, not altered)."""
        for param in RULES:
            given = getattr(self, param.name)
            if np.dtype(param.dtype).kind == "i":
                _check_integer(param.name, given, int(np.iinfo(param.dtype).min),
                               int(np.iinfo(param.dtype).max))
            value = float(given)
            if not param.rule(np.float64(value)):
                raise ValueError(f"{param.name} must be {param.allowed}, got {given!r}")
            if not param.rule(np.float64(as_float32(value))):
                raise ValueError(f"{param.name} must be {param.allowed} in float32, got {given!r} "
                                 f"(float32: {as_float32(value)!r})")
        if self.seed is not None:
            _check_integer("seed", self.seed, 0, 2**64 - 1, "in [0, 2**64) or None")
        _check_integer("min_tokens", self.min_tokens, 0, int(np.iinfo(np.int64).max),
                       ">= 0 and at most 2**63 - 1")
        for token, bias in self.logit_bias.items():
            _check_integer("logit_bias token id", token, -2**63, 2**63 - 1)  # range: below
            if not bias_allowed(bias):
                raise ValueError(f"logit_bias value must be {BIAS_ALLOWED}, got {bias!r} for "
                                 f"token {token}")
        if vocab_size is not None:
            for name, ids in (("logit_bias", self.logit_bias), ("stop_token_ids", self.stop_token_ids)):
                bad = [t for t in ids if not 0 <= t < vocab_size]
                if bad:
                    raise ValueError(f"{name} must be token ids in [0, {vocab_size}), got {bad[0]}")

    def banned_at_first_step(self, also_banned=()) -> set[int]:
        """The token ids this request bans at its first step: a -inf
        logit_bias, the stop ids while min_tokens holds them back, and
        `also_banned` (a generation's one-token bad words)."""
        banned = {token for token, bias in self.logit_bias.items() if bias == -np.inf}
        banned.update(also_banned)
        if self.min_tokens > 0:
            banned.update(self.stop_token_ids)
        return banned

    def check_a_token_is_allowed(self, vocab_size: int, also_banned=()) -> None:
        """ValueError when the request bans every token at its first step:
        a -inf logit_bias, the stop ids while min_tokens holds them back, and
        `also_banned` (a generation's one-token bad words). The decode loop
        refuses such a request at submission: in a step its row would fail
        the whole sampler call, and with it the other requests' rows (a
        direct ``sample`` call raises for its own batch instead)."""
        if len(self.banned_at_first_step(also_banned)) >= vocab_size:
            raise ValueError(f"logit_bias (-inf), the stop ids held back by min_tokens and "
                             f"bad words ban all {vocab_size} tokens at the first step: at "
                             f"least one token must stay allowed")


def as_float32(value: float) -> float:
    """`value` as the kernels read a float parameter (1e39 is inf, 1e-46 is 0)."""
    with np.errstate(over="ignore", under="ignore"):
        return float(np.float32(value))


def _check_integer(name: str, value, low: int, high: int, allowed: str = "") -> None:
    """An integer (not a bool or a float) in [low, high], else ValueError
    (saying `allowed`, or the interval)."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    if not low <= value <= high:
        raise ValueError(f"{name} must be {allowed or f'in [{low}, {high}]'}, got {value!r}")


@dataclass
class History:
    """The token ids penalties look at: the prompt and what was generated."""

    prompt_ids: Sequence[int] = ()
    output_ids: Sequence[int] = ()


def ragged(lists: Sequence[Sequence[int]], dtype=np.int32) -> tuple[np.ndarray, np.ndarray]:
    """CSR form of a list of id lists: (offsets int64 [B + 1], values)."""
    lengths = np.fromiter((len(x) for x in lists), dtype=np.int64, count=len(lists))
    offsets = np.zeros(len(lists) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    values = np.fromiter((v for x in lists for v in x), dtype=np.int64, count=int(offsets[-1]))
    return offsets, values


#: SamplingBatch's id lists: (name of the offsets' prefix, the value arrays)
_ID_LISTS = (("bias", ("bias_ids", "bias_values")), ("ban", ("ban_ids",)),
             ("prompt", ("prompt_ids",)), ("output", ("output_ids",)))
#: SamplingBatch's per-row columns
_ROW_COLUMNS = (*(p.name for p in RULES), "seed", "step", "want_logprobs", "num_top_logprobs",
                "raw_logprobs", "given_token_ids")


@dataclass
class SamplingBatch:
    """Columnar parameters of B rows, the form the kernels (and Triton) use.

    Scalar columns have shape [B]. Ragged id lists are CSR pairs: offsets
    int64 [B + 1] and values int64 or int32 (row r owns
    values[offsets[r]:offsets[r+1]]; the kernels take int32).
    `ban_*` holds the ids banned at this step (stop ids of rows that have not
    reached min_tokens); `bias_values` is float32 aligned with `bias_ids`.
    """

    temperature: np.ndarray
    top_k: np.ndarray
    top_p: np.ndarray
    min_p: np.ndarray
    repetition_penalty: np.ndarray
    presence_penalty: np.ndarray
    frequency_penalty: np.ndarray
    seed: np.ndarray
    step: np.ndarray
    bias_offsets: np.ndarray
    bias_ids: np.ndarray
    bias_values: np.ndarray
    ban_offsets: np.ndarray
    ban_ids: np.ndarray
    prompt_offsets: np.ndarray
    prompt_ids: np.ndarray
    output_offsets: np.ndarray
    output_ids: np.ndarray
    #: bool [B]: rows whose chosen-token logprob is wanted (None: every row).
    #: A hint to samplers: the logprob costs an exp per logit, and speculative
    #: hot-vocab sampling cannot decide a row that wants it.
    want_logprobs: np.ndarray | None = None
    #: int [B]: how many of the most likely tokens' logprobs each row wants
    #: beside its own (``sampling.MAX_TOP_LOGPROBS`` at most; None: none).
    #: Like ``want_logprobs``, a row's own: it never changes its token.
    num_top_logprobs: np.ndarray | None = None
    #: bool [B]: rows whose logprobs (its own and its top-n) are the raw
    #: logits' log_softmax, before bias, bans, penalties and temperature
    #: (vLLM's default ``raw_logprobs``); None: none. Its token is drawn as
    #: if no logprob were asked.
    raw_logprobs: np.ndarray | None = None
    #: int64 [B]: a row's token where it was decided already (>= 0; -1: drawn
    #: here), of which only the logprobs asked are computed, under the row's
    #: parameters (its raw ones with ``raw_logprobs``); None: every row
    #: drawn. The hot-first handoff's scoring round (handoff.decide_hot_first).
    given_token_ids: np.ndarray | None = None
    #: the rows' prompt and output ids by reference (``histories``), the
    #: prompt and output lists then empty: what the sampler pool names to
    #: instances that map the region; ``with_histories`` gathers them
    history_ref: HistoryRef | None = None

    def __len__(self) -> int:
        return len(self.temperature)

    def with_histories(self) -> "SamplingBatch":
        """This batch with its histories as lists (itself where they are)."""
        if self.history_ref is None:
            return self
        prompt_offsets, prompt_ids, output_offsets, output_ids = self.history_ref.lists()
        return dataclasses.replace(self, prompt_offsets=prompt_offsets, prompt_ids=prompt_ids,
                                   output_offsets=output_offsets, output_ids=output_ids,
                                   history_ref=None)

    @classmethod
    def from_params(cls, params: Sequence[SamplingParams],
                    histories: Sequence[History] | None = None,
                    steps: Sequence[int] | None = None,
                    vocab_size: int | None = None) -> "SamplingBatch":
        """Pack per-request params, each validated first (against vocab_size
        when given). Unseeded requests get a fresh random seed; steps default
        to the number of output ids."""
        for row, p in enumerate(params):
            try:
                p.validate(vocab_size)
            except ValueError as error:
                raise ValueError(f"row {row}: {error}") from None
        histories = histories if histories is not None else [History()] * len(params)
        if len(histories) != len(params):
            raise ValueError(f"histories has {len(histories)} entries for {len(params)} rows")
        if steps is None:
            steps = [len(h.output_ids) for h in histories]
        bias_offsets, bias_ids = ragged([list(p.logit_bias) for p in params])
        bans = [list(p.stop_token_ids) if len(h.output_ids) < p.min_tokens else []
                for p, h in zip(params, histories)]
        ban_offsets, ban_ids = ragged(bans)
        prompt_offsets, prompt_ids = ragged([h.prompt_ids for h in histories])
        output_offsets, output_ids = ragged([h.output_ids for h in histories])
        return cls(
            **{column.name: np.asarray([getattr(p, column.name) for p in params], column.dtype)
               for column in RULES},
            seed=np.asarray([p.seed if p.seed is not None else secrets.randbits(64)
                             for p in params], dtype=np.uint64),
            step=np.asarray(steps, dtype=np.int64),
            bias_offsets=bias_offsets, bias_ids=bias_ids,
            bias_values=np.fromiter((v for p in params for v in p.logit_bias.values()),
                                    dtype=np.float64, count=bias_ids.size),
            ban_offsets=ban_offsets, ban_ids=ban_ids,
            prompt_offsets=prompt_offsets, prompt_ids=prompt_ids,
            output_offsets=output_offsets, output_ids=output_ids,
        )

    def take(self, rows) -> "SamplingBatch":
        """The batch of the given rows (int indices, in that order): new
        arrays, none shared with this batch's (the hot-first fallback changes
        them in place)."""
        rows = np.asarray(rows, dtype=np.int64)
        columns = self.__dict__  # by key: a getattr per field is a call per field
        fields = {name: np.asarray(value)[rows] for name in _ROW_COLUMNS
                  if (value := columns[name]) is not None}
        for name, values in _ID_LISTS:
            offsets = np.asarray(columns[f"{name}_offsets"], np.int64)
            if not offsets[-1]:  # no row has any: the common case, a few calls
                fields[f"{name}_offsets"] = np.zeros(rows.size + 1, np.int64)
                for field_name in values:
                    fields[field_name] = np.asarray(columns[field_name])[:0].copy()
                continue
            picked, index = ranges_index(offsets[rows], offsets[rows + 1] - offsets[rows])
            fields[f"{name}_offsets"] = picked
            for field_name in values:
                fields[field_name] = np.asarray(columns[field_name])[index]
        if self.history_ref is not None:
            fields["history_ref"] = self.history_ref.take(rows)
        return SamplingBatch(**fields)

    def validate(self, vocab_size: int) -> None:
        """Raise ValueError naming the row, the field and the allowed range."""
        batch = len(self)
        for param in RULES:
            values = np.asarray(getattr(self, param.name))
            if values.shape != (batch,):
                raise ValueError(f"{param.name} must have shape [{batch}], "
                                 f"got {list(values.shape)}")
            message = first_violation(param.name, values, param.rule(values), param.allowed)
            if message:
                raise ValueError(message)
        for name in ("seed", "step"):
            if np.shape(getattr(self, name)) != (batch,):
                raise ValueError(f"{name} must have shape [{batch}], "
                                 f"got {list(np.shape(getattr(self, name)))}")
        step = np.asarray(self.step)
        message = first_violation("step", step, step >= 0, ">= 0")
        if message:
            raise ValueError(message)
        for name in ("bias", "ban", "prompt", "output"):
            offsets = np.asarray(getattr(self, f"{name}_offsets"))
            ids = np.asarray(getattr(self, f"{name}_ids"))
            if (offsets.shape != (batch + 1,) or offsets[0] != 0
                    or (offsets[1:] < offsets[:-1]).any() or offsets[-1] != ids.size):
                raise ValueError(f"{name}_offsets must be {batch + 1} non-decreasing offsets "
                                 f"from 0 to len({name}_ids)={ids.size}")
            check_token_ids(f"{name}_ids", ids, offsets, vocab_size)
        if self.given_token_ids is not None:
            given = np.asarray(self.given_token_ids)
            if given.shape != (batch,):
                raise ValueError(f"given_token_ids must have shape [{batch}], got {list(given.shape)}")
            message = first_violation("given_token_ids", given, (given >= -1) & (given < vocab_size),
                                      f"in [-1, {vocab_size})")
            if message:
                raise ValueError(message)
        self.validate_bias(vocab_size)

    def validate_bias(self, vocab_size: int) -> None:
        """The part of ``validate`` that a decoder which built the offsets
        and range-checked every id itself still needs (sampler_decode): bias
        values BIAS_ALLOWED, one per id, no id twice in a row's bias."""
        bias = np.asarray(self.bias_values, dtype=np.float64)
        if bias.shape != np.shape(self.bias_ids):
            raise ValueError(f"bias_values must hold one value per bias_ids entry: "
                             f"{np.shape(self.bias_ids)[0]} ids, shape {list(bias.shape)}")
        if bias.size == 0:
            return
        message = first_violation("logit_bias value", bias, bias_allowed(bias), BIAS_ALLOWED,
                                  self.bias_offsets)
        if message:
            raise ValueError(message)
        rows = np.searchsorted(self.bias_offsets, np.arange(bias.size), side="right") - 1
        keyed = np.asarray(self.bias_ids, dtype=np.int64) + rows.astype(np.int64) * vocab_size
        unique, counts = np.unique(keyed, return_counts=True)
        if np.any(counts > 1):
            duplicate = int(unique[np.argmax(counts > 1)])
            raise ValueError(f"row {duplicate // vocab_size}: logit_bias names token "
                             f"{duplicate % vocab_size} more than once")
