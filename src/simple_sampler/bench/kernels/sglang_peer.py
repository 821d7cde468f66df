"""SGLang's own sampler on CPU, timed on the rows and settings `bench kernels`
gives it: the `sglang_cpu` columns.

Runs as a script under a python that imports sglang (`make peer-sglang` puts
sglang in its own virtualenv, .peer-sglang/), reading one .npz case (the
vllm_peer.py format) and printing one JSON line. So it imports nothing from
this project, only numpy, torch and sglang.

What one timed call is, in SGLang's files (sglang 0.5.23):
  * sglang/srt/model_executor/model_runner.py, ModelRunner._preprocess_logits:
    SamplingBatchInfo.update_regex_vocab_mask and apply_logits_bias
    (sglang/srt/sampling/sampling_batch_info.py): the penalizer orchestrator's
    frequency, presence and repetition penalizers (sglang/srt/sampling/penaltylib/,
    the repetition one through its torch.compile'd apply_scaling_penalties);
  * sglang/srt/layers/sampler.py, Sampler.forward: temperature (logits.div_),
    softmax (sglang/kernels/ops/sampling.softmax: torch.softmax on CPU), then
    Sampler._sample_from_probs with the "pytorch" sampling backend, the one
    SGLang sets for device "cpu" (sglang/srt/arg_groups/platform_hook.py,
    _handle_cpu_backends): top_k_top_p_min_p_sampling_from_probs_torch (a topk
    of max_top_k columns when every row has a top_k, else a full sort; cumsum
    top_p, min_p against the top probability, torch.multinomial).
What ModelRunner.sample adds beyond that (observers, watermarks, logprobs) is
off for these requests and left out.

The batch is built the way SGLang's scheduler builds it: a
sglang.srt.sampling.sampling_params.SamplingParams per row (temperature 0
becomes SGLang's greedy, top_k 1), a Req per row, a ScheduleBatch of them
(sglang/srt/managers/schedule_batch.py) and
SamplingBatchInfo.from_schedule_batch. SGLang's penalizers count output
tokens only: each row's output ids are fed one decode step at a time through
ScheduleBatch.cumulate_penalty_output_tokens, as the scheduler does; prompt
ids go into the Req and count for nothing. Without deterministic inference
SGLang has no per-row seed: torch.multinomial draws from torch's global
generator, seeded once from the first row's seed. The sampler needs SGLang's
process-wide server args (published with SGLang's own
override_server_args, device "cpu") and a tensor-parallel group: a gloo
group of one process (sglang/srt/distributed/parallel_state.py).
"""
from __future__ import annotations

import json
import sys
import tempfile
import time
import warnings
from array import array

import numpy as np

#: added to each row's top logit for the peaked check: far above any row's
#: spread and any penalty these settings take off it.
PEAK = 1000.0


def _ragged(offsets: np.ndarray, ids: np.ndarray) -> list[list[int]]:
    return [ids[offsets[r]:offsets[r + 1]].tolist() for r in range(offsets.size - 1)]


def _start_sglang(directory: str) -> None:
    """SGLang's server args for a CPU process and its parallel groups, one process wide."""
    from sglang.srt.distributed.parallel_state import init_distributed_environment, initialize_model_parallel
    from sglang.srt.runtime_context import get_context, get_exec

    get_context().override_server_args(device="cpu", sampling_backend="pytorch").install()
    assert get_exec().kernel.sampling_backend == "pytorch"
    init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                 distributed_init_method=f"file://{directory}/group")
    initialize_model_parallel(backend="gloo")


