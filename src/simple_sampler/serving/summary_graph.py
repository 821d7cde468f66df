"""The hot-first summary as a replayed CUDA graph: ``hot_first.summarize``
captured once per step shape, then replayed, so a step costs the host one
graph launch and two copies instead of about sixty kernel launches. On an
H100 host eager torch spends more on launching the summary's small kernels
than the device spends running them (docs/results/gpu-2026-11-27b.md).

``GraphedSummary`` has the shape of an engine's ``hot_first_summary`` hook
(``hot_first.compact_rows``'s `summary`): same arguments, the ``cpu()``
form back. Off a CUDA device it is ``hot_first_summary``. The torch engine
serves through it (``TorchEngine.prepare_hot_first``: its rows then stay on
the GPU); TensorRT-LLM's rows still reach the host in its processor
(docs/HANDOFF.md, the limits). `bench summary-gpu` checks its rows against
the CPU's and times it beside the eager summary, and `bench serve-gpu`'s
``simple_hot_first`` serves through it; the capture and replay need CUDA,
so the tests here reach only the padding (tests/test_torch_hot_first.py
runs the engine's path on a GPU where one is visible).
"""
from __future__ import annotations

import logging
import threading
from collections import OrderedDict

import numpy as np
import torch

from ..handoff import CompactRows, host_arrays
from .hot_first import hot_set_on, step_inputs, summarize, hot_first_summary

log = logging.getLogger(__name__)

#: Captured steps kept (least recently used goes first): each holds its
#: rows' copy and the summary's [B, V] temporaries (the masked rows in their
#: dtype and float32 weights: 6 bytes a logit for bf16, 8 for float32,
#: beyond the copy), about 311 MB at B = 256, V = 151,936 bf16: 2.5 GB for
#: eight.
MAX_GRAPHS = 8
#: Fewest touched keys a step is captured for; more round up to a power
#: of two, so a step's history length changes the graph only at doublings.
MIN_KEYS = 256


