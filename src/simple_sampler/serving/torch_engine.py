"""PyTorch data plane: :class:`TorchEngine` (the ``torch`` engine).

:class:`TorchEngine` runs a Hugging Face causal LM (SmolLM2-135M-Instruct by
default) on the CPU, or on a CUDA GPU (``--device cuda``), with in-flight
batching: sequences join and leave between
steps and each owns one slot of a preallocated key/value cache. Its forward is
the model's own ``forward`` (embedding, decoder layers, norm, lm_head and the
configured attention implementation); the engine only supplies a cache object
that writes each row's new keys and values into its slot and hands back the
slot's history, plus a 4D mask that limits each row to its own length.
With ``batch_invariant`` it runs ``batch_invariant.InvariantForward``
instead, whose logits for a sequence do not depend on the rest of the step
(on the CPU only).

The logits are rows in the model's dtype (float32, bfloat16 or float16):
the lm_head computed them in it, so widening them would add no information,
only bytes (twice the device-to-host copy and the row arena's slot), and the
kernels read bfloat16 and float16 rows as they are.
On a GPU the logits reach the decision plane as on the CPU: host rows, by
one device-to-host copy per step (``stage_rows``). With a row arena
(``share_rows``: served ``simple``, whose local sampler instances read the
rows from shared memory) the copy lands in a slot of the arena's
page-locked ring, where the instances read the rows, and the sampler pool
copies them no more; otherwise (no arena, or no free slot) in a fresh
pinned tensor (PyTorch's caching host allocator reuses the block, and a
fresh tensor per step means a lane's rows are never overwritten while its
sampler reads them). With
``host_logits=False`` ``step`` returns the rows on the GPU instead, for the
``inline`` mode, which then samples there (``serving/inline.py``), and for
rows that cross hot-first (``prepare_hot_first``): the summary is computed
on the GPU next to the rows, as a replayed CUDA graph
(``summary_graph.GraphedSummary``), and only the compact rows, and an
undecided row whole, cross to the host (docs/HANDOFF.md).
Not run on a GPU in this project's CI (none is available there).
"""
from __future__ import annotations

import contextlib
import logging
import os
import threading
from dataclasses import dataclass
from typing import Callable, Hashable, Sequence

import numpy as np
import torch
import torch.nn.attention

from ..host_copy import sleep_until_done, to_device
from ..models import load_model
from ..sampling import logits_array, logits_tensor
from ..settings import LlmSettings
from .batch_invariant import InvariantForward
from .device import page_lock, page_unlock
from .engine import SequenceTable
from .prompt_scores import PLAIN_HEAD_FAMILIES, PromptScores, score_prompt_rows
from .summary_graph import GraphedSummary

log = logging.getLogger(__name__)

DEFAULT_MAX_BATCH_SIZE = LlmSettings.engine_max_batch_size
DEFAULT_MAX_CONTEXT = LlmSettings.max_context


@dataclass
class _SlotSequence:
    slot: int
    cached: int  # tokens whose keys and values are in the slot
    pending: list[int]  # tokens the model has not seen yet


def _has_pending(row: _SlotSequence) -> bool:
    return bool(row.pending)


class _SlotCacheView:
    """The cache object handed to the model's forward for one step.

    Duck-types the one method the decoder layers call on a transformers
    ``Cache``: ``update(key_states, value_states, layer_idx)`` with states
    ``[n, kv_heads, q, head_dim]``. It writes them at ``positions`` ``[n, q]``
    of the rows' slots and returns the slots' keys and values for positions
    ``[0, kv_length)``: ``[n, kv_heads, kv_length, head_dim]``.
    """

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, slots: torch.Tensor,
                 positions: torch.Tensor, kv_length: int):
        self.keys, self.values = keys, values
        self.slots, self.positions, self.kv_length = slots, positions, kv_length

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        history = []
        for cache, states in ((self.keys[layer_idx], key_states),
                              (self.values[layer_idx], value_states)):
            cache[self.slots[:, None], :, self.positions] = states.transpose(1, 2)
            # A copy of only the used window; measured: slicing consecutive
            # slots instead saved under 5% of a 32-row step.
            history.append(cache[:, :, :self.kv_length].index_select(0, self.slots))
        return history[0], history[1]


