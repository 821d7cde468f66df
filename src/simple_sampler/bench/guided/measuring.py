"""`simple-sampler bench guided`: what structured outputs (``serving/structured.py``)
add to a decode step, beside what sampling the same rows costs, in one run.

Per guide kind (a JSON schema, any JSON object, a regex, a choice, an EBNF
grammar) and batch size B, every row held to that guide, over `steps` steps
of the decode loop's own calls, in its order:
  fill      ``Grammars.masks``: the step's next-token bitmasks, filled on
            llguidance's threads (``structured.MASK_THREADS``) while the
            decode loop waits (wall ms a step; ``fill_cpu``: the process's
            CPU ms over all threads in that time)
  apply     ``StepMasks.applied``: a copy of the step's rows with every
            ruled-out token at -inf, here on the CPU (the CPU engine's and
            the TensorRT-LLM bridge's host rows; on a GPU it runs on the
            device, beside the logits), into a buffer kept from step to
            step as the data plane keeps one (``data_plane.SpareRows``)
  consume   ``Grammars.consume``: each matcher takes its row's token
  sample    the kernels (``sampling.sample``, one thread, top_p 0.9) on the
            masked rows: the tokens the walk takes
  plain     the same call on the same rows unmasked: what the step's
            sampling costs without a guide, the scale for the rest
overhead = (fill + apply + consume) / plain. A row whose grammar ended (its
end id drawn) starts again from a fresh matcher (``Grammars.matcher``, a
copy of the compiled guide; counted as ``restarts``, timed in ``restart_us``).

Rows: real SmolLM2 rows (``rows.real_rows``, V = 49,152, the model whose
tokenizer the grammars use), tiled to B. They are FIXED: a row's logits do
not follow the tokens its walk takes, so the walk is the grammar's path
through likely tokens of a real row, not a model's answer.

The decode loop (``loops``): requests held to the JSON schema, twice B of
them, at most B at once, decoded by the decode loop with the server's
defaults on the SIMULATED engine (GPU-paced: it sleeps t(B) a step, rows
synthetic, every output labelled), against the same number of unguided
requests as long (the guided run's mean): tokens a second of each side,
one after the other in one run, and guided / plain, which is what the
masks cost a served step where the forward is a GPU's.

Compiling (``compile_ms``): each guide compiled afresh (``Grammars.compiled``
on an empty cache; once per distinct guide in serving, in a worker thread
before the request queues), and ``matcher_us``, a request's copy of a cached
one; ``tokenizer_ms``: llguidance's tokenizer, built once per server.
"""
from __future__ import annotations

import asyncio
import json
import time

import numpy as np
import torch

from ...params import SamplingParams
from ...rows import real_rows
from ...sampling import sample
from ...serving.decoder import Decoder
from ...serving.generation import GenerationRequest
from ...serving.samplers import kernel_sample, threaded
from ...serving.simulated import SimulatedEngine, SimulatedSpec
from ...serving.structured import MASK_THREADS, Grammars, Guide
from ...serving.text import TextCodec, load_tokenizer
from ..kernels.measuring import TOP_P_ONLY, make_batch

#: a form's fields, as an OpenAI json_schema response_format would hold them
SCHEMA = {"type": "object", "additionalProperties": False,
          "properties": {"name": {"type": "string", "maxLength": 32},
                         "age": {"type": "integer", "minimum": 0, "maximum": 150},
                         "city": {"enum": ["Paris", "Berlin", "Tokyo", "Lima"]},
                         "tags": {"type": "array", "items": {"type": "string", "maxLength": 12},
                                  "maxItems": 3}},
          "required": ["name", "age", "city", "tags"]}
GUIDES = {"json_schema": Guide("json_schema", json.dumps(SCHEMA)),
          "json": Guide("json"),
          "regex": Guide("regex", r"[A-Z][a-z]{2,12} [0-9]{1,4}, [0-9]{3}-[0-9]{4}"),
          "choice": Guide("choice", json.dumps(["positive", "negative", "neutral", "mixed"])),
          "ebnf_grammar": Guide("ebnf_grammar", 'root ::= expr\nexpr ::= term ([-+*/] term)*\n'
                                                'term ::= [0-9]+ | "(" expr ")"')}
#: the masked rows' sampler: top_p 0.9 alone (bench kernels' ``top_p``)
PARAMS = TOP_P_ONLY


