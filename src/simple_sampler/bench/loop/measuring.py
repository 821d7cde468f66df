"""`simple-sampler bench loop`: the decode loop's own CPU time per step
(``DecoderStats.loop_s / steps``) at GPU-sized batches, with the forward and
the sampler taken out.

The engine is instant and SIMULATED (no model: ``step`` returns a view of
one preallocated logits array; ``add`` / ``append`` / ``release`` do
nothing) and so is the sampler (it returns a fixed token at once), so what
remains is the loop's own Python: reaping and admission, gathering the
step's SamplingBatch, detokenizing (SmolLM2's real tokenizer) and delivering
events, appending to the engine. B requests (default 256) each with a
``history``-token prompt (default 1,000) decode ``steps`` tokens in one lane,
through the decoder (``batch_state``) and, as the baseline, through
``RebuildingDecoder`` (``rebuild``): the decoder with the per-step batch
building it had before ``BatchState``.

Side by side on the same rows it times building one step's batch both ways:
``BatchState.batch`` (the decoder's path) and ``SamplingBatch.from_params``
over the rows' params and Python-list histories (what the decoder did per
step before ``BatchState``). Two parameter sets: penalties off (no history
needed) and repetition / presence / frequency penalties on every row (every
history gathered, the worst case).
"""
from __future__ import annotations

import asyncio
import collections
import time

import numpy as np
import torch

from ... import heap
from ...params import History, SamplingBatch, SamplingParams, ragged
from ...row_arena import RowArena
from ...row_reader import RowReader
from ...serving.batch_state import BatchState
from ...serving.decoder import Decoder
from ...serving.generation import GenerationRequest
from ...serving.text import TextCodec
from ...triton.sampler_codec import batch_arrays
from ...triton.sampler_decode import decode_request

PENALTIES = {"off": SamplingParams(temperature=0.8, top_p=0.95),
             "on": SamplingParams(temperature=0.8, top_p=0.95, repetition_penalty=1.1,
                                  presence_penalty=0.5, frequency_penalty=0.5)}
LOGITS_VOCAB = 64  # the instant sampler never reads the logits
#: a served step's sampler request, histories in it (value) or named (ref):
#: the llm's side (batch and tensors) and the sampler's (decode)
REQUEST_COLUMNS = ("request_value", "request_ref", "decode_value", "decode_ref")


class InstantEngine:
    """SIMULATED engine: no forward, a preallocated logits view per step."""

    def __init__(self, max_batch_size: int, max_context: int, vocab_size: int):
        self.max_batch_size, self.max_context, self.vocab_size = \
            max_batch_size, max_context, vocab_size
        self.logits = torch.zeros(max_batch_size, LOGITS_VOCAB)

    def add(self, seq_id, prompt_ids, max_tokens=None) -> None:
        pass

    def step(self, seq_ids) -> torch.Tensor:
        return self.logits[:len(seq_ids)]

    def append(self, seq_ids, token_ids) -> None:
        pass

    def release(self, seq_id) -> None:
        pass


class RebuildingDecoder(Decoder):
    """Baseline: the decoder as it was before BatchState, rebuilding each
    step's batch from the rows' params and Python-list histories (per-row
    validation, O(B x history) packing, bans from list concatenations)."""

    def _sampling_batch(self, sequences: list) -> SamplingBatch:
        batch = SamplingBatch.from_params(
            [s.params for s in sequences],
            [History(s.prompt_ids, self.output_ids(s)) for s in sequences],
            vocab_size=self.engine.vocab_size)
        batch.ban_offsets, batch.ban_ids = ragged([self._bans(s) for s in sequences])
        batch.want_logprobs = np.array([s.request.return_log_probs for s in sequences], bool)
        return batch

    def _bans(self, sequence) -> list[int]:
        banned = list(sequence.params.stop_token_ids) \
            if sequence.generated < sequence.params.min_tokens else []
        ids = sequence.prompt_ids + self.output_ids(sequence)
        for word in sequence.bad_words_ids:
            if len(word) == 1 or ids[len(ids) - len(word) + 1:] == word[:-1]:
                banned.append(word[-1])
        return banned


