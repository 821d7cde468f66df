"""Python API over the Cython kernels.

``sample(logits, batch)`` draws one token per row of a [B, V] logits array,
exactly from the distribution the semantics in ``simple_sampler._sampling``
(vLLM's order) define, with randomness keyed by (seed, step) only: the token
of a row never depends on batch size, row position or thread count.

Logits: float32, float16 or bfloat16, as a numpy array (bfloat16 through the
``ml_dtypes.bfloat16`` dtype) or a CPU torch tensor; shape [B, V] or [V].
Rows are read in their own dtype (no float32 copy of the batch). Every row
must be contiguous; rows may be strided. -inf marks a banned token. NaN and
+inf are rejected (softmax is undefined there), as is a row whose tokens are
all banned.

Logprobs: ``logprobs[r]`` is the log-probability of the chosen token under
softmax(z), z = penalized logits / temperature (temperature 1 for greedy
rows), over the whole vocabulary, before min_p / top_k / top_p truncation.
vLLM's differ unless the temperature is 1 and no bias, ban or penalty
applies: its default ``raw_logprobs`` are the model's log_softmax before all
of these, its ``processed_logprobs`` are taken after the truncation too
(vllm/v1/sample/sampler.py, ``Sampler.forward``). ``top_logprobs`` give the n
most likely tokens under the same distribution, most likely first, ties by
lower token id. A row ``batch.raw_logprobs`` names has vLLM's raw ones
instead (both): softmax of its logits as given, z = logits, its token drawn
as if it asked for none (so the same token either way).

Hot vocabulary (SHVS): ``sample(..., hot_vocab=HotVocab)`` decides rows
from a hot subset of the vocabulary when cheap bounds prove it exact, and
falls back to the exact full computation otherwise; the distribution of every
row is unchanged (see ``simple_sampler.shvs``). A seeded row's token is a
function of (seed, step, row, parameters, hot set): it may differ between
SHVS on and off, never between batches, positions, threads or instances that
use the same hot set.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Sequence

import ml_dtypes
import numpy as np

from . import _sampling
from ._sampling import Dtype, RowError
from .params import RULES, History, SamplingBatch, SamplingParams, is_greedy
from .shvs.hot_vocab import HotVocab

#: Most top-n logprobs a call may ask for (vLLM's default max_logprobs).
MAX_TOP_LOGPROBS = 20

_ROW_ERRORS = {
    RowError.ERROR_NAN: "logits must not contain NaN; found at column {column}",
    RowError.ERROR_POSITIVE_INFINITY:
        "logits must be finite or -inf, and stay finite in float32 once bias, penalties and "
        "temperature apply; found +inf at column {column}",
    RowError.ERROR_ALL_BANNED: "every token is banned (-inf after bias, bans and penalties)",
    RowError.ERROR_OUT_OF_MEMORY: "out of memory allocating the sampler workspace",
    RowError.ERROR_UNLISTED_OVERRIDE:
        "touched_ids must list every id the row's bias, bans or penalties change; "
        "{column} is missing",
    RowError.ERROR_INTERNAL: "the sampler's softmax mass came out NaN from finite logits",
}
#: row errors that are the sampler's, not the request's (not a ValueError)
_SAMPLER_ERRORS = {RowError.ERROR_OUT_OF_MEMORY: MemoryError, RowError.ERROR_INTERNAL: RuntimeError}


@dataclass
class SampleOutput:
    """token_ids int64 [B]; logprobs float32 [B] (NaN when not asked);
    top_token_ids int32 [B, n] and top_logprobs float32 [B, n];
    hot_accepted int8 [B]: 1 = decided from the hot set alone, 0 = SHVS
    tried and the exact full-row computation was needed, -1 = not tried (no
    hot set, or a greedy / min_p / top_k / logprob row, which the full path
    serves in one max pass anyway)."""

    token_ids: np.ndarray
    logprobs: np.ndarray
    top_token_ids: np.ndarray
    top_logprobs: np.ndarray
    hot_accepted: np.ndarray


NUM_THREADS_ENV = "SIMPLE_SAMPLER_NUM_THREADS"


def default_num_threads() -> int:
    """SIMPLE_SAMPLER_NUM_THREADS, else 1: a Triton deployment scales with
    instances (processes), each sampling its requests on one thread."""
    value = os.environ.get(NUM_THREADS_ENV, "1")
    threads = int(value) if value.strip().isdigit() else 0
    if threads < 1:
        raise ValueError(f"{NUM_THREADS_ENV} must be an integer >= 1, got {value!r}")
    return threads


def is_torch_tensor(value) -> bool:
    """Whether `value` is a torch tensor, without importing torch: the
    sampler instances get numpy arrays, and importing torch costs each of
    them seconds of CPU as it starts."""
    return type(value).__module__.startswith("torch")


def logits_array(logits) -> np.ndarray:
    """``logits`` (numpy, or a CPU torch tensor) as a numpy array without a
    copy; torch bfloat16 becomes ``ml_dtypes.bfloat16``, which numpy lacks."""
    if is_torch_tensor(logits):
        import torch

        if logits.device.type != "cpu":
            raise ValueError(f"logits must be on the CPU, got device {logits.device}")
        if logits.dtype == torch.bfloat16:
            return logits.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
        return logits.numpy()
    return np.asarray(logits)


#: DLPack (type code, bits) -> numpy dtype, the logits' dtypes
_DLPACK_DTYPES = {(2, 32): np.dtype(np.float32), (2, 16): np.dtype(np.float16),
                  (4, 16): np.dtype(ml_dtypes.bfloat16)}


def dlpack_array(capsule) -> np.ndarray:
    """A CPU float32 / float16 / bfloat16 tensor's DLPack capsule (unconsumed,
    e.g. a Triton ``pb_utils.Tensor.to_dlpack()``) as a read-only numpy
    array over the same memory, bfloat16 as ``ml_dtypes.bfloat16``: what
    numpy's own ``from_dlpack`` refuses, without torch. The array keeps the
    tensor alive. ValueError (naming why) for any other capsule
    (``_sampling.DLPackBytes``) or dtype."""
    raw = _sampling.DLPackBytes(capsule)
    dtype = _DLPACK_DTYPES.get((raw.code, raw.bits))
    if dtype is None:
        raise ValueError(f"a DLPack logits tensor must be float32, float16 or bfloat16, got "
                         f"type code {raw.code} of {raw.bits} bits")
    return np.frombuffer(raw, dtype).reshape(raw.shape)


def logits_tensor(array):
    """A numpy float32 / float16 / bfloat16 (``ml_dtypes``) array as a CPU
    torch tensor over the same memory, no copy: ``logits_array``'s inverse.
    A read-only array gives a tensor nothing may write to (torch warns of
    that, and is silenced here: the logits are only read)."""
    import warnings

    import torch

    array = np.asarray(array)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        if array.dtype == ml_dtypes.bfloat16:
            return torch.from_numpy(array.view(np.int16)).view(torch.bfloat16)
        return torch.from_numpy(array)


_KERNEL_DTYPES = {np.dtype(np.float32): Dtype.DTYPE_FLOAT32,
                  np.dtype(np.float16): Dtype.DTYPE_FLOAT16,
                  np.dtype(ml_dtypes.bfloat16): Dtype.DTYPE_BFLOAT16}


def kernel_rows(logits) -> tuple[np.ndarray, int]:
    """(uint8 [B, V * itemsize] view of the rows, kernel dtype code), no copy
    unless a row is not contiguous."""
    array = logits_array(logits)
    codes = _KERNEL_DTYPES
    if array.dtype not in codes:
        raise ValueError(f"logits must be float32, float16 or bfloat16, got {array.dtype}")
    if array.ndim == 1:
        array = array[None, :]
    if array.ndim != 2 or array.shape[1] == 0:
        raise ValueError(f"logits must have shape [B, V] with V >= 1, got {list(array.shape)}")
    if array.strides[1] != array.itemsize:
        array = np.ascontiguousarray(array)
    return array.view(np.uint8), codes[array.dtype]


def sample(logits, batch: SamplingBatch, *, num_top_logprobs: int = 0,
           return_logprobs: bool = True, num_threads: int | None = None,
           hot_vocab: HotVocab | None = None, validated: bool = False) -> SampleOutput:
    """Sample one token per row.

    logits: [B, V] (or [V]) float32 / float16 / bfloat16 rows.
    batch: the rows' parameters and histories (``SamplingBatch``), length B.
    num_top_logprobs: n in [0, 20], or n per row ([B]): also return the n
        most likely tokens (at most V; a row's columns beyond its n, or V,
        are -1 and -inf).
    return_logprobs: compute the chosen token's logprob (costs an exp per
        logit when no truncation needs the row's mass anyway) for the rows
        ``batch.want_logprobs`` names (None: every row); NaN for the others.
    num_threads: threads over rows (default ``default_num_threads()``).
    hot_vocab: a hot set for speculative hot-vocab sampling (None: off); its
        vocab_size must equal V. Rows that ask for logprobs or top logprobs
        are served by the full path; each row's own options decide, so a row
        draws the same token whatever the other rows of the batch ask.
    validated: the caller has just run ``batch.validate(V)`` on this very
        batch (the sampler server's ``decode_request`` does), so it is not
        run again. Every other caller leaves it False: the check keeps ids
        and offsets the kernels index by inside their arrays, and costs
        ~0.1 ms for 256 rows with 1,000-id histories (docs/DECODE_LOOP.md).

    Raises ValueError naming the row and field for bad parameters, token ids
    outside [0, V), NaN or +inf logits, a row with every token banned, or a
    hot_vocab built for another vocabulary size.
    """
    rows, dtype = kernel_rows(logits)
    vocab = rows.shape[1] // (4 if dtype == Dtype.DTYPE_FLOAT32 else 2)
    if len(batch) != rows.shape[0]:
        raise ValueError(f"logits has {rows.shape[0]} rows but the parameters have {len(batch)}")
    if hot_vocab is not None and hot_vocab.vocab_size != vocab:
        raise ValueError(f"hot_vocab.vocab_size is {hot_vocab.vocab_size} but the logits have "
                         f"V={vocab} columns")
    out = empty_output(len(batch), top_width(num_top_logprobs, vocab))
    params, threads = kernel_params(batch, vocab, num_top_logprobs, num_threads, validated)
    hot_ids, hot_block_start, hot_bits = (hot_vocab.kernel_arrays() if hot_vocab is not None
                                          else HotVocab.EMPTY_KERNEL_ARRAYS)
    errors = np.empty(len(batch), np.int32)
    error_columns = np.empty(len(batch), np.int64)
    _sampling.sample_batch(_sampling.KernelBatch(
        logits_bytes=rows, dtype=dtype, **params, want_logprob=return_logprobs,
        num_threads=threads, tokens=out.token_ids, logprobs=out.logprobs,
        top_tokens=out.top_token_ids, top_logprobs=out.top_logprobs, errors=errors,
        error_columns=error_columns, hot_ids=hot_ids, hot_block_start=hot_block_start,
        hot_bits=hot_bits, hot_outcomes=out.hot_accepted,
    ))
    raise_row_errors(errors, error_columns)
    return chosen_as_listed(out)


def chosen_as_listed(out: SampleOutput) -> SampleOutput:
    """Give each row whose chosen token is among its top logprobs that
    entry's logprob (rows whose logprob was not asked, NaN, aside): the
    kernels compute the two in different float orders, an ulp apart, and a
    client reads them as one value (vLLM's come from one tensor).
    Returns `out`."""
    top = out.top_token_ids
    if not top.shape[1]:
        return out
    listed = (top == out.token_ids[:, None]) & (top >= 0)  # -1: padding, or undecided
    found = listed.any(axis=1) & ~np.isnan(out.logprobs)
    index = np.flatnonzero(found)
    out.logprobs[index] = out.top_logprobs[index, listed[found].argmax(axis=1)]
    return out


def _greedy(temperature: np.ndarray, vocab: int) -> np.ndarray:
    return is_greedy(temperature)


def _inverse_temperature(temperature: np.ndarray, vocab: int) -> np.ndarray:
    greedy = _greedy(temperature, vocab)
    return np.where(greedy, 1.0, 1.0 / np.where(greedy, 1.0, temperature))


def _top_k(top_k: np.ndarray, vocab: int) -> np.ndarray:
    return np.where((top_k <= 0) | (top_k >= vocab), 0, top_k)


#: How the kernels read a parameter of ``params.RULES`` when not as its column:
#: its fields of the C struct ``RowScalars`` (cython_kernels/row_scalars.pxd),
#: each (name, dtype, conversion from the batch column and V, None: as it is).
_KERNEL_CONVERSIONS = {
    "temperature": (("inverse_temperature", np.float32, _inverse_temperature),
                    ("greedy", np.uint8, _greedy)),
    "top_k": (("top_k", np.int64, _top_k),),
    "repetition_penalty": (("repetition_penalty", np.float32, None),),
    "presence_penalty": (("presence_penalty", np.float32, None),),
    "frequency_penalty": (("frequency_penalty", np.float32, None),),
}
#: Every parameter's fields; the others are their column as it is.
KERNEL_FIELDS = {p.name: _KERNEL_CONVERSIONS.get(p.name, ((p.name, p.dtype, None),))
                 for p in RULES}
#: One row's kernel scalars: the table's parameters in its order, then the
#: draw's key; aligned as C lays out ``RowScalars``.
ROW_SCALARS = np.dtype([(name, dtype) for param in RULES
                        for name, dtype, _ in KERNEL_FIELDS[param.name]]
                       + [("seed", np.uint64), ("step", np.uint64)], align=True)


def kernel_params(batch: SamplingBatch, vocab: int, num_top_logprobs: int,
                  num_threads: int | None, validated: bool = False) -> tuple[dict, int]:
    """(the KernelBatch row-parameter fields, thread count) for a batch of
    rows of V=vocab, after checking it unless ``validated`` (see ``sample``;
    shared by ``sample`` and ``handoff.sample_compact``). The fields include
    the rows' own options (``row_options``); histories by reference are
    gathered here (``SamplingBatch.with_histories``)."""
    batch = batch.with_histories()
    if not validated:
        batch.validate(vocab)
    threads = default_num_threads() if num_threads is None else num_threads
    if threads < 1:
        raise ValueError(f"num_threads must be >= 1, got {threads}")
    scalars = np.empty(len(batch), ROW_SCALARS)
    columns = batch.__dict__  # by key: a getattr is a call, on every request
    for param in RULES:
        column = np.asarray(columns[param.name], param.dtype)
        for name, _, convert in KERNEL_FIELDS[param.name]:
            scalars[name] = column if convert is None else convert(column, vocab)
    scalars["seed"] = batch.seed
    scalars["step"] = batch.step
    contiguous = np.ascontiguousarray
    params = dict(
        scalars=scalars,
        bias_offsets=contiguous(batch.bias_offsets, np.int64),
        bias_ids=contiguous(batch.bias_ids, np.int32),
        bias_values=contiguous(batch.bias_values, np.float32),
        ban_offsets=contiguous(batch.ban_offsets, np.int64),
        ban_ids=contiguous(batch.ban_ids, np.int32),
        prompt_offsets=contiguous(batch.prompt_offsets, np.int64),
        prompt_ids=contiguous(batch.prompt_ids, np.int32),
        output_offsets=contiguous(batch.output_offsets, np.int64),
        output_ids=contiguous(batch.output_ids, np.int32),
        **row_options(batch, num_top_logprobs, vocab),
    )
    return params, threads


def top_width(num_top_logprobs, vocab: int) -> int:
    """The top-n columns of a batch's output: the most any row wants (one n
    for every row, or n per row [B]), at most V; checks each n."""
    wanted = np.asarray(num_top_logprobs)
    if wanted.size and not (wanted.min() >= 0 and wanted.max() <= MAX_TOP_LOGPROBS):
        raise ValueError(f"num_top_logprobs must be in [0, {MAX_TOP_LOGPROBS}], got "
                         f"{wanted.max() if wanted.max() > MAX_TOP_LOGPROBS else wanted.min()}")
    return min(int(wanted.max()) if wanted.size else 0, vocab)


def row_options(batch: SamplingBatch, num_top_logprobs, vocab: int) -> dict:
    """The KernelBatch fields of what each row itself asked for: its
    logprob (``batch.want_logprobs``; None: every row) and its top-n (n per
    row [B], or one n for every row), so that no row's path, SHVS or the
    compact decision, and so no row's token, depends on another row's."""
    options = {}
    if batch.want_logprobs is not None:
        options["want_logprob_rows"] = np.ascontiguousarray(batch.want_logprobs, np.uint8)
    if batch.raw_logprobs is not None:
        options["raw_logprob_rows"] = np.ascontiguousarray(batch.raw_logprobs, np.uint8)
    if batch.given_token_ids is not None:
        options["given_tokens"] = np.ascontiguousarray(batch.given_token_ids, np.int64)
    if np.ndim(num_top_logprobs):
        options["n_top_rows"] = np.minimum(np.asarray(num_top_logprobs), vocab).astype(np.int32)
    return options


def empty_output(size: int, n_top: int) -> SampleOutput:
    """Output buffers for `size` rows and n_top top logprobs."""
    return SampleOutput(
        token_ids=np.empty(size, np.int64),
        logprobs=np.empty(size, np.float32),
        top_token_ids=np.full((size, n_top), -1, np.int32),
        top_logprobs=np.full((size, n_top), -np.inf, np.float32),
        hot_accepted=np.empty(size, np.int8),
    )


def raise_row_errors(errors: np.ndarray, error_columns: np.ndarray) -> None:
    """ValueError naming the first row the kernel could not sample
    (MemoryError or RuntimeError where the failure is the sampler's own)."""
    failed = np.flatnonzero(errors)
    if failed.size:
        row = int(failed[0])
        code = RowError(int(errors[row]))
        detail = _ROW_ERRORS[code].format(column=int(error_columns[row]))
        raise _SAMPLER_ERRORS.get(code, ValueError)(f"row {row}: {detail}")


def sample_requests(logits, params: Sequence[SamplingParams],
                    histories: Sequence[History] | None = None,
                    steps: Sequence[int] | None = None, **kwargs) -> SampleOutput:
    """``sample`` for per-request dataclasses (see ``SamplingBatch.from_params``)."""
    vocab = np.shape(logits)[-1] if np.ndim(logits) else None
    return sample(logits, SamplingBatch.from_params(params, histories, steps, vocab), **kwargs)