def row_bucket(size: int) -> int:
    """The rows a step of `size` rows is captured for: itself up to 8, else
    rounded up to a multiple of an eighth of the power of two above it
    (four buckets per doubling: 10, 12, 14, 16, 20, ..., 224, 256, ...), so
    a decode loop whose batch changes every step replays a few graphs
    instead of capturing one per size; the padded rows cost at most a
    quarter more device work and nothing else."""
    if size <= 8:
        return size
    step = 1 << ((size - 1).bit_length() - 3)
    return -(-size // step) * step


class GraphedSummary:
    """``hot_first.hot_first_summary(...).cpu()`` by replayed CUDA graphs.

    A graph serves one (device, rows bucket, V, dtype, hot set, key
    capacity, largest cold_top, draws or not): B rounds up to
    ``row_bucket(B)``, the padded rows touching nothing, drawing nothing
    and handing no cold ids over (their outputs are dropped); the touched
    keys are padded to the capacity with a key of row 0's first hot id
    (masked already: writing -inf there again changes nothing). Calls
    are serialized (a lock): the buffers and graphs are shared."""

    def __init__(self, max_graphs: int = MAX_GRAPHS):
        self.max_graphs = max_graphs
        self.lock = threading.Lock()
        self.graphs: OrderedDict = OrderedDict()
        #: step shape -> why its capture failed (it then runs eager)
        self.refused: dict = {}

    def __call__(self, logits: torch.Tensor, hot_ids, touched_offsets, touched_ids, temperature,
                 cold_top=0, draws=None) -> CompactRows:
        with self.lock:
            return self._summary(logits, hot_ids, touched_offsets, touched_ids, temperature,
                                 cold_top, draws)

    def _summary(self, logits, hot_ids, touched_offsets, touched_ids, temperature, cold_top,
                 draws) -> CompactRows:
        eager = (logits.device.type != "cuda" or len(hot_ids) == 0)
        if not eager:
            size, vocab = logits.shape
            inputs, most = step_inputs(size, vocab, touched_offsets, touched_ids, temperature,
                                       cold_top, draws)
            rows = row_bucket(size)
            capacity = max(MIN_KEYS, 1 << int(inputs[1].size - 1).bit_length())
            key = (str(logits.device), rows, vocab, logits.dtype, capacity, most,
                   draws is not None)
            eager = key in self.refused
        if eager:
            return hot_first_summary(logits, hot_ids, touched_offsets, touched_ids, temperature,
                                     cold_top, draws).cpu()
        inputs = padded_inputs(inputs, rows)
        step = self.graphs.pop(key, None)
        if step is None or step.hot_ids is not hot_ids:
            while len(self.graphs) >= self.max_graphs:
                self.graphs.popitem(last=False)
            try:
                step = _CapturedStep(logits, rows, hot_ids, inputs, capacity, most,
                                     draws is not None)
            except RuntimeError as error:  # an op this torch cannot capture
                self.refused[key] = f"{type(error).__name__}: {error}"
                log.warning("hot-first summary: no CUDA graph for B=%d V=%d %s, eager from "
                            "now on: %s", rows, vocab, logits.dtype, error)
                return self._summary(logits, hot_ids, touched_offsets, touched_ids,
                                     temperature, cold_top, draws)
        self.graphs[key] = step
        return step.run(logits, inputs)


def padded_inputs(inputs, rows: int):
    """``step_inputs``' arrays for `rows` rows: the rows past the step's
    own have no touched ids (their offsets repeat the last), 1 / T = 1, no
    draw and no cold ids."""
    offsets, keys, count, inv_t, uniforms, tops = inputs
    extra = rows - len(inv_t)
    if not extra:
        return inputs
    return (np.concatenate([offsets, np.full(extra, offsets[-1])]), keys, count,
            np.concatenate([inv_t, np.ones(extra, inv_t.dtype)]),
            np.concatenate([uniforms, np.full(extra, np.nan)]),
            np.concatenate([tops, np.zeros(extra, np.int64)]))


class _CapturedStep:
    """One step shape's graph: static input buffers (the rows' copy, the
    packed small inputs in pinned host memory and on the device), the
    captured ``summarize`` and its output tensors."""

    def __init__(self, logits: torch.Tensor, rows: int, hot_ids, inputs, capacity: int,
                 most: int, drawn: bool):
        device = logits.device
        size, vocab = rows, logits.shape[1]
        self.hot_ids, self.capacity = hot_ids, capacity
        self.hot, self.handed = hot_set_on(device, hot_ids, vocab)
        self.filler = int(np.asarray(hot_ids)[0])  # row 0's key of a hot id: padded_keys
        shapes = [(size + 1, np.int64), (capacity, np.int64), (1, np.int64),
                  (size, np.float32), (size, np.float64), (size, np.int64)]
        order = sorted(range(len(shapes)), key=lambda i: -np.dtype(shapes[i][1]).itemsize)
        self.spans, start = [None] * len(shapes), 0
        for i in order:  # 8-byte dtypes first: every piece aligned
            count, dtype = shapes[i]
            self.spans[i] = (start, start + count * np.dtype(dtype).itemsize, dtype)
            start = self.spans[i][1]
        self.host = torch.empty(start, dtype=torch.uint8, pin_memory=True)
        self.device_inputs = torch.empty(start, dtype=torch.uint8, device=device)
        views = [self.device_inputs[a:b].view(torch.from_numpy(np.empty(0, dtype)).dtype)
                 for a, b, dtype in self.spans]
        # the padded rows hold zeros, or a larger earlier step's rows: never
        # this step's, and rows do not mix
        self.logits = torch.zeros((size, vocab), dtype=logits.dtype, device=device)
        self._load(logits, inputs)
        arguments = (self.logits, self.hot, self.handed, most, drawn, *views)
        side = torch.cuda.Stream(device)  # warm-up off the capture, as torch.cuda.graphs asks
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            summarize(*arguments)
        torch.cuda.current_stream(device).wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, capture_error_mode="thread_local"):
            self.out = summarize(*arguments)
        self.names = list(self.out)

    def _load(self, logits: torch.Tensor, inputs) -> None:
        packed = self.host.numpy()
        offsets, keys, *rest = inputs
        padded = padded_keys(keys, self.capacity, self.filler)
        for (a, b, dtype), array in zip(self.spans, (offsets, padded, *rest)):
            packed[a:b] = np.ascontiguousarray(array, dtype).view(np.uint8)
        # from pinned memory, queued: the last step's copy ended before its
        # results came back, so rewriting the buffer above was safe
        self.device_inputs.copy_(self.host, non_blocking=True)
        self.logits[:len(logits)].copy_(logits)

    def run(self, logits: torch.Tensor, inputs) -> CompactRows:
        self._load(logits, inputs)
        self.graph.replay()
        return own_rows(dict(zip(self.names, host_arrays([self.out[name]
                                                            for name in self.names]))),
                        len(logits))


def padded_keys(keys: np.ndarray, capacity: int, filler: int) -> np.ndarray:
    """int64 [capacity]: the step's touched keys, then `filler` (row 0's key
    of a hot id: masked already, so masking it again changes nothing)."""
    padded = np.full(capacity, filler, np.int64)
    padded[:keys.size] = keys
    return padded


def own_rows(arrays: dict, size: int) -> CompactRows:
    """``summarize``'s outputs on the host (a padded step's) as the step's
    own `size` rows: its touched lists end where its last row's do."""
    return CompactRows(**arrays).rows(0, size)
