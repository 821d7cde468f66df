"""The decode loop's sampler with the hot-first handoff (docs/HANDOFF.md),
over a :class:`~simple_sampler.triton.sampler_pool.SamplerPool`."""
from __future__ import annotations

import asyncio
from typing import NamedTuple

import numpy as np
import torch

from .._sampling import HandoffOutcome
from ..handoff import (DEFAULT_COLD_TOP, CompactRows, HandoffOutput, decide_hot_first,
                       scored_rows, tokens_batch)
from ..params import SamplingBatch
from ..sampling import SampleOutput, empty_output
from ..serving.engine import SummarizesHotFirst
from ..serving.hot_first import compact_rows, rows_in_place, rows_to_host, undecidable_rows
from ..serving.samplers import SampleResult, result_parts, widest_top
from ..shvs.hot_vocab import HotVocab
from ..schema import TOP_OUTPUTS
from .sampler_codec import batch_arrays, compact_arrays, outcome_of

#: Compact rows per request at least (but one request per instance at most):
#: a request costs a sampler stub a fixed share (tensors, decoding, its
#: response: about as much as 100 compact rows' kernel time, docs/COPIES.md),
#: so a step of a few dozen rows is not worth splitting over the instances.
COMPACT_ROWS_PER_REQUEST = 128


class StepSummary(NamedTuple):
    """``HotFirstSampler.summarize``'s result: a step's compact rows, their
    inputs (``compact_arrays(rows, packed=True)``), the parameters'
    (``batch_arrays(batch, packed=True)``), and the full rows' lease where
    they already lie in the pool's arena (``SamplerPool.reference``; None
    elsewhere): when a row may be left undecided (`undecidable`,
    ``hot_first.undecidable_rows``), the compact requests to the instances
    that map it carry them by reference, and those decide their undecided
    rows in place; otherwise the requests name no full row (a reference
    costs the sampler its checks)."""

    rows: CompactRows
    inputs: dict[str, np.ndarray]
    scalars: dict[str, np.ndarray]
    full_rows: object = None
    undecidable: bool = True


