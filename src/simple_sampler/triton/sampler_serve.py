"""The sampler model's requests served: decoded (``sampler_decode``) or
taken by the C path (``sampler_packed``), sampled, and answered with the
output tensors (``serve_request``, what ``backends/simple_sampler/model.py``
runs per request)."""
from __future__ import annotations

import dataclasses
from typing import Mapping, NamedTuple

import numpy as np

from ..handoff import decide_from_full_rows, sample_compact
from ..params import SamplingBatch
from ..sampling import sample
from ..schema import HOT_SET_REFUSAL, TOP_OUTPUTS, InvalidRequest
from ..shvs.hot_vocab import fingerprint
from .sampler_codec import TOP_PADDING, decided_all
from .sampler_decode import RowsRequest, decode_request
from .sampler_packed import decide_plain_compact, is_plain_compact

class SamplerAnswer(NamedTuple):
    """``serve_request``'s answer: the output tensors, the rows' SHVS
    outcomes (as ``sample_request``'s), the rows, how many undecided compact
    rows were decided from their full rows in place, and the decoded batch
    (None where the C path decided the request: no row was tried by SHVS)."""

    outputs: dict[str, np.ndarray]
    outcomes: np.ndarray
    rows: int
    in_place: int
    batch: SamplingBatch | None


def serve_request(inputs: Mapping[str, object], vocab_size: int = 0, hot_vocab=None,
                  reader=None, num_threads: int = 1) -> SamplerAnswer:
    """One request to the sampler model, what its ``execute`` runs:
    ``decode_request``, ``sample_request`` and, for rows read from the
    llm's arena, the check that their slot was not reused meanwhile
    (``RowReader.check``, StaleRows). The llm model's own compact requests
    (``sampler_packed.decide_plain_compact``) are decided by one C call
    (``_sampling.decide_packed_compact``) where the general path makes a
    few hundred Python calls (docs/COPIES.md); a request that call does not
    take (top logprobs, or anything it would refuse: the general path names
    what is wrong), and one whose undecided rows are to be decided from
    their full rows in place, goes the general way: the same outputs
    (tests/test_sampler_io.py). On the C path ``logits_ref`` is resolved
    (mapped, its region, slot and generation checked) only when a row is
    left undecided, the only case that reads it; a request that references
    the wrong number of rows is refused either way. Raises InvalidRequest as
    decode_request and sample_request do, and for a ``hot_vocab_fingerprint``
    that is not this sampler's hot set (``check_hot_set``)."""
    check_hot_set(inputs, hot_vocab)
    if is_plain_compact(inputs, hot_vocab):
        outputs = decide_plain_compact(inputs, vocab_size, hot_vocab, reader, num_threads)
        if outputs is not None:
            rows = len(outputs["output_ids"])
            return SamplerAnswer(outputs, np.full(rows, -1, np.int8), rows, 0, None)
    request = decode_request(inputs, vocab_size, hot_vocab, reader)
    outputs, outcomes = sample_request(request, num_threads, hot_vocab)
    if request.logits_ref is not None:
        reader.check(request.logits_ref)
    outcome = outputs.get("handoff_outcome")
    in_place = (int((outcome != 0).sum())
                if outcome is not None and request.logits is not None else 0)
    return SamplerAnswer(outputs, outcomes, len(request), in_place, request.batch)


def check_hot_set(inputs: Mapping[str, object], hot_vocab) -> None:
    """A request naming the hot set it expects (``hot_vocab_fingerprint``:
    a decode loop sends it to sampler servers other than its own) is
    refused unless that is this sampler's: a row SHVS decides draws another
    token under another hot set, so a seeded request's text would depend on
    the server each step went to, a retry's included."""
    given = inputs.get("hot_vocab_fingerprint")
    if given is None:
        return
    own = fingerprint(hot_vocab)
    wanted = {int(value) for value in np.asarray(given).reshape(-1)}
    if wanted - {own}:
        def name(value: int) -> str:
            return f"hot set {value:#x}" if value else "no hot set"

        raise InvalidRequest(
            f"{HOT_SET_REFUSAL}the request's other samplers hold {name(max(wanted - {own}))}"
            f", this one {name(own)}: give every sampler server of a decode loop the same "
            f"--hot-vocab (or none), or its tokens would depend on the server")


def sample_request(request: RowsRequest, num_threads: int = 1,
                   hot_vocab=None) -> tuple[dict[str, np.ndarray], np.ndarray]:
    """Sample one request from ``decode_request`` (whose batch is checked, so
    ``sample`` does not check it again); returns (output name -> array, the rows'
    SHVS outcomes int8 [B]: 1 decided from the hot set, 0 fell back, -1 not
    tried). `hot_vocab`: a ``HotVocab`` or None (SHVS off).

    Raises InvalidRequest for a row the kernels refuse (NaN or +inf logits,
    every token banned), naming the row and column.
    """
    want_logprob = bool(request.return_log_probs.any())
    n_top = int(request.num_top_logprobs.max())
    # each row's own options, not the request's widest: a row's path (SHVS,
    # the compact decision) and so its token must not depend on another's
    batch = dataclasses.replace(request.batch, want_logprobs=request.return_log_probs)
    n_tops = request.num_top_logprobs if n_top else 0
    try:
        if request.compact is not None:
            out = sample_compact(request.compact, batch, hot_vocab,
                                 num_top_logprobs=n_tops, return_logprobs=want_logprob,
                                 num_threads=num_threads, validated=True, shapes_checked=True)
            if request.logits is not None and out.undecided.any():  # their full rows are mapped
                decide_from_full_rows(out, request.compact, batch, hot_vocab,
                                      request.logits, request.return_log_probs,
                                      num_top_logprobs=n_tops, num_threads=num_threads)
        else:
            out = sample(request.logits, batch, num_top_logprobs=n_tops,
                         return_logprobs=want_logprob, num_threads=num_threads,
                         hot_vocab=hot_vocab, validated=True)  # decode_request checked the batch
    except ValueError as error:
        raise InvalidRequest(str(error)) from None
    outputs = {"output_ids": out.token_ids.astype(np.int32)[:, None]}
    if request.compact is not None and not decided_all(out.outcome):
        outputs["handoff_outcome"] = out.outcome[:, None]
    if want_logprob:
        outputs["output_log_probs"] = np.where(request.return_log_probs, out.logprobs,
                                               np.float32(np.nan))[:, None].astype(np.float32)
    if n_top:
        # a row's columns beyond its n, or beyond V (the kernels' width), are padding
        width = out.top_token_ids.shape[1]
        beyond = ((np.arange(n_top)[None, :] >= request.num_top_logprobs[:, None])
                  | (np.arange(n_top)[None, :] >= width))
        for name, (fill, dtype), columns in zip(TOP_OUTPUTS, TOP_PADDING,
                                                (out.top_token_ids, out.top_logprobs)):
            outputs[name] = np.where(beyond, dtype(fill), _widened(columns, n_top))
    return outputs, out.hot_accepted


def _widened(columns: np.ndarray, width: int) -> np.ndarray:
    """[B, n] columns as [B, width] (width >= n; the new columns are masked)."""
    return np.pad(columns, ((0, 0), (0, width - columns.shape[1])))