DECODERS = {"batch_state": Decoder, "rebuild": RebuildingDecoder}


def instant_sampler(token: int, rows: int):
    """SIMULATED sampler: `token` for every row, logprob 0, at once."""
    tokens, logprobs = np.full(rows, token, np.int64), np.zeros(rows, np.float32)

    async def sampler(logits, batch):
        return tokens[:len(batch)], logprobs[:len(batch)]
    return sampler


def prompts(codec: TextCodec, batch: int, history: int, seed: int = 0) -> list[list[int]]:
    """`batch` prompts of `history` ids drawn from the tokenizer's vocabulary."""
    rng = np.random.default_rng(seed)
    return rng.integers(0, len(codec.tokenizer), (batch, history)).tolist()


def loop_per_step(codec: TextCodec, params: SamplingParams, batch: int, history: int,
                  steps: int, decoder_class: type[Decoder] = Decoder) -> dict:
    """Run B requests for `steps` tokens through `decoder_class` over the
    instant engine and sampler; returns the loop's ms per step and the steps."""
    token = codec.encode(" the")[0]
    engine = InstantEngine(batch, history + steps + 1, len(codec.tokenizer))

    async def run():
        decoder = decoder_class(engine, codec, sampler=instant_sampler(token, batch),
                                micro_batches=1)
        await decoder.start()
        handles = [decoder.submit(GenerationRequest(prompt_ids=ids, max_tokens=steps,
                                                    sampling=params, ignore_end=True))
                   for ids in prompts(codec, batch, history)]
        for handle in handles:
            async for _ in handle:
                pass
        await decoder.close()
        return decoder.stats

    # each run starts from a collected heap, whatever ran before it, frozen
    # as a served stub's is (llm/1/model.py)
    with heap.frozen("bench loop"):
        stats = asyncio.run(run())
    return {"loop_ms_per_step": 1e3 * stats.loop_s / stats.steps, "steps": stats.steps}


def batch_build(codec: TextCodec, params: SamplingParams, batch: int, history: int,
                repeats: int) -> dict:
    """Median ms to build one step's batch of B rows with `history`-token
    histories (half prompt, half output): BatchState.batch vs from_params;
    and a served step's sampler request (``batch_arrays``, packed) with the
    histories in the request and named in a row arena (``history_ref``):
    the llm's side (batch and tensors), their bytes, and the sampler's side
    (``decode_request``, reading the named ids where they lie)."""
    vocab = len(codec.tokenizer)
    params = SamplingParams(**{**params.__dict__, "seed": 1})
    ids = prompts(codec, batch, history)
    half = history // 2
    arena = RowArena(1, 1)
    try:
        states = {"value": BatchState(batch, history + 1),
                  "ref": BatchState(batch, history + 1, arena=arena)}
        slots = {}
        for way, state in states.items():
            slots[way] = np.array([state.add(params, row[:half]) for row in ids], np.int64)
            for column in range(half, history):
                state.append(slots[way], np.array([row[column] for row in ids], np.int32))
        histories = [History(row[:half], row[half:]) for row in ids]
        logits = np.zeros((batch, vocab), np.float32)
        reader, timings, sizes = RowReader(), collections.defaultdict(list), {}
        for repeat in range(repeats):  # alternated, so load changes hit every way alike
            started = time.perf_counter()
            SamplingBatch.from_params([params] * batch, histories, vocab_size=vocab)
            timings["from_params"].append(time.perf_counter() - started)
            # each way first every other time: the first after from_params finds colder caches
            for way, state in list(states.items())[::1 if repeat % 2 else -1]:
                started = time.perf_counter()
                built = state.batch(slots[way])
                timings[f"batch_{way}"].append(time.perf_counter() - started)
                inputs = batch_arrays(built, packed=True)
                timings[f"request_{way}"].append(time.perf_counter() - started)
                sizes[way] = sum(array.nbytes for array in inputs.values())
                started = time.perf_counter()
                decode_request({"logits": logits, **inputs}, vocab, reader=reader)
                timings[f"decode_{way}"].append(time.perf_counter() - started)
    finally:
        arena.close()
    return {**{name: 1e3 * float(np.median(t)) for name, t in timings.items()},
            **{f"request_bytes_{way}": size for way, size in sizes.items()}}