def _batch(case: dict):
    """The ScheduleBatch of one Req per row, its SamplingBatchInfo, and the
    rows' output ids already fed to the penalizers."""
    from sglang.srt.managers.schedule_batch import Req, ScheduleBatch
    from sglang.srt.sampling.sampling_batch_info import SamplingBatchInfo
    from sglang.srt.sampling.sampling_params import SamplingParams

    size, vocab = case["rows"].shape
    prompts = _ragged(case["prompt_offsets"], case["prompt_ids"])
    outputs = _ragged(case["output_offsets"], case["output_ids"])
    if len({len(ids) for ids in outputs}) > 1:
        raise ValueError("sglang_peer: the scheduler feeds every row one output token a step; "
                         "rows with unequal output histories are not replayed")
    reqs = []
    for r in range(size):
        top_k = int(case["top_k"][r])
        params = SamplingParams(
            temperature=float(case["temperature"][r]), top_p=float(case["top_p"][r]),
            top_k=-1 if top_k <= 0 or top_k >= vocab else top_k, min_p=float(case["min_p"][r]),
            frequency_penalty=float(case["frequency"][r]), presence_penalty=float(case["presence"][r]),
            repetition_penalty=float(case["repetition"][r]))
        params.normalize(None)
        params.verify(vocab)
        reqs.append(Req(f"row{r}", "", array("i", prompts[r] or [0]), params, vocab_size=vocab))
    batch = ScheduleBatch(reqs=reqs, device="cpu")
    batch.sampling_info = SamplingBatchInfo.from_schedule_batch(batch, vocab)
    for step in range(len(outputs[0])):
        for req, ids in zip(reqs, outputs):
            req.output_ids.append(ids[step])
        batch.cumulate_penalty_output_tokens()
    return batch


def _sample(sampler, info, logits, positions):
    """One step as ModelRunner.sample runs it for these requests: the logits'
    bias (penalties), then Sampler.forward."""
    from sglang.srt.layers.logits_processor import LogitsProcessorOutput

    output = LogitsProcessorOutput(next_token_logits=logits)
    info.update_regex_vocab_mask()
    info.apply_logits_bias(logits)
    return sampler.forward(output, info, False, [], [], positions)


def _check_peaked(sampler, info, rows, positions) -> None:
    """Each row's top logit raised by PEAK: every row must draw its argmax."""
    import torch

    logits = rows.clone()
    top = logits.float().argmax(dim=-1)
    logits[torch.arange(len(top)), top] += PEAK
    tokens = _sample(sampler, info, logits, positions).long()
    if not torch.equal(tokens, top):
        raise AssertionError(f"sglang_peer: peaked rows drew {tokens.tolist()}, not their argmax {top.tolist()}")


def _time_steps(rows, case: dict, repeats: int, clock: str):
    """The seconds of each of repeats + 1 steps, and the last step's tokens;
    then the peaked check."""
    import torch
    from sglang.srt.layers.sampler import Sampler

    batch = _batch(case)
    info = batch.sampling_info
    sampler = Sampler()
    positions = torch.zeros(rows.shape[0], dtype=torch.int64)
    # as kernels.CLOCKS: elapsed time, or this process's CPU time
    now = time.process_time if clock == "cpu" else time.perf_counter
    times = []
    for _ in range(repeats + 1):
        # SGLang works in place on the logits: a fresh copy per call, outside the clock.
        logits = rows.clone()
        start = now()
        out = _sample(sampler, info, logits, positions)
        times.append(now() - start)
    _check_peaked(sampler, info, rows, positions)
    return times, out


def time_case(case: dict, repeats: int, threads: int, clock: str = "wall") -> dict:
    """Median microseconds per row of one step (penalties and Sampler.forward)
    over `repeats` calls, after one warm-up (which compiles SGLang's
    torch.compile'd penalty), and the tokens of the last call."""
    import sglang
    import torch

    torch.set_num_threads(threads)
    rows = torch.from_numpy(case["rows"])
    if case["dtype"] == "bfloat16":
        rows = rows.view(torch.bfloat16)
    torch.manual_seed(int(case["seed"][0]))
    with tempfile.TemporaryDirectory() as directory:
        _start_sglang(directory)
        try:
            times, out = _time_steps(rows, case, repeats, clock)
        finally:
            # (SGLang's destroy_model_parallel imports its launcher, uvicorn and all)
            torch.distributed.destroy_process_group()
    return {"us_per_row": float(np.median(times[1:])) / rows.shape[0] * 1e6,
            "tokens": out.view(-1).tolist(),
            "sglang_version": sglang.__version__, "torch_version": torch.__version__}


def main(argv: list[str]) -> int:
    path, repeats, threads = argv[0], int(argv[1]), int(argv[2])
    clock = argv[3] if len(argv) > 3 else "wall"
    with np.load(path) as data:
        case = {k: data[k] for k in data.files}
    case["dtype"] = str(case["dtype"])
    # SGLang warns at import about the CUDA-only parts it cannot use here; only
    # the JSON line goes to stdout.
    warnings.filterwarnings("ignore")
    print(json.dumps(time_case(case, repeats, threads, clock)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
