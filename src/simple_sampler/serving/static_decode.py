"""A GPU-bound data plane: :class:`StaticEngine` (``TorchEngine``'s slots and
contract, a static decode step replayed as CUDA graphs).

The decode forward is written here over a Hugging Face Llama / Qwen2 model's
own modules and weights, the way pytorch-labs' gpt-fast writes its
``Transformer`` (``model.py``: ``KVCache.update`` by ``index_copy_`` at the
input positions, RoPE from a precomputed table, ``scaled_dot_product_attention``
over the whole static cache with a mask, SwiGLU): RMSNorm, the projections and
the MLP are the checkpoint's own modules (so the arithmetic is the Hugging Face
forward's), RoPE is looked up in a table the model's ``rotary_emb`` fills once,
and attention runs over the static cache ``[slots, kv_heads, max_context,
head_dim]`` per layer, which ``TorchEngine`` allocates.

Decode is *slot-major*: a step over bucket ``b`` of a window of slots
starting at ``s`` computes rows for slots ``s .. s+b-1`` (b the smallest of
:data:`BUCKETS` above the highest slot stepped, counted from s), so the cache
is read in place, never gathered, and every shape is fixed: on CUDA each
(window, bucket) step is captured once as a CUDA graph (``torch.cuda.graph``,
one memory pool) and replayed; on the CPU it runs eagerly. The decode loop
captures them all before the first request (``warm_up``, ``engine.WarmsUp``);
a step not captured yet (an engine driven without one) is captured at its
first use.
A slot the step does not include (a sequence left for a later step, or a
free slot) computes a row that is thrown away; it writes its key and value at
a position no query has read yet (its sequence's next one), which the
sequence's own next token overwrites before any query attends to it, the same
argument as ``TorchEngine._forward``'s padding.

Windows: one, all the slots, unless the decode loop's lanes (micro-batches)
split them (``engine.SplitsSlots``): then each lane's sequences hold slots in
a window of their own, ``max_batch_size / lanes`` wide, and a lane's step
computes its window's bucket only. Without that, a lane stepping half the
sequences would compute all of them: two lanes, twice the forward.

Grouped-query attention without repeating the keys: the query heads of one
key/value head are laid out as SDPA's query length, so the query tensor is
``[b, kv_heads, group, head_dim]`` against keys ``[b, kv_heads, context,
head_dim]`` and one boolean mask ``[b, 1, 1, context]`` (position <= the
row's own) serves every head; SDPA's memory-efficient kernel takes it on CUDA.

Prefill (a prompt of several tokens) is eager: the prompts of a step,
right-padded, through the same layers with causal attention over their own
keys, written to their slots.

Batch-invariant mode stays with ``TorchEngine`` on the CPU (this engine
refuses it): a bucket's row count changes how a matmul splits its work.

Shapes without weights: :func:`model_from_config` builds a shipped
``config.json`` (``simple_sampler/model_configs/``: SmolLM2-135M,
Qwen2.5-0.5B, Llama-3.2-1B, Llama-3.1-8B) with random weights drawn on the
device: the step times of those models, not their tokens.

``compile_decode`` swaps the decode step for its compiled form
(``compiled_decode.CompiledForward``: torch.compile over fused q/k/v and
gate/up weights), captured per bucket the same way; off by default.

Tested on the CPU against the Hugging Face eager forward
(tests/test_static_decode.py). The CUDA path (graph capture and replay) has
NOT been run: no GPU was available where it was written; its tests skip
without CUDA.
"""
from __future__ import annotations

import os
import time
from importlib import resources
from pathlib import Path
from typing import Sequence

import numpy as np
import torch
import torch.nn.functional as F

from ..host_copy import to_device
from ..settings import LlmSettings
from .compiled_decode import CompiledForward, rope
from .torch_engine import DEFAULT_MAX_BATCH_SIZE, DEFAULT_MAX_CONTEXT, TorchEngine, \
    _attention_backends

