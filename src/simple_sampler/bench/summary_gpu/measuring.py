"""`simple-sampler bench summary-gpu`: the hot-first handoff's data-plane
side where a GPU host runs it, on the device next to the logits, against the
full rows' device-to-host copy and against what the simulated engine charges
for it.

Per (V, dtype, B, config), on the same rows in one run, wall time per step
(the median of interleaved rounds, ``kernels.time_interleaved``):
  summary    ``hot_first.compact_rows`` on rows already on the device: the
             touched lists on the host, ``hot_first_summary`` on the device
             (mask H and the touched ids, the cold top-k where a row needs
             it, max and argmax, the exp-sum, the cold draw), and the compact
             rows' copy to the host (``cpu()``, which waits for the device):
             what the decode loop's data-plane thread spends on a step
  graphed    the same with the summary replayed as a CUDA graph
             (``summary_graph.GraphedSummary``, shaped as an engine's summary hook;
             the eager summary off a GPU)
  device     ``hot_first_summary`` alone on the same step's touched lists,
             cold_tops and draws, waited for, its result left on the device
  full_copy  the full rows into a pinned host buffer, one copy, waited for:
             what crosses per step without the handoff
  modelled   ``SimulatedEngine``'s charge for the summary,
             ``SUMMARY_READS * B * V * itemsize / HBM_BYTES_PER_S``
             (docs/SIMULATED.md); measured / modelled says how far that
             model is from this device
bytes per row: full = V * itemsize; compact = the ``cpu()`` form's arrays.
against_cpu, graphed_against_cpu: the device's compact rows (eager, graphed)
against ``hot_first_summary`` in torch on this host's CPU on the same inputs
(``against_cpu``): the GPU paths are checked where they run.

Rows: real SmolLM2 rows at V = 49,152 (``rows.real_rows``, tiled to B);
synthetic rows with real token ids kept at other V (``rows.synthetic_hot_rows``,
NOT MODEL OUTPUTS), the shipped hot set mapped to them, as ``bench handoff``.
Configs: ``plain`` (temperature 1: untruncated, each row's cold token drawn),
and ``bench shvs``'s ``top_p`` (0.9: truncated, cold_top ids handed over)
and ``all`` (every feature, 256 history ids: touched ids).

``--device cpu`` runs the same on this CPU (the tests do); the figures that
mean something come from a GPU. No TensorRT-LLM is involved.
"""
from __future__ import annotations

import numpy as np
import torch

from ...handoff import DEFAULT_COLD_TOP, CompactRows
from ...params import SamplingParams
from ...rows import HOT_ROWS_SOURCE, ROWS_SOURCE, SMOLLM2_VOCAB, map_hot_ids, real_rows, \
    synthetic_hot_rows
from ...serving.device import DTYPES, resolve
from ...serving.hot_first import compact_rows, hot_first_summary
from ...serving.summary_graph import GraphedSummary
from ...serving.simulated import HBM_BYTES_PER_S, SUMMARY_READS
from ...shvs.hot_vocab import HotVocab
from ..kernels.measuring import make_batch, time_interleaved
from ..shvs.measuring import CONFIGS, resolve_profile

#: (V, dtype): issue 24's two shapes, and SmolLM2's real rows
SHAPES = ((151_936, "bfloat16"), (128_256, "float32"), (49_152, "bfloat16"))
BATCHES = (64, 256)
PLAIN = SamplingParams(temperature=1.0)
SUMMARY_CONFIGS = {"plain": (PLAIN, 0), **CONFIGS}


def modelled_ms(batch: int, vocab: int, dtype: str) -> float:
    """The simulated engine's device time for one step's summary, in ms."""
    itemsize = torch.empty(0, dtype=DTYPES[dtype]).element_size()
    return SUMMARY_READS * batch * vocab * itemsize / HBM_BYTES_PER_S * 1e3


def _rows(real: np.ndarray, vocab: int, batch: int) -> np.ndarray:
    if vocab == SMOLLM2_VOCAB:
        return real[np.arange(batch) % len(real)]
    return synthetic_hot_rows(real, vocab, n=batch)


def measure(device: torch.device, rows: np.ndarray, dtype: str, batch, hot: HotVocab,
            cold_top: int, repeats: int) -> dict:
    """One shape and config: ms per step of summary, device and full_copy
    (module docstring), bytes per row."""
    tensor = torch.from_numpy(rows).to(device=device, dtype=DTYPES[dtype])
    pinned = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=device.type == "cuda")

    def wait():
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    def full_copy():
        pinned.copy_(tensor, non_blocking=True)
        wait()

    def summary():
        return compact_rows(tensor, batch, hot, cold_top)

    graphs = GraphedSummary()

    def graphed():
        return compact_rows(tensor, batch, hot, cold_top, summary=graphs)

    # the step's summary arguments as compact_rows composes them, kept
    # through its summary hook
    arguments = []

    def kept(*step):
        arguments[:] = step[1:]
        return hot_first_summary(*step).cpu()

    compact = compact_rows(tensor, batch, hot, cold_top, summary=kept)

    def on_device():
        hot_first_summary(tensor, *arguments)
        wait()

    size = len(rows)
    wait()
    per_row = time_interleaved({"summary": summary, "graphed": graphed, "device": on_device,
                                "full_copy": full_copy}, size, repeats)
    on_cpu = hot_first_summary(tensor.cpu(), *arguments).cpu()
    return {"ms_per_step": {name: round(us * size / 1e3, 4) for name, us in per_row.items()},
            "bytes_per_row": {"full": int(rows.shape[1] * tensor.element_size()),
                              "compact": round(compact.nbytes() / size, 1)},
            "against_cpu": against_cpu(compact, on_cpu),
            "graphed_against_cpu": against_cpu(graphed(), on_cpu),
            "graph_refused": "; ".join(graphs.refused.values()) or None}