def _grammars(tokenizer) -> Grammars:
    return Grammars(tokenizer, len(tokenizer), [tokenizer.eos_token_id])


def compiling(tokenizer, repeats: int) -> dict:
    """Milliseconds to build llguidance's tokenizer once, and per guide the
    median of `repeats` fresh compiles and of a cached guide's copies."""
    started = time.perf_counter()
    grammars = _grammars(tokenizer)
    grammars.tokenizer()
    tokenizer_ms = (time.perf_counter() - started) * 1e3
    guides = {}
    for kind, guide in GUIDES.items():
        compile_s, copy_s = [], []
        for _ in range(repeats):
            grammars.templates.clear()
            started = time.perf_counter()
            grammars.compiled(guide)
            compile_s.append(time.perf_counter() - started)
            started = time.perf_counter()
            grammars.matcher(guide, grammars.end_ids)
            copy_s.append(time.perf_counter() - started)
        guides[kind] = {"compile_ms": round(float(np.median(compile_s)) * 1e3, 2),
                        "matcher_us": round(float(np.median(copy_s)) * 1e6, 1)}
    return {"tokenizer_ms": round(tokenizer_ms, 1), "guides": guides}


def walk(grammars: Grammars, guide: Guide, rows: np.ndarray, steps: int) -> dict:
    """`steps` guided steps over `rows` (every row held to `guide`): mean
    ms a step of each column (module docstring)."""
    size = len(rows)
    batch = make_batch(PARAMS, rows, 0)
    tensor = torch.from_numpy(rows)
    spare = torch.empty_like(tensor)
    end_id = grammars.end_ids[0]
    matchers = [grammars.matcher(guide, grammars.end_ids) for _ in range(size)]
    spent = dict.fromkeys(("fill", "fill_cpu", "apply", "consume", "sample", "plain",
                           "restart"), 0.0)
    restarts = 0
    for _ in range(steps):
        wall, cpu = time.perf_counter(), time.process_time()
        masks = grammars.masks(matchers, [None] * size)
        spent["fill"] += time.perf_counter() - wall
        spent["fill_cpu"] += time.process_time() - cpu
        started = time.perf_counter()
        masked = masks.applied(tensor, spare).numpy()
        spent["apply"] += time.perf_counter() - started
        started = time.perf_counter()
        tokens = sample(masked, batch, return_logprobs=False, num_threads=1).token_ids
        spent["sample"] += time.perf_counter() - started
        started = time.perf_counter()
        sample(rows, batch, return_logprobs=False, num_threads=1)
        spent["plain"] += time.perf_counter() - started
        started = time.perf_counter()
        broken = grammars.consume(matchers, tokens)
        spent["consume"] += time.perf_counter() - started
        if broken:
            raise RuntimeError(f"a masked row drew a token its grammar refuses: {broken}")
        started = time.perf_counter()
        for row in np.flatnonzero(tokens == end_id):
            matchers[row] = grammars.matcher(guide, grammars.end_ids)
            restarts += 1
        spent["restart"] += time.perf_counter() - started
    ms = {name: round(total / steps * 1e3, 3) for name, total in spent.items() if name != "restart"}
    return {"ms_per_step": ms,
            "overhead": round((ms["fill"] + ms["apply"] + ms["consume"]) / ms["plain"], 3),
            "restarts": restarts,
            "restart_us": round(spent["restart"] / restarts * 1e6, 1) if restarts else None}


def decoded(tokenizer, size: int, requests: int, guide: Guide | None, max_tokens: int) -> dict:
    """`requests` requests (each held to `guide`, or not) decoded by the
    decode loop (``Decoder``, the server's defaults, its sampler the kernels
    in a worker thread) on the simulated engine at V = 49,152, at most
    `size` at once: tokens a second and wall ms a step."""
    async def main():
        engine = SimulatedEngine(SimulatedSpec(vocab=len(tokenizer), dtype="float32"),
                                 max_batch_size=size)
        decoder = Decoder(engine, TextCodec(tokenizer), sampler=threaded(kernel_sample))
        await decoder.start()
        started = time.perf_counter()
        handles = [decoder.submit(GenerationRequest(
            prompt_ids=[1, 2, 3], max_tokens=max_tokens, guide=guide,
            sampling=SamplingParams(temperature=0.8, top_p=0.95, seed=index)))
            for index in range(requests)]
        finals = await asyncio.gather(*(_final(handle) for handle in handles))
        wall = time.perf_counter() - started
        await decoder.close()
        errors = [event.error for event in finals if event.error]
        if errors:
            raise RuntimeError(f"{len(errors)} requests failed: {errors[0]}")
        stats = decoder.stats
        return {"tokens_per_s": round(stats.tokens / wall, 1),
                "ms_per_step": round(wall / stats.steps * 1e3, 3),
                "rows_per_step": round(stats.tokens / stats.steps, 1),
                "tokens": stats.tokens, "label": engine.label}
    return asyncio.run(main())