#: batch-size buckets a decode step is padded to (one CUDA graph each)
BUCKETS = (1, 8, 16, 32, 64, 128, 256)
#: the architectures the static forward covers (their layers: RMSNorm, RoPE,
#: GQA attention with optional q/k/v bias, SwiGLU MLP)
FAMILIES = ("llama", "qwen2")
#: shipped configs by name: ``--model-config NAME`` (or a path to a config.json)
SHIPPED_CONFIGS = ("smollm2-135m", "qwen2.5-0.5b", "llama-3.2-1b", "llama-3.1-8b")


def buckets_for(max_batch_size: int) -> tuple[int, ...]:
    """The buckets up to ``max_batch_size``, which is always one."""
    return tuple(sorted({b for b in BUCKETS if b < max_batch_size} | {max_batch_size}))


class StaticForward:
    """The decode and prefill forwards over a Llama / Qwen2 model's modules
    and a static cache (module docstring). Not thread-safe: the engine calls
    it under its step lock."""

    def __init__(self, model, keys: torch.Tensor, values: torch.Tensor):
        config = model.config
        if config.model_type not in FAMILIES:
            raise ValueError(f"the static decode step covers {', '.join(FAMILIES)} models, "
                             f"not {config.model_type!r}")
        self.model, self.keys, self.values = model, keys, values
        self.layers = model.model.layers
        self.heads = config.num_attention_heads
        self.kv_heads = config.num_key_value_heads
        self.head_dim = keys.shape[-1]
        context = keys.shape[-2]
        dtype, device = keys.dtype, keys.device
        positions = torch.arange(context, device=device)[None]
        with torch.inference_mode():  # the model's own RoPE (its scaling rules), once
            cos, sin = model.model.rotary_emb(torch.empty(0, dtype=dtype, device=device),
                                              positions)
        self.cos, self.sin = cos[0], sin[0]  # [context, head_dim]
        self.context_index = torch.arange(context, device=device)

    @torch.inference_mode()
    def decode(self, tokens: torch.Tensor, positions: torch.Tensor,
               start: int = 0) -> torch.Tensor:
        """Logits in the model's dtype ``[b, V]`` (not widened:
        ``torch_engine``'s module docstring) of one token per slot ``start ..
        start+b-1`` (``tokens``, ``positions``: int64 ``[b]`` on the device),
        its key and value written at ``positions``. Fixed shapes for a given
        (start, b), no host synchronization: the body of a CUDA graph."""
        rows = tokens.shape[0]
        group = self.heads // self.kv_heads
        cos = self.cos[positions][:, None, None, :]  # [b, 1, 1, head_dim]
        sin = self.sin[positions][:, None, None, :]
        mask = (self.context_index[None, :] <= positions[:, None])[:, None, None, :]
        slots = torch.arange(rows, device=tokens.device)
        hidden = self.model.model.embed_tokens(tokens)  # [b, hidden]
        for index, layer in enumerate(self.layers):
            attention = layer.self_attn
            x = layer.input_layernorm(hidden)
            q = attention.q_proj(x).view(rows, self.kv_heads, group, self.head_dim)
            k = attention.k_proj(x).view(rows, self.kv_heads, 1, self.head_dim)
            v = attention.v_proj(x).view(rows, self.kv_heads, self.head_dim)
            q, k = rope(q, cos, sin), rope(k, cos, sin)[:, :, 0]
            window = slice(start, start + rows)
            keys, values = self.keys[index, window], self.values[index, window]
            keys[slots, :, positions] = k
            values[slots, :, positions] = v
            out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask)
            hidden = hidden + attention.o_proj(out.reshape(rows, self.heads * self.head_dim))
            hidden = hidden + layer.mlp(layer.post_attention_layernorm(hidden))
        return self.model.lm_head(self.model.model.norm(hidden))

    @torch.inference_mode()
    def prefill(self, prompts: Sequence[Sequence[int]], slots: Sequence[int]) -> torch.Tensor:
        """Logits in the model's dtype ``[len(prompts), V]`` after each prompt's last
        token, the prompts' keys and values written to positions ``0 ..
        len - 1`` of their slots (eager; right padding writes positions a
        later token overwrites before any query reads them)."""
        device = self.keys.device
        width = max(len(p) for p in prompts)
        rows = len(prompts)
        # one queued copy from pinned memory (host_copy.to_device), not three
        # from pageable memory that each wait for what the stream holds
        tokens, slot_index, last = to_device(
            device, np.array([list(p) + [0] * (width - len(p)) for p in prompts], np.int64),
            np.array(list(slots), np.int64)[:, None],
            np.array([len(p) - 1 for p in prompts], np.int64))
        position = self.context_index[:width]
        cos, sin = self.cos[:width], self.sin[:width]  # broadcast over [rows, heads, width, D]
        hidden = self.model.model.embed_tokens(tokens)  # [rows, width, hidden]
        for index, layer in enumerate(self.layers):
            attention = layer.self_attn
            x = layer.input_layernorm(hidden)
            shape = (rows, width, -1, self.head_dim)
            q = rope(attention.q_proj(x).view(shape).transpose(1, 2), cos, sin)
            k = rope(attention.k_proj(x).view(shape).transpose(1, 2), cos, sin)
            v = attention.v_proj(x).view(shape).transpose(1, 2)
            self.keys[index][slot_index, :, position[None, :]] = k.transpose(1, 2)
            self.values[index][slot_index, :, position[None, :]] = v.transpose(1, 2)
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
            out = out.transpose(1, 2).reshape(rows, width, self.heads * self.head_dim)
            hidden = hidden + attention.o_proj(out)
            hidden = hidden + layer.mlp(layer.post_attention_layernorm(hidden))
        hidden = hidden[torch.arange(rows, device=device), last]
        return self.model.lm_head(self.model.model.norm(hidden))