def run(batch: int = 256, history: int = 1000, steps: int = 64, repeats: int = 21,
        rounds: int = 3) -> dict:
    """Per parameter set: the median over `rounds` runs of each decoder's
    loop ms/step, and the median of `repeats` batch builds each way."""
    codec = TextCodec.from_source()
    report = {"batch": batch, "history": history, "steps": steps, "rounds": rounds,
              "simulated": True, "rows": []}
    for name, params in PENALTIES.items():
        built = batch_build(codec, params, batch, history, repeats)
        runs = {decoder: [] for decoder in DECODERS}
        for _ in range(rounds):  # alternated, so load changes hit both alike
            for decoder, decoder_class in DECODERS.items():
                runs[decoder].append(loop_per_step(codec, params, batch, history, steps,
                                                   decoder_class))
        report["rows"].append({"penalties": name, "steps_run": runs["batch_state"][0]["steps"],
                               **{f"loop_ms_{d}": float(np.median([r["loop_ms_per_step"]
                                                                   for r in rs]))
                                  for d, rs in runs.items()},
                               "batch_state_ms": built["batch_value"],
                               "from_params_ms": built["from_params"],
                               "batch_ref_ms": built["batch_ref"],
                               **{f"{name}_ms": built[name] for name in REQUEST_COLUMNS},
                               **{name: built[name] for name in
                                  ("request_bytes_value", "request_bytes_ref")}})
    return report


def format_table(report: dict) -> str:
    lines = [f"decode loop, SIMULATED instant engine and sampler: B={report['batch']}, "
             f"{report['history']}-token histories, {report['steps']} steps, one lane",
             "loop ms/step: the decoder (BatchState) and the baseline rebuilding each step's "
             f"batch (as before BatchState), median of {report['rounds']} alternated runs;",
             "batch ms: building one step's batch alone, BatchState.batch and "
             "SamplingBatch.from_params",
             f"{'penalties':>9} {'loop BatchState':>15} {'loop rebuild':>12} {'ratio':>6} "
             f"{'batch BatchState':>16} {'batch from_params':>17} {'ratio':>6}"]
    for row in report["rows"]:
        lines.append(f"{row['penalties']:>9} {row['loop_ms_batch_state']:15.3f} "
                     f"{row['loop_ms_rebuild']:12.3f} "
                     f"{row['loop_ms_rebuild'] / row['loop_ms_batch_state']:6.1f} "
                     f"{row['batch_state_ms']:16.3f} {row['from_params_ms']:17.3f} "
                     f"{row['from_params_ms'] / row['batch_state_ms']:6.1f}")
    lines += ["a served step's sampler request, histories in it (value) or named in the row "
              "arena (ref), in-process:",
              "llm ms: its batch and tensors; sampler ms: decode_request; KiB: the tensors",
              f"{'penalties':>9} {'llm value':>9} {'llm ref':>8} {'KiB value':>10} "
              f"{'KiB ref':>8} {'sampler value':>13} {'sampler ref':>11}"]
    for row in report["rows"]:
        lines.append(f"{row['penalties']:>9} {row['request_value_ms']:9.3f} "
                     f"{row['request_ref_ms']:8.3f} {row['request_bytes_value'] / 1024:10.1f} "
                     f"{row['request_bytes_ref'] / 1024:8.1f} {row['decode_value_ms']:13.3f} "
                     f"{row['decode_ref_ms']:11.3f}")
    return "\n".join(lines)