def against_cpu(rows: CompactRows, cpu: CompactRows) -> dict:
    """How the device's compact rows differ from this host's CPU torch on
    the same inputs: rows with any id, raw logit or cold token not equal
    (a tie of the cold top-k broken another way counts), and the largest
    relative difference of the cold masses (exps and sums rounded in
    another order: ~1e-7 is float32 rounding)."""
    def per_row(compact):
        offsets = compact.touched_offsets
        return [(compact.hot_logits[r].tobytes(), compact.touched_ids[offsets[r]:offsets[r + 1]]
                 .tobytes(), compact.touched_logits[offsets[r]:offsets[r + 1]].tobytes(),
                 compact.cold_max[r], compact.cold_argmax[r],
                 None if compact.cold_token is None else compact.cold_token[r])
                for r in range(len(compact.cold_max))]
    differing = sum(a != b for a, b in zip(per_row(rows), per_row(cpu)))
    mass, reference = rows.cold_mass.astype(np.float64), cpu.cold_mass.astype(np.float64)
    scale = np.maximum(np.abs(reference), np.finfo(np.float32).tiny)
    return {"rows_differing": int(differing),
            "max_mass_rel_diff": float(np.max(np.abs(mass - reference) / scale, initial=0.0))}


def run(device_name: str = "cuda", shapes=SHAPES, batches=BATCHES, configs=None,
        repeats: int = 20, profile_path: str | None = None,
        cold_top: int = DEFAULT_COLD_TOP) -> dict:
    """Every shape, B and config; RuntimeError (the reason) where the device
    cannot run."""
    device, _ = resolve(device_name, "float32")
    for _, dtype in shapes:
        resolve(device_name, dtype)
    profile = resolve_profile(profile_path, quick=False)
    order = profile.order[:profile.chosen_size]
    real = real_rows(64)
    results = []
    for vocab, dtype in shapes:
        ids = order if vocab == SMOLLM2_VOCAB else map_hot_ids(order, vocab)
        hot = HotVocab(ids, vocab)
        for size in batches:
            rows = _rows(real, vocab, size)
            for config in configs or SUMMARY_CONFIGS:
                params, history = SUMMARY_CONFIGS[config]
                figures = measure(device, rows, dtype, make_batch(params, rows, history), hot,
                                  cold_top, repeats)
                model = modelled_ms(size, vocab, dtype)
                results.append({"vocab": vocab, "dtype": dtype, "batch": size, "config": config,
                                "rows": ROWS_SOURCE(vocab) if vocab == SMOLLM2_VOCAB
                                else HOT_ROWS_SOURCE,
                                **figures, "modelled_ms": round(model, 4),
                                "summary_vs_modelled": round(
                                    figures["ms_per_step"]["summary"] / model, 2)})
    where = (torch.cuda.get_device_name(device) if device.type == "cuda"
             else "this CPU (not where a GPU host runs it)")
    return {"results": results, "device": where, "torch": torch.__version__,
            "cuda": torch.version.cuda, "hot_size": len(order), "cold_top": cold_top,
            "repeats": repeats}


def format_report(report: dict) -> str:
    lines = [f"hot-first summary on {report['device']} (torch {report['torch']}, CUDA "
             f"{report['cuda']}), |H|={report['hot_size']}, cold_top={report['cold_top']}; "
             f"ms per step, wall, median of {report['repeats']} interleaved rounds",
             f"{'vocab':>7} {'dtype':>8} {'B':>4} {'config':>6} {'summary':>8} {'graphed':>7} "
             f"{'device':>7} "
             f"{'full copy':>9} "
             f"{'modelled':>8} {'x model':>7} {'bytes full':>10} {'compact':>8} {'ratio':>6}"
             f" {'vs cpu':>6} {'mass':>7} {'graph vs cpu':>12}  rows"]
    for r in report["results"]:
        ms, b = r["ms_per_step"], r["bytes_per_row"]
        lines.append(f"{r['vocab']:>7} {r['dtype']:>8} {r['batch']:>4} {r['config']:>6} "
                     f"{ms['summary']:>8.3f} {ms['graphed']:>7.3f} {ms['device']:>7.3f} "
                     f"{ms['full_copy']:>9.3f} "
                     f"{r['modelled_ms']:>8.3f} "
                     f"{r['summary_vs_modelled']:>7.1f} {b['full']:>10} {b['compact']:>8.0f} "
                     f"{b['compact'] / b['full']:>6.1%} {r['against_cpu']['rows_differing']:>6} "
                     f"{r['against_cpu']['max_mass_rel_diff']:>7.0e} "
                     f"{r['graphed_against_cpu']['rows_differing']:>12}  {r['rows']}")
    for r in report["results"]:
        if r.get("graph_refused"):
            lines.append(f"  graphed ran eager at V={r['vocab']} B={r['batch']} {r['config']}: "
                         f"{r['graph_refused']}")
    lines.append("summary = compact_rows on device-resident rows, its copy to the host "
                 "included; graphed = the same, the summary a replayed CUDA graph; "
                 "device = hot_first_summary alone, its result left on the device; "
                 "full copy = the rows into pinned host memory; modelled = the "
                 "simulated engine's charge (SUMMARY_READS reads of the rows at "
                 "HBM_BYTES_PER_S, docs/SIMULATED.md); x model = summary / modelled; "
                 "vs cpu = rows whose compact row differs from this host's CPU torch on the "
                 "same inputs (ids, raw logits, cold token), mass = the largest relative "
                 "difference of their cold masses; graph vs cpu = the same count for graphed")
    return "\n".join(lines)