class DecodeGraphs:
    """:meth:`StaticForward.decode` per window of slots and bucket, keyed
    ``(start, bucket)``: on CUDA each is captured as a CUDA graph by
    :meth:`prepare_all` or else the first time it is replayed (one memory
    pool for all), eager elsewhere. Each
    owns static ``tokens`` / ``positions`` inputs and ``logits`` / ``argmax``
    outputs, overwritten by the next replay.

    The capture's warm-up runs the bucket's forward on the inputs as they
    are, which the replay then runs again: it writes the same keys and values
    at the same positions (or, before any step, a position no query has read
    yet: module docstring)."""

    def __init__(self, forward: StaticForward, windows: Sequence[range]):
        self.forward = forward
        device = forward.keys.device
        self.graphed = device.type == "cuda"
        last = forward.keys.shape[-2] - 1
        self.inputs = {(w.start, b): (torch.zeros(b, dtype=torch.long, device=device),
                                      torch.full((b,), last, dtype=torch.long, device=device))
                       for w in windows for b in buckets_for(len(w))}
        self.outputs: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}
        self.graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self.pool = torch.cuda.graph_pool_handle() if self.graphed else None

    def _run(self, key: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
        with _attention_backends(self.forward.keys.device):
            logits = self.forward.decode(*self.inputs[key], start=key[0])
        return logits, logits.argmax(dim=-1)

    def _capture(self, key: tuple[int, int]) -> None:
        """Warm the step up on a side stream (as torch.cuda.graphs'
        documentation asks), then capture it into the shared pool."""
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):
                self._run(key)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            self.outputs[key] = self._run(key)
        self.graphs[key] = graph

    def prepare_all(self) -> int:
        """Every (window, bucket) step made ready now rather than at its first
        replay: captured on CUDA; elsewhere run once when the step is compiled
        (so its compile happens now), nothing when it is eager. Returns how
        many steps it prepared (0 when there was nothing to do)."""
        if self.graphed:
            keys = [key for key in self.inputs if key not in self.graphs]
            for key in keys:
                self._capture(key)
            return len(keys)
        if isinstance(self.forward, CompiledForward):
            for key in self.inputs:
                self._run(key)
            return len(self.inputs)
        return 0

    def bucket(self, rows: int, start: int = 0) -> int:
        """The smallest bucket of at least ``rows`` rows of the window at ``start``."""
        return min(b for s, b in self.inputs if s == start and b >= rows)

    def replay(self, bucket: int, start: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """(logits [b, V] in the model's dtype, argmax [b]) for the step's
        inputs as they are now (``inputs[(start, bucket)]``): its static
        outputs on CUDA, fresh tensors elsewhere."""
        key = (start, bucket)
        if not self.graphed:
            return self._run(key)
        if key not in self.graphs:
            self._capture(key)
        self.graphs[key].replay()
        return self.outputs[key]


class StaticEngine(TorchEngine):
    """``TorchEngine`` (slots, contract, host copy, hot-first) whose decode
    rows run :class:`StaticForward` through :class:`DecodeGraphs` and whose
    prompts run its eager prefill (module docstring). ``compile_decode``:
    the decode step compiled over fused weights (``compiled_decode``); off
    by default."""

    label = "StaticEngine"

    def __init__(self, model, max_batch_size: int = DEFAULT_MAX_BATCH_SIZE,
                 max_context: int = DEFAULT_MAX_CONTEXT, batch_invariant: bool = False,
                 host_logits: bool = True,
                 compile_decode: bool = LlmSettings.compile_decode):
        if batch_invariant:
            raise ValueError("batch_invariant runs with TorchEngine on the CPU only; the "
                             "static decode step's buckets change how a matmul splits")
        super().__init__(model, max_batch_size=max_batch_size, max_context=max_context,
                         host_logits=host_logits)
        self.static = StaticForward(model, self.keys, self.values)
        if compile_decode:
            self.static = CompiledForward(self.static)
        #: the lanes' windows of slots (``engine.SplitsSlots``): one until split
        self.windows = [range(max_batch_size)]
        self.graphs = DecodeGraphs(self.static, self.windows)

    def split_slots(self, lanes: int) -> None:
        """``engine.SplitsSlots``: the slots cut into ``lanes`` contiguous
        windows whose widths differ by one at most (the first
        ``max_batch_size % lanes`` one wider), each with its own buckets: one
        window per lane whatever the division leaves. Only while no
        sequence is held."""
        if not 1 <= lanes <= self.max_batch_size:
            raise ValueError(f"lanes must be in [1, {self.max_batch_size}] (max_batch_size), "
                             f"got {lanes}")
        with self.state_lock:
            if len(self.sequences):
                raise RuntimeError("split_slots while sequences hold slots")
            width, wider = divmod(self.max_batch_size, lanes)
            ends = np.cumsum([width + (lane < wider) for lane in range(lanes)])
            self.windows = [range(int(end) - width - (lane < wider), int(end))
                            for lane, end in enumerate(ends)]
        self.graphs = DecodeGraphs(self.static, self.windows)

    def warm_up(self) -> int:
        """``engine.WarmsUp``: :meth:`DecodeGraphs.prepare_all` for the windows
        as they are (``split_slots`` first: it makes new graphs). A capture
        writes its bucket's slots at the positions its inputs hold, which no
        query has read yet (module docstring), so sequences may hold slots."""
        return self.graphs.prepare_all()

    def free_in_lane(self, lane: int) -> int:
        """Free slots in lane ``lane``'s window."""
        window = self.windows[lane]
        with self.state_lock:
            return sum(slot in window for slot in self.free_slots)

    def add(self, seq_id, prompt_ids, max_tokens: int | None = None,
            lane: int | None = None) -> None:
        """``TorchEngine.add``; with ``lane``, the lowest free slot of that
        lane's window (RuntimeError when it has none)."""
        if lane is None:
            return super().add(seq_id, prompt_ids, max_tokens)
        window = self.windows[lane]

        def in_window() -> int:
            slot = min((s for s in self.free_slots if s in window), default=None)
            if slot is None:
                raise RuntimeError(f"every slot of lane {lane}'s window is taken")
            self.free_slots.remove(slot)
            return slot

        self._add_at(seq_id, prompt_ids, in_window)

    @classmethod
    def from_config(cls, config: str | os.PathLike, device: torch.device | str = "cpu",
                    dtype: torch.dtype = torch.float32, seed: int = 0,
                    **kwargs) -> "StaticEngine":
        """An engine over :func:`model_from_config` (random weights)."""
        return cls(model_from_config(config, device, dtype, seed), **kwargs)

    def _slot_inputs(self, work) -> tuple[int, int, np.ndarray]:
        """(window start s, bucket b, int64 [2, b] tokens and positions for
        slots s .. s+b-1): the stepped slots' pending token at its position,
        every other slot a token at its sequence's next position (free
        slots: the last). ValueError when the slots are not in one window.
        Built in lists and made an array once: setting a tensor's elements
        one by one made most of the step's host time (``bench engine-step``,
        docs/results/host-side-2026-11-29.md), about as much at B = 256 as
        the H200's whole decode step."""
        slots = [slot for slot, _, _ in work]
        window = next(w for w in self.windows if slots[0] in w)
        if not all(slot in window for slot in slots):
            raise ValueError(f"a step's slots must lie in one lane's window ({window}), got "
                             f"{sorted(slots)}")
        start = window.start
        bucket = self.graphs.bucket(max(slots) - start + 1, start)
        last = self.max_context - 1
        tokens, positions = [0] * bucket, [last] * bucket
        with self.state_lock:
            for row in self.sequences.values():
                if 0 <= row.slot - start < bucket:
                    positions[row.slot - start] = min(row.cached, last)
        for slot, cached, pending in work:
            tokens[slot - start], positions[slot - start] = pending[0], cached
        return start, bucket, np.array([tokens, positions], np.int64)

    def decode_rows(self, work) -> torch.Tensor:
        """``logits_dtype`` [len(work), V] for rows ``(slot, cached, [token])``, by one
        replay of their bucket: a fresh tensor (the graph's outputs are
        overwritten by the next replay, while a sampler may still read
        these; an eager step's are fresh already, and taken as they are when
        the rows are the bucket's slots in order)."""
        start, bucket, table = self._slot_inputs(work)
        rows = np.array([slot - start for slot, _, _ in work], np.int64)
        # one queued copy from pinned memory (host_copy.to_device): from
        # pageable memory each copy would wait, spinning, for what the stream
        # holds, another lane's forward or summary included
        table, index = to_device(self.device, table, rows)
        tokens, positions = self.graphs.inputs[(start, bucket)]
        tokens.copy_(table[0])
        positions.copy_(table[1])
        logits, _ = self.graphs.replay(bucket, start)
        if not self.graphs.graphed and np.array_equal(rows, np.arange(bucket)):
            return logits
        return logits.index_select(0, index)

    def _forward(self, work: list[tuple[int, int, list[int]]]) -> torch.Tensor:
        """``TorchEngine.step``'s forward over one group: decode rows by
        replay, prompts by the eager prefill (only prompts have several
        pending tokens, and they start at position 0). ``step`` runs the
        decode group first: the replay writes a not-yet-prefilled slot's
        position 0, which the prefill after it overwrites."""
        if all(len(pending) == 1 for _, _, pending in work):
            return self.decode_rows(work)
        assert all(cached == 0 for _, cached, _ in work), "several pending tokens after a prompt"
        with _attention_backends(self.device):
            return self.static.prefill([pending for _, _, pending in work],
                                       [slot for slot, _, _ in work])


def forward_only_ms(engine: StaticEngine, steps: int) -> float:
    """The data plane alone: ms per decode step of every active sequence,
    replayed ``steps`` times with each step's argmax fed back on the device
    (no host copy, no sampler, no Python per row). The sequences must hold
    slots ``0 .. n-1`` and have been stepped once (prefilled) with their
    token appended; their keys and values advance as in serving, but not
    the engine's bookkeeping: the engine is spent afterwards."""
    with engine.state_lock:
        rows = sorted((row.slot, row.cached, row.pending) for row in engine.sequences.values())
    if [slot for slot, _, _ in rows] != list(range(len(rows))):
        raise ValueError("forward_only needs the sequences in slots 0 .. n-1")
    if (max(cached for _, cached, _ in rows) + steps > engine.max_context
            or any(len(p) != 1 for _, _, p in rows)):
        raise ValueError("forward_only needs one pending token each and room for the steps")
    bucket = engine.graphs.bucket(len(rows))
    if bucket != len(rows):
        raise ValueError(f"forward_only runs a whole bucket: {len(rows)} sequences, bucket "
                         f"{bucket}")
    tokens, positions = engine.graphs.inputs[(0, bucket)]
    tokens.copy_(torch.tensor([p[0] for _, _, p in rows]))
    positions.copy_(torch.tensor([cached for _, cached, _ in rows]))
    _, argmax = engine.graphs.replay(bucket)  # captures on CUDA: outside the window
    synchronize(engine.device)
    start = time.perf_counter()
    for _ in range(steps - 1):
        tokens.copy_(argmax)
        positions.add_(1)
        _, argmax = engine.graphs.replay(bucket)
    synchronize(engine.device)
    return (time.perf_counter() - start) / max(1, steps - 1) * 1e3


def synchronize(device: torch.device) -> None:
    """Waits for the device's work (CUDA); nothing elsewhere."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def bytes_per_step(engine: StaticEngine, rows: int) -> dict[str, int]:
    """What one decode step of bucket ``rows`` reads from device memory at
    the least: every weight once (the embedding table's ``rows`` rows only,
    unless it is also the output layer) and the static cache's window of
    every row, keys and values (reads of the whole window: the step's
    attention runs over all of it, masked)."""
    model = engine.model
    embedding = model.model.embed_tokens.weight
    tied = embedding.data_ptr() == model.lm_head.weight.data_ptr()
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    if not tied:  # lm_head reads its own matrix; of the embedding only the rows' ids
        weights -= embedding.numel() * embedding.element_size()
        weights += rows * embedding.shape[1] * embedding.element_size()
    cache = 2 * engine.keys[:, :rows].numel() * engine.keys.element_size()
    return {"weights": weights, "kv_cache": cache, "total": weights + cache}


def copy_bandwidth(device: torch.device, megabytes: int = 512, repeats: int = 5) -> float:
    """Bytes per second of a device-to-device copy (read plus write), the
    best of ``repeats``: the HBM estimate's bandwidth."""
    source = torch.empty(megabytes << 20, dtype=torch.uint8, device=device)
    target = torch.empty_like(source)
    best = float("inf")
    for _ in range(repeats):
        synchronize(device)
        start = time.perf_counter()
        target.copy_(source)
        synchronize(device)
        best = min(best, time.perf_counter() - start)
    return 2 * source.numel() / best


def config_path(name: str | os.PathLike) -> Path:
    """A shipped config by name (:data:`SHIPPED_CONFIGS`) or a config.json's
    path; FileNotFoundError naming both when it is neither."""
    if str(name) in SHIPPED_CONFIGS:
        return Path(str(resources.files("simple_sampler") / "model_configs" / f"{name}.json"))
    path = Path(name).expanduser()
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"model config must be one of {', '.join(SHIPPED_CONFIGS)} or "
                                f"a config.json, got {str(name)!r}")
    return path


def model_from_config(config: str | os.PathLike, device: torch.device | str = "cpu",
                      dtype: torch.dtype = torch.float32, seed: int = 0):
    """A causal LM of a config.json's architecture with random weights
    (its initializer, ``seed``), allocated and drawn on ``device``: the shapes
    and so the step time of the model, none of its tokens."""
    os.environ["HF_HUB_OFFLINE"] = "1"
    from transformers import AutoConfig, AutoModelForCausalLM

    path = config_path(config)
    torch.manual_seed(seed)
    hf_config = AutoConfig.from_pretrained(path, local_files_only=True)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(hf_config, dtype=dtype)
    return model.eval()