class TorchEngine:
    """In-flight batching engine over a Hugging Face causal LM, on the CPU or a
    CUDA GPU (where the caller put the model).

    The cache is two float tensors ``[layers, max_batch_size, kv_heads,
    max_context, head_dim]`` (keys, values) in the model's dtype, allocated
    zeroed up front: 2 * layers * slots * kv_heads * context * head_dim *
    itemsize bytes (SmolLM2, 32 slots, context 1024, float32: 755 MB). Zeroed,
    because masked positions still meet the values in the attention product
    and uninitialized memory may hold NaN.

    Prefill is lazy: ``add`` only records the prompt; the first ``step`` that
    includes the sequence runs the prompt through the model. A step makes at
    most two forwards: one for the sequences with one pending token (decode)
    and one for those with several (prefill, left-padded to the longest
    prompt of the step), so a decode row is never padded to a prompt.

    With ``batch_invariant`` (Llama-architecture models, SmolLM2 included) a
    step is one forward over every row, prefill and decode together, whose
    logits for a sequence are bitwise the same whatever the other rows of
    the step (``batch_invariant``'s docstring says how); the intra-op thread
    count is pinned to the one at construction, since it picks how kernels
    split their work.

    Thread safety: one ``step`` runs at a time (others wait); ``add``,
    ``append``, ``release`` and ``length`` may be called from another thread
    while a step runs, for sequences that step does not include.
    """

    label = "TorchEngine"
    bridge_s = 0.0  # in process: no bridge

    def __init__(self, model, max_batch_size: int = DEFAULT_MAX_BATCH_SIZE,
                 max_context: int = DEFAULT_MAX_CONTEXT, batch_invariant: bool = False,
                 host_logits: bool = True):
        config = model.config
        self.device = next(model.parameters()).device  # where the caller put the model
        #: ``engine.ComputesOffHost``: on a GPU the forward leaves the host's cores free
        self.off_host = self.device.type != "cpu"
        if batch_invariant and self.device.type != "cpu":
            raise ValueError(f"batch_invariant runs on the CPU only, not on {self.device}")
        limit = getattr(config, "max_position_embeddings", None) or max_context
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
        if not 2 <= max_context <= limit:
            raise ValueError(f"max_context must be in [2, {limit}] (the model's "
                             f"max_position_embeddings), got {max_context}")
        self.model = model
        self.vocab_size = int(config.vocab_size)
        self.max_batch_size = max_batch_size
        self.max_context = max_context
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        shape = (config.num_hidden_layers, max_batch_size, config.num_key_value_heads,
                 max_context, head_dim)
        dtype = next(model.parameters()).dtype
        #: what ``step`` returns its rows in: the model's own (module docstring)
        self.logits_dtype = dtype
        self.keys = torch.zeros(shape, dtype=dtype, device=self.device)
        self.values = torch.zeros(shape, dtype=dtype, device=self.device)
        self.host_logits = host_logits
        #: the row arena the device-to-host copy lands in (``share_rows``)
        self.arena = None
        #: its ring's address while CUDA holds it page-locked (``close`` undoes it)
        self.page_locked: int | None = None
        self.sequences: SequenceTable[_SlotSequence] = SequenceTable(self.vocab_size,
                                                                     max_batch_size, max_context)
        self.free_slots = list(range(max_batch_size - 1, -1, -1))  # pop() takes the lowest
        self.state_lock = threading.Lock()
        self.step_lock = threading.Lock()
        self.batch_invariant = batch_invariant
        self.num_threads = torch.get_num_threads()
        self.invariant_forward = (InvariantForward(model, self.keys, self.values)
                                  if batch_invariant else None)
        #: ``engine.SummarizesHotFirst``'s summary: graphs on CUDA, eager
        #: torch elsewhere (``GraphedSummary`` captures nothing until called)
        self.hot_first_summary = GraphedSummary()

    @classmethod
    def from_source(cls, source: str | os.PathLike | None = None,
                    device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32,
                    **kwargs) -> "TorchEngine":
        """An engine over ``load_model(source)`` in ``dtype`` on ``device``
        (``serving.device.resolve`` checks both first); its tokenizer is
        dropped: ``text.Tokenizer`` loads its own."""
        model, _ = load_model(source, dtype)
        return cls(model.to(device), **kwargs)

    @property
    def num_free_slots(self) -> int:
        return len(self.free_slots)

    def add(self, seq_id: Hashable, prompt_ids: Sequence[int],
            max_tokens: int | None = None) -> None:
        """Take a slot for a new sequence; its prompt is prefilled by the next
        ``step`` that includes it (``max_tokens`` is not needed: every slot
        holds the whole context). Raises ValueError for a used id, an empty
        prompt, one longer than ``max_context - 1`` (room must be left for a
        generated token) or ids outside [0, vocab_size); RuntimeError when
        every slot is taken."""
        self._add_at(seq_id, prompt_ids, self.free_slots.pop)  # pop(): the lowest

    def _add_at(self, seq_id: Hashable, prompt_ids: Sequence[int],
                take_slot: Callable[[], int]) -> None:
        """``add`` into the slot ``take_slot()`` takes off ``free_slots``
        (called under the state lock, once every check has passed; what it
        raises leaves the engine as it was)."""
        with self.state_lock:
            self.sequences.add(seq_id, prompt_ids,
                               lambda prompt: _SlotSequence(take_slot(), 0, prompt))

    def step(self, seq_ids: Sequence[Hashable]) -> torch.Tensor:
        """Next-token logits of the given sequences: ``logits_dtype``
        ``[len(seq_ids), vocab_size]`` on the host (on the engine's device with
        ``host_logits=False``), row i for ``seq_ids[i]``. Consumes their
        pending tokens.
        Raises KeyError for an unknown id, ValueError for a repeated id or a
        sequence with nothing pending (stepped again without ``append``)."""
        with self.step_lock:
            with self.state_lock:
                rows = self.sequences.for_step(seq_ids, _has_pending)
                work = [(row.slot, row.cached, list(row.pending)) for row in rows]
            if self.invariant_forward is not None:
                if torch.get_num_threads() != self.num_threads:
                    torch.set_num_threads(self.num_threads)
                logits = self.invariant_forward(work)
            else:
                logits = self._forward_groups(work)
            with self.state_lock:
                for row, (_, _, pending) in zip(rows, work):
                    row.cached += len(pending)
                    row.pending = []
            if not self.host_logits or logits.device.type == "cpu":
                return logits
            host = stage_rows(logits, self.arena)
            sleep_until_done(self.device)
        return host

    def _forward_groups(self, work: list[tuple[int, int, list[int]]]) -> torch.Tensor:
        """The step's rows: one forward when every row decodes or every row
        is a prompt (its output as it is: no copy of the step's rows), else
        the decode rows' forward, then the prompts', gathered into one
        tensor in ``work``'s order."""
        prefill = [len(pending) > 1 for _, _, pending in work]
        if not any(prefill) or all(prefill):
            return self._forward(work)
        logits = torch.empty(len(work), self.vocab_size, dtype=self.logits_dtype,
                             device=self.device)
        for kind in (False, True):
            group = [i for i, is_prompt in enumerate(prefill) if is_prompt == kind]
            logits[group] = self._forward([work[i] for i in group])
        return logits

    def share_rows(self, arena) -> None:
        """On a GPU, land each step's device-to-host copy in a slot of
        `arena` (``row_arena.RowArena.take``), whose ring is page-locked for
        the engine's device here, once: the sampler pool claims the slot
        (``RowArena.reference``) instead of copying the rows into one. If
        CUDA refuses to page-lock the ring, or /dev/shm has no room for all
        of its pages (``RowArena.allocate_ring``, before the page-lock takes
        them), the copy still lands there where it can, through the
        driver's bounce buffer (logged).

        On the CPU nothing changes: the rows are the forward's own output,
        already on the host, so a copy into a slot here would not replace a
        copy, only move the pool's one (made off the event loop, beside the
        next lane's forward) onto the data-plane thread, ahead of the next
        forward."""
        if self.device.type != "cuda":
            return
        try:
            arena.allocate_ring()
        except OSError as error:
            refused = str(error)
        else:
            refused = page_lock(arena.ring.data_address, arena.ring.data_bytes, self.device)
        if refused:
            log.warning("the row arena's ring stays pageable: %s", refused)
        else:
            self.page_locked = arena.ring.data_address
        self.arena = arena

    def close(self) -> None:
        """``engine.Closable``: the row arena's ring unregistered from CUDA
        (``device.page_unlock``), so that its owner may unmap it; no copy is
        in flight (each step waited for its own). The engine stages its rows
        in fresh pinned tensors afterwards. Idempotent."""
        address, self.page_locked, self.arena = self.page_locked, None, None
        if address is not None:
            refused = page_unlock(address, self.device)
            if refused:
                log.warning("the row arena's ring is still page-locked: %s", refused)

    def prepare_hot_first(self, hot_ids, cold_top: int) -> None:
        """``engine.SummarizesHotFirst``: from now on ``step`` returns the
        rows where the forward left them (``host_logits=False``), so that
        on a GPU ``hot_first_summary`` runs next to them and no full row
        crosses to the host unless the decision needs it (the hot-first
        sampler then fetches only the undecided rows). On the CPU the rows
        are the host's anyway. Nothing is precomputed: the hot set crosses
        to the device with the first summary (``hot_first.hot_set_on``)."""
        self.host_logits = False

    def append(self, seq_ids: Sequence[Hashable], token_ids: Sequence[int]) -> None:
        """Feed one sampled token per sequence. Raises ValueError when the
        lengths differ, a token is outside [0, vocab_size), a sequence still
        has a pending token or is already ``max_context`` tokens long."""
        with self.state_lock:
            rows, tokens = self.sequences.for_append(seq_ids, token_ids, _has_pending,
                                                     lambda row: row.cached)
            for row, token in zip(rows, tokens):
                row.pending = [token]

    def release(self, seq_id: Hashable) -> None:
        """Free the sequence's slot. Unknown ids are ignored, so a cancel that
        races with the sequence's own finish is harmless."""
        with self.state_lock:
            row = self.sequences.release(seq_id)
            if row is not None:
                self.free_slots.append(row.slot)
                self.free_slots.sort(reverse=True)

    def length(self, seq_id: Hashable) -> int:
        with self.state_lock:
            row = self.sequences[seq_id]
            return row.cached + len(row.pending)

    @torch.inference_mode()
    def score_prompt(self, prompt_ids: Sequence[int], num_top: int) -> PromptScores:
        """``engine.ScoresPrompts``: the prompt's logprobs from one forward
        of the model over it, in no slot, between steps (it holds the step
        lock, as a prefill would). A model whose logits are its head's
        output alone (``PLAIN_HEAD_FAMILIES``) has its head applied a chunk
        of positions at a time, so no [T, V] logits exist at once; any
        other runs its whole forward (whatever scaling or soft-capping it
        applies), its [T, V] logits in its dtype at once."""
        ids = torch.as_tensor([list(prompt_ids)], dtype=torch.int64, device=self.device)
        with self.step_lock, _attention_backends(self.device):
            if self.model.config.model_type in PLAIN_HEAD_FAMILIES:
                hidden = self.model.model(input_ids=ids, use_cache=False).last_hidden_state[0]
                head = self.model.get_output_embeddings()
                return score_prompt_rows(lambda start, stop: head(hidden[start:stop]),
                                         prompt_ids, num_top)
            logits = self.model(input_ids=ids, use_cache=False).logits[0]
            return score_prompt_rows(lambda start, stop: logits[start:stop], prompt_ids, num_top)

    @torch.inference_mode()
    def _forward(self, work: list[tuple[int, int, list[int]]]) -> torch.Tensor:
        """One model forward over rows ``(slot, cached, pending)``. Returns
        ``logits_dtype`` ``[rows, vocab]``: the logits after each row's last
        pending token.

        Rows are left-padded to the longest pending list (q tokens), so every
        row's last token sits at query index q - 1 and the model computes
        logits for that index only. A row's real tokens take positions
        ``cached, cached + 1, ...`` and attend to its positions up to their
        own; its padding takes the positions right after them, whose cache
        entries are overwritten by the real tokens at those positions before
        any query can attend to them. Positions stay below ``max_context``
        because only prompts (``cached == 0``) have several pending tokens.
        """
        device = self.device
        width = max(len(pending) for _, _, pending in work)
        # every row's last position is its cached length + width - 1 (a
        # padded row's padding runs on past its tokens): known on the host,
        # no read back from the device
        kv_length = max(cached for _, cached, _ in work) + width
        # one queued copy from pinned memory (host_copy.to_device)
        slots, lengths, input_ids, starts = to_device(
            device, np.array([slot for slot, _, _ in work], np.int64),
            np.array([len(pending) for _, _, pending in work], np.int64),
            np.array([[0] * (width - len(pending)) + pending for _, _, pending in work],
                     np.int64),
            np.array([cached for _, cached, _ in work], np.int64))
        padding = width - lengths
        index = torch.arange(width, device=device)[None, :]
        real = index >= padding[:, None]
        positions = starts[:, None] + torch.where(real, index - padding[:, None],
                                                  lengths[:, None] + index)
        # mask[r, 0, i, j]: query i of row r may attend to key position j.
        mask = (torch.arange(kv_length, device=device)[None, None, :]
                <= positions[:, :, None])[:, None]
        cache = _SlotCacheView(self.keys, self.values, slots, positions, kv_length)
        with _attention_backends(device):
            out = self.model(input_ids=input_ids, position_ids=positions, attention_mask=mask,
                             past_key_values=cache, use_cache=True, logits_to_keep=1)
        return out.logits[:, -1]