class HotFirstSampler:
    """The decode loop's sampler (``async sampler(logits, batch) ->
    (token_ids, logprobs)``, serving/decoder.py) with the hot-first handoff:
    it summarizes the logits where they are (``compact_rows``, on the
    engine's device, each untruncated row's cold token drawn there too, so
    a draw landing in C needs no full row: docs/HANDOFF.md, "The cold
    draw"), sends the compact rows, then the undecided rows whole in a
    second request (sharded as full rows are: one request for a few), and
    merges the answers (``handoff.decide_hot_first``). When the full rows already lie in the
    pool's arena (``SamplerPool.reference``) and a row may be left
    undecided (``hot_first.undecidable_rows``), the compact requests to the
    instances that map it carry them by reference and those instances decide
    their undecided rows in place (``handoff.decide_from_full_rows``): no
    second request, the same tokens.

    pool: a ``SamplerPool`` (``send(inputs, batch)`` for the compact inputs,
    ``pool(logits, batch)`` for full rows) whose samplers hold the same hot
    set. summary: the engine's own summary (``compact_rows``), None for
    ``hot_first_summary`` here. rows_per_request: compact rows per request
    at least (COMPACT_ROWS_PER_REQUEST). cold_draw: draw the cold tokens
    with the summary (``compact_rows``). The second round is sharded as
    the pool shards full rows: with one lane, over every instance
    (``sampler_pool.ONE_LANE_ROWS_PER_REQUEST``, measured for this round:
    docs/results/fallback-shards-2026-11-29.md). ``stats`` counts rows,
    fallbacks, and the fallbacks decided in place."""

    #: the rows' top logprobs come back (serving/samplers.SampleResult)
    gives_top_logprobs = True

    def __init__(self, pool, hot_vocab: HotVocab, cold_top: int = DEFAULT_COLD_TOP,
                 summary=None, rows_per_request: int = COMPACT_ROWS_PER_REQUEST,
                 cold_draw: bool = True):
        self.pool = pool
        self.hot_vocab = hot_vocab
        self.cold_top = cold_top
        self.summary = summary
        self.rows_per_request = rows_per_request
        self.cold_draw = cold_draw
        self.stats = {"rows": 0, "need_full": 0, "need_cold": 0, "in_place": 0}

    @property
    def history_arena(self):
        """The pool's (``SamplerPool.history_arena``): the summary's touched
        lists gather what they read; the requests name the histories."""
        return self.pool.history_arena

    def summarize(self, logits: torch.Tensor, batch: SamplingBatch) -> StepSummary:
        """The data plane's half: the batch's compact rows (``compact_rows``)
        and the request's inputs, ready to send (the compact rows' and the
        parameters', ``batch_arrays(batch, packed=True)``, which depend on
        the batch alone). The decode loop runs it in its data-plane thread
        right behind the forward (serving/decoder.py), where an engine that
        models the summary as device time (the simulated one) hides it, and
        passes the result to ``__call__`` or ``sample_now``."""
        batch = tokens_batch(batch)  # tokens as without logprobs (handoff.decide_hot_first)
        rows = compact_rows(logits, batch, self.hot_vocab, self.cold_top, self.summary,
                            self.cold_draw)
        return StepSummary(rows, compact_arrays(rows, packed=True),
                           batch_arrays(batch, packed=True), self.pool.reference(logits),
                           bool(undecidable_rows(batch, self.cold_draw).any()))

    async def __call__(self, logits: torch.Tensor, batch: SamplingBatch, summary=None):
        if summary is None:
            # Off the event loop: on a CPU the summary is milliseconds of
            # torch work per step (docs/HANDOFF.md), and another lane may be ready.
            summary = await asyncio.to_thread(self.summarize, logits, batch)
        counts: list[dict[str, int]] = []
        out = await decide_hot_first(summary.rows, batch, self.hot_vocab,
                                     lambda rows, batch: self._decide(summary, batch, counts),
                                     lambda undecided, second: self._sample_undecided(
                                         logits, undecided, second, summary.full_rows))
        # Counted once the call has an answer: a call whose second round is
        # refused is sampled again in parts (serving/samplers.
        # sample_around_refusals), whose rows count then.
        for each in counts:
            self._count(each)
        return _result(out, batch)

    async def _sample_undecided(self, logits: torch.Tensor, undecided, batch: SamplingBatch,
                                full_rows=None):
        """The rows the compact decision left undecided (or that ask for
        top or raw logprobs), fetched and sampled whole. Where the logits lie
        in a shared region of the arena (`full_rows`, the summary's lease:
        the simulated engine's bank, the TensorRT-LLM bridge's staging block)
        and the rows are evenly spaced, they go by reference where they lie
        (``rows_in_place``), not gathered and copied into a slot. (Not rows
        of a ring slot the engine took: the pool would claim that slot and
        give it back after this round, while the step's rows are still read.)
        From a GPU the fetch runs off the event loop: its wait is behind
        whatever the stream holds, another lane's forward included, while
        the loop has that lane's and the streams' work to do."""
        in_place = rows_in_place(logits, undecided) if full_rows is not None else None
        if in_place is not None:
            rows = in_place
        elif logits.device.type == "cpu":
            rows = rows_to_host(logits, undecided)
        else:
            rows = await asyncio.to_thread(rows_to_host, logits, undecided)
        return await self._sample_full(rows, batch)

    def sample_now(self, logits: torch.Tensor, batch: SamplingBatch, summary):
        """The synchronous path (serving/decoder.py), in the data-plane
        thread: the compact rows of `summary` (``summarize``'s) in the
        step's requests (one per instance, at most ``rows_per_request`` rows
        apart: ``_most_shards``), answered here (``SamplerPool.send_now``:
        sent at once, the first from this thread), when no row may
        be left undecided or the full rows lie in the arena (an undecided
        row is decided in that same request). A row left undecided all the
        same (the simulated engine's cold draw finds no weight where the
        sums round so) is sent once more with the full rows, where they lie
        in the arena. Its SampleResult, or None when it cannot answer
        so: a row may need its full row and the rows are not in the arena, a
        row left undecided without them, a target down or unable to map
        the arena, a request failed (the event loop's ``__call__`` sends them again,
        with the pool's failover: a row's draw is keyed by its seed and
        step, so the tokens are the same)."""
        lease = self._lease(summary)
        if (summary.undecidable and lease is None) or scored_rows(batch).any():
            return None  # top and raw logprobs come from full rows: the event loop's rounds
        answer = self._send_now(summary, batch, lease)
        if (answer is not None and answer[0].undecided.any() and lease is None
                and summary.full_rows is not None):
            answer = self._send_now(summary, batch, summary.full_rows)
        if answer is None or answer[0].undecided.any():  # no full row mapped: two rounds
            return None
        out, counts = answer
        self._count(counts)
        return _result(out, batch)

    @staticmethod
    def _lease(summary: StepSummary):
        """The full rows' lease to send beside the compact rows: only where
        a row may be left undecided."""
        return summary.full_rows if summary.undecidable else None

    def _send_now(self, summary: StepSummary, batch: SamplingBatch,
                  lease) -> tuple[HandoffOutput, dict[str, int]] | None:
        outputs = self.pool.send_now(summary.inputs, batch, lease,
                                     most_shards=self._most_shards(len(batch)),
                                     scalars=summary.scalars)
        return None if outputs is None else self._handoff_output(outputs, len(batch))

    def _most_shards(self, rows: int) -> int:
        return -(-rows // self.rows_per_request)

    async def _decide(self, summary: StepSummary, batch: SamplingBatch,
                      counts: list[dict[str, int]]) -> HandoffOutput:
        outputs = await self.pool.send(summary.inputs, batch, self._lease(summary),
                                       most_shards=self._most_shards(len(batch)),
                                       scalars=summary.scalars)
        out, counted = self._handoff_output(outputs, len(batch))
        counts.append(counted)
        return out

    @staticmethod
    def _handoff_output(outputs, size: int) -> tuple[HandoffOutput, dict[str, int]]:
        """The sampler's answer as a HandoffOutput, and what it adds to ``stats``."""
        outcome = outcome_of(outputs, size).reshape(size).astype(np.int8)
        token_ids = outputs["output_ids"].astype(np.int64)
        # An undecided row with a token was decided from its full row in place.
        in_place = (outcome != HandoffOutcome.HANDOFF_DECIDED) & (token_ids >= 0)
        counts = {"rows": size,
                  "need_full": int(np.sum(outcome == HandoffOutcome.HANDOFF_NEED_FULL)),
                  "need_cold": int(np.sum(outcome == HandoffOutcome.HANDOFF_NEED_COLD)),
                  "in_place": int(in_place.sum())}
        outcome[in_place] = HandoffOutcome.HANDOFF_DECIDED
        none = empty_output(size, 0)  # no row asked: [size, 0]
        return HandoffOutput(
            token_ids=token_ids, logprobs=outputs["output_log_probs"].astype(np.float32),
            top_token_ids=outputs.get(TOP_OUTPUTS[0], none.top_token_ids),
            top_logprobs=outputs.get(TOP_OUTPUTS[1], none.top_logprobs),
            hot_accepted=np.full(size, -1, np.int8), outcome=outcome), counts

    def _count(self, counts: dict[str, int]) -> None:
        for name, count in counts.items():
            self.stats[name] += count

    async def _sample_full(self, logits: torch.Tensor, batch: SamplingBatch) -> SampleOutput:
        # Sharded as full rows are (docs/results/gpu-2026-11-27c.md: one
        # request for a step's worth of fallbacks left the instances idle).
        tokens, logprobs, top = result_parts(await self.pool(logits, batch))
        out = empty_output(len(batch), 0)  # no row asked: [B, 0] top logprobs
        out.token_ids, out.logprobs, out.hot_accepted[:] = tokens, logprobs, -1
        if top is not None:
            out.top_token_ids, out.top_logprobs = top
        return out


def _result(out: HandoffOutput, batch: SamplingBatch) -> SampleResult:
    """The decode loop's SampleResult of a merged answer: the rows' top
    logprobs third where a row asked."""
    if not widest_top(batch):
        return out.token_ids, out.logprobs
    return out.token_ids, out.logprobs, (out.top_token_ids, out.top_logprobs)


def hot_first_sampler(engine, pool, hot_vocab: HotVocab) -> HotFirstSampler:
    """The decode loop's sampler over `pool` with the rows crossing
    hot-first: summarized by the engine where its rows are, when it can
    (``engine.SummarizesHotFirst``, prepared here: the simulated engine's
    modelled device, the torch engine's GPU), else by ``hot_first_summary``
    in torch wherever ``step``'s rows are."""
    summary = None
    if isinstance(engine, SummarizesHotFirst):
        engine.prepare_hot_first(hot_vocab.kernel_arrays()[0], DEFAULT_COLD_TOP)
        summary = engine.hot_first_summary
    return HotFirstSampler(pool, hot_vocab, summary=summary)
