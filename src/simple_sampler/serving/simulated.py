"""A SIMULATED data plane paced like a GPU: no model runs, every output says so.

:class:`SimulatedEngine` implements the engine protocol of ``engine`` (add,
step, append, release, length) for the regime the decision plane is built
for, which this project's CPU data plane cannot reach: a GPU computes a
decode step of an 8B model in 10-40 ms for B = 64-256 sequences at
V = 128,256 (Llama 3) or 151,936 (Qwen), and the host's CPU cores are idle
meanwhile.

Step time. ``step(seq_ids)`` takes t(B) = a + b * B milliseconds, B =
``len(seq_ids)``, and spends it *sleeping* (``time.sleep``, which releases
the GIL and uses no core), as a host thread waiting on a GPU would. Defaults:

* a = 9.0 ms (``LlmSettings.sim_step_a_ms``): the decode latency of
  Llama-3-8B (bfloat16) on one H100 at batch 1 measured with SGLang's
  ``bench_latency`` ("Decode. median latency: 0.00910 s",
  https://gist.github.com/jerryzh168/caa3f3a87f403091b238f85f7b22c20e): the
  cost of reading the 16 GB of weights once per step.
* b = 0.04 ms per sequence (``LlmSettings.sim_step_b_ms``): NOT a published
  measurement but a derivation: decode is bound by memory bandwidth, and
  each sequence adds its key/value cache to the bytes a step reads:
  Llama-3-8B holds 32 layers x 8 KV heads x 128 dims x 2 (K, V) x 2 bytes =
  128 KiB per token, so 128 MiB for a 1,024-token context, which takes
  0.04 ms at the H100 SXM's 3.35 TB/s HBM bandwidth (NVIDIA's data sheet).

So t(64) = 11.6 ms and t(256) = 19.2 ms, inside the 10-40 ms the design
assumes. Both are overridable (``--sim-step-a-ms``, ``--sim-step-b-ms``);
``bench serve-sim`` makes a pass over its B sequences take 25 ms however
it is split into micro-batches (a = 0, b = 25 / B), so that modes and
batches compare against one bound.

Rows. ``step`` returns logits ``[B, V]`` in float32 or bfloat16 taken from a
bank of :func:`simple_sampler.rows.synthetic_hot_rows` made from
``real_rows(64)`` cycled: SmolLM2 rows whose sorted values (the shape of the
distribution: head exactly, tail stretched to V) are resampled to V, with
SmolLM2's 49,152 real tokens kept at ONE fixed id each (``rows.id_map``, the
same for the whole bank) and the added ids taking the tail values in a fresh
order per row. So what the sampler sees per row (entropy, top-p set sizes,
the max's margin) is fitted to a real model, and so is which tokens are hot
across rows: a hot set calibrated on SmolLM2 and mapped into V
(``rows.map_hot_ids``) covers the share of a row's mass it covers on real
rows, and SHVS acceptance is realistic (on afresh-permuted rows it would be
chance level). Labelled :data:`~simple_sampler.rows.HOT_ROWS_SOURCE`. The
bank holds ``max_batch_size + BANK_OFFSETS`` rows; step k returns the
``B`` consecutive rows starting at offset ``k * OFFSET_STRIDE mod
(BANK_OFFSETS + 1)``, so a sequence's row changes from step to step and
rows differ across the sequences of a step (rows 64 apart share their real
tokens' values and differ in the added ids). Which row goes to which
sequence is arbitrary (rows carry no sequence identity).

Copies. The returned tensor is a *view* of the bank (rows ``[o, o + B)``
are contiguous), so a step costs the CPU no B x V gather or copy, as on a
GPU host where the device-to-host copy of the logits is a DMA that no core
performs. The bank is shared: callers must not write into the rows (the
kernels and the sampler pool only read them).

Text. Ids beyond SmolLM2's tokenizer need a codec of their own:
:class:`SimulatedCodec` is the model's tokenizer (SmolLM2's unless
``model`` names another) for everything it knows and writes any other id
``i`` as `` t<i>``; the llm model uses it only with this engine, never on
the normal path.

Everything this engine produces is labelled "simulated data plane"
(:attr:`SimulatedEngine.label`): logs, bench JSON and tables, the server's
ready line.
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Hashable, Sequence

import torch

from ..rows import HOT_ROWS_SOURCE, SYNTHETIC_SOURCE_ROWS, real_rows, synthetic_hot_rows
from ..settings import SIMULATED_LABEL, LlmSettings
from .engine import SequenceTable
from .text import DecodeStream, TextCodec

LABEL = SIMULATED_LABEL
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
DEFAULT_MAX_BATCH_SIZE = 256
DEFAULT_MAX_CONTEXT = 4096
#: Distinct step offsets into the bank (rows beyond max_batch_size).
BANK_OFFSETS = 64
#: Offset advance per step; odd and coprime with BANK_OFFSETS + 1 = 65, so
#: consecutive steps do not return shifted copies of each other's rows.
OFFSET_STRIDE = 23


@dataclass(frozen=True)
class SimulatedSpec:
    """What a simulated engine simulates: V, the logits dtype and t(B) = a + b * B.
    Defaults and allowed values are ``LlmSettings``' ``sim_*`` settings (the
    serve options and llm parameters of the same names)."""

    vocab: int = LlmSettings.sim_vocab
    dtype: str = LlmSettings.sim_dtype
    step_a_ms: float = LlmSettings.sim_step_a_ms
    step_b_ms: float = LlmSettings.sim_step_b_ms

    def __post_init__(self):
        LlmSettings(engine="simulated", sim_vocab=self.vocab, sim_dtype=self.dtype,
                    sim_step_a_ms=self.step_a_ms, sim_step_b_ms=self.step_b_ms).validate()

    @classmethod
    def from_settings(cls, settings: LlmSettings) -> "SimulatedSpec":
        return cls(settings.sim_vocab, settings.sim_dtype, settings.sim_step_a_ms,
                   settings.sim_step_b_ms)

    def step_ms(self, batch: int) -> float:
        """The modelled forward time of a step of ``batch`` rows: a + b * batch."""
        return self.step_a_ms + self.step_b_ms * batch

    def describe(self) -> str:
        """The label every output of a run on this spec carries."""
        return (f"{LABEL}: t(B) = {self.step_a_ms:g} + {self.step_b_ms:g} * B ms slept, "
                f"V={self.vocab:,} {self.dtype}, rows {HOT_ROWS_SOURCE}")


class SimulatedEngine:
    """The GPU-paced simulated engine (module docstring).

    vocab_size, max_batch_size, max_context: as ``engine.Engine``;
    ``step`` returns ``spec.dtype`` logits ``[len(seq_ids), vocab]``, a view
    of the bank (read-only by contract). ``seed`` picks the bank's id map
    and added-id orders: map a SmolLM2 hot set with
    ``rows.map_hot_ids(ids, spec.vocab, seed)``. Thread safety as TorchEngine: one
    step at a time; add/append/release/length from other threads for
    sequences the running step does not include.
    """

    def __init__(self, spec: SimulatedSpec = SimulatedSpec(),
                 max_batch_size: int = DEFAULT_MAX_BATCH_SIZE,
                 max_context: int = DEFAULT_MAX_CONTEXT, seed: int = 0):
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
        if max_context < 2:
            raise ValueError(f"max_context must be >= 2, got {max_context}")
        self.spec = spec
        self.vocab_size = spec.vocab
        self.max_batch_size = max_batch_size
        self.max_context = max_context
        rows = synthetic_hot_rows(real_rows(SYNTHETIC_SOURCE_ROWS), spec.vocab, seed,
                                  n=max_batch_size + BANK_OFFSETS)
        self.bank = torch.from_numpy(rows).to(DTYPES[spec.dtype])
        self.label = spec.describe()
        self.steps = 0
        self.sequences: SequenceTable[_SimulatedSequence] = SequenceTable(
            spec.vocab, max_batch_size, max_context)
        self.state_lock = threading.Lock()
        self.step_lock = threading.Lock()

    def add(self, seq_id: Hashable, prompt_ids: Sequence[int],
            max_tokens: int | None = None) -> None:
        """As TorchEngine.add (SequenceTable's checks and errors)."""
        with self.state_lock:
            self.sequences.add(seq_id, prompt_ids, lambda prompt: _SimulatedSequence(len(prompt)))

    def step(self, seq_ids: Sequence[Hashable]) -> torch.Tensor:
        """Sleep t(len(seq_ids)), return the rows (module docstring). Errors
        as TorchEngine.step (SequenceTable.for_step)."""
        deadline = time.perf_counter() + self.spec.step_ms(len(seq_ids)) / 1e3
        with self.step_lock:
            with self.state_lock:
                for state in self.sequences.for_step(seq_ids, _has_pending):
                    state.pending = False
            offset = self.steps * OFFSET_STRIDE % (BANK_OFFSETS + 1)
            self.steps += 1
            # The "GPU" computes: this thread waits without using a core.
            time.sleep(max(0.0, deadline - time.perf_counter()))
        return self.bank[offset:offset + len(seq_ids)]

    def append(self, seq_ids: Sequence[Hashable], token_ids: Sequence[int]) -> None:
        """As TorchEngine.append (SequenceTable.for_append's errors)."""
        with self.state_lock:
            states, _ = self.sequences.for_append(seq_ids, token_ids, _has_pending,
                                                  lambda state: state.length)
            for state in states:
                state.length += 1
                state.pending = True

    def release(self, seq_id: Hashable) -> None:
        """Forget the sequence; unknown ids are ignored (a cancel may race a finish)."""
        with self.state_lock:
            self.sequences.release(seq_id)

    def length(self, seq_id: Hashable) -> int:
        with self.state_lock:
            return self.sequences[seq_id].length


@dataclass
class _SimulatedSequence:
    length: int  # tokens held, the pending one included
    pending: bool = True  # the last token has not been stepped yet


def _has_pending(state: _SimulatedSequence) -> bool:
    return state.pending


class SimulatedCodec(TextCodec):
    """Text for a simulated engine: the model's tokenizer (SmolLM2's by
    default) encodes prompts and bad words and decodes the ids it has; an id
    beyond its vocabulary (the synthetic rows are wider: V = 128,256 or
    151,936 against SmolLM2's 49,152) reads `` t<id>``. So the preprocessing
    model, which knows nothing of the engine, encodes prompts exactly as the
    llm model does."""

    def __init__(self, tokenizer):
        super().__init__(tokenizer)
        self.known = len(tokenizer)

    def decode(self, token_ids: Sequence[int]) -> str:
        parts, run = [], []
        for token in map(int, token_ids):
            if token < self.known:
                run.append(token)
                continue
            if run:
                parts.append(self.decode_run(run))
                run = []
            parts.append(f" t{token}")
        if run:
            parts.append(self.decode_run(run))
        return "".join(parts)

    def decode_run(self, token_ids: Sequence[int]) -> str:
        """The tokenizer's decode of ids it knows."""
        return super().decode(token_ids)

    def detokenizer(self, prompt_ids: Sequence[int] = ()):
        if self.backend is None:  # no DecodeStream: the window decoder, on decode() above
            return super().detokenizer(prompt_ids)
        return SimulatedDetokenizer(self)


class SimulatedDetokenizer:
    """Streaming text of :meth:`SimulatedCodec.decode` at the cost of the
    tokenizer's own streaming: a run of known ids goes through ``tokenizers``'
    ``DecodeStream`` (without context, as ``decode`` decodes each run); an id
    past the vocabulary ends the run, releasing the run's held-back text (an
    incomplete character as U+FFFD, as ``decode`` gives it), and reads
    `` t<id>``. The concatenation of the deltas and ``flush`` is ``decode``
    of the ids."""

    def __init__(self, codec: SimulatedCodec):
        self.codec = codec
        self._start_run()

    def _start_run(self) -> None:
        self.run: list[int] = []
        self.emitted = 0  # characters of the run's text already returned
        self.stream = DecodeStream(skip_special_tokens=True)

    def push(self, token_ids: Sequence[int]) -> str:
        text = ""
        for token in map(int, token_ids):
            if token >= self.codec.known:
                text += self.flush() + f" t{token}"
                continue
            self.run.append(token)
            delta = self.stream.step(self.codec.backend, token)
            if delta:
                text += delta
                self.emitted += len(delta)
        return text

    def flush(self) -> str:
        if not self.run:  # most ids are past the vocabulary: no run to end
            return ""
        tail = self.codec.decode_run(self.run)[self.emitted:]
        self._start_run()
        return tail