def stage_rows(rows: torch.Tensor, arena=None) -> torch.Tensor:
    """The step's one device-to-host copy: `rows` copied (non_blocking) to
    a host tensor in their own dtype, in a slot taken for them from `arena`
    (``row_arena.RowArena.take``: the pool claims it, no copy of its own;
    left unclaimed, it comes back when the tensor dies) or, with no arena
    or no free slot, in a fresh tensor, pinned when the rows are on a GPU.
    The caller waits for the copy (``host_copy.sleep_until_done``: asleep,
    not spinning on a core) before the rows are read."""
    slot = None
    if arena is not None:
        # the numpy dtype of host rows like these (bfloat16: ml_dtypes')
        dtype = logits_array(rows.new_empty(0, device="cpu")).dtype
        slot = arena.take(tuple(rows.shape), dtype)
    if slot is None:
        host = torch.empty(rows.shape, dtype=rows.dtype, pin_memory=rows.is_cuda)
    else:
        host = logits_tensor(slot)
    host.copy_(rows, non_blocking=True)
    return host


#: SDPA's backends on CUDA, without cuDNN's: torch 2.11 picks cuDNN attention
#: for a masked bfloat16 query on an H100 and builds a cuDNN graph for every
#: new key length, which a decode step always has: the largest item of a
#: step's CPU in a torch profile of TorchEngine.step; bench serve-gpu's
#: forward fell from 82-197 to 32-43 ms a pass (docs/results/gpu-2026-11-27.md). The memory-efficient kernel takes the
#: same boolean mask with no plan to build. ``sdpa_kernel`` sets torch's
#: process-wide backend flags and restores them on exit: a forward runs under
#: the engine's step lock, and a second engine stepping at the same moment in
#: another thread could leave cuDNN's SDPA off after both (harmless here).
_CUDA_ATTENTION = [torch.nn.attention.SDPBackend.FLASH_ATTENTION,
                   torch.nn.attention.SDPBackend.EFFICIENT_ATTENTION,
                   torch.nn.attention.SDPBackend.MATH]


def _attention_backends(device: torch.device):
    if device.type != "cuda":
        return contextlib.nullcontext()
    return torch.nn.attention.sdpa_kernel(_CUDA_ATTENTION)