async def _final(handle):
    async for event in handle:
        last = event
    return last


def looped(tokenizer, size: int, requests: int) -> dict:
    """The decode loop with every request held to the JSON schema, and
    again unguided with as many tokens a request (its mean length guided):
    tokens a second of each and guided / plain."""
    guided = decoded(tokenizer, size, requests, GUIDES["json_schema"], 256)
    plain = decoded(tokenizer, size, requests, None, max(1, round(guided["tokens"] / requests)))
    return {"batch": size, "requests": requests, "guided": guided, "plain": plain,
            "ratio": round(guided["tokens_per_s"] / plain["tokens_per_s"], 3)}


def run(batches=(8, 64, 256), steps: int = 48, repeats: int = 5,
        loop_batches=(64, 256)) -> dict:
    torch.set_num_threads(1)
    tokenizer = load_tokenizer()
    base = real_rows(64)
    compiled = compiling(tokenizer, repeats)
    grammars = _grammars(tokenizer)
    results = []
    for size in batches:
        rows = np.ascontiguousarray(np.resize(base, (size, base.shape[1])))
        for kind, guide in GUIDES.items():
            results.append({"guide": kind, "batch": size, **walk(grammars, guide, rows, steps)})
    loops = [looped(tokenizer, size, 2 * size) for size in loop_batches]
    return {"results": results, "compiling": compiled, "loops": loops, "vocab": base.shape[1],
            "steps": steps, "mask_threads": MASK_THREADS, "sampler_threads": 1, "clock": "wall",
            "rows": "real SmolLM2 rows, fixed (the walk does not feed the model)",
            "note": "apply runs on this CPU (host rows); on a GPU it runs on the device"}


def format_table(report: dict) -> str:
    compiled = report["compiling"]
    lines = [f"compile (ms, fresh; matcher: us a request's copy); llguidance's tokenizer "
             f"{compiled['tokenizer_ms']} ms once",
             *(f"  {kind:>12} {c['compile_ms']:>9.2f} ms {c['matcher_us']:>8.1f} us"
               for kind, c in compiled["guides"].items()),
             f"ms a step over {report['steps']} steps, V={report['vocab']:,}, "
             f"{report['mask_threads']} mask threads, sampler 1 thread; {report['rows']}; "
             f"{report['note']}",
             f"{'guide':>12} {'B':>4} {'fill':>8} {'fill cpu':>8} {'apply':>8} {'consume':>8} "
             f"{'sample':>8} {'plain':>8} {'overhead':>8} {'restarts':>8}"]
    for r in report["results"]:
        ms = r["ms_per_step"]
        lines.append(f"{r['guide']:>12} {r['batch']:>4} {ms['fill']:>8.3f} {ms['fill_cpu']:>8.3f} "
                     f"{ms['apply']:>8.3f} {ms['consume']:>8.3f} {ms['sample']:>8.3f} "
                     f"{ms['plain']:>8.3f} {r['overhead']:>8.2f} {r['restarts']:>8}")
    if report["loops"]:
        lines += [f"the decode loop, json_schema against unguided: {report['loops'][0]['guided']['label']}",
                  f"{'B':>4} {'requests':>8} {'guided tok/s':>12} {'ms/step':>8} {'plain tok/s':>11} "
                  f"{'ms/step':>8} {'guided/plain':>12}"]
        for loop in report["loops"]:
            guided, plain = loop["guided"], loop["plain"]
            lines.append(f"{loop['batch']:>4} {loop['requests']:>8} {guided['tokens_per_s']:>12.1f} "
                         f"{guided['ms_per_step']:>8.2f} {plain['tokens_per_s']:>11.1f} "
                         f"{plain['ms_per_step']:>8.2f} {loop['ratio']:>12.3f}")
    return "\n".join(lines)
