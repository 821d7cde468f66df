"""One shape's part of scripts/gpu_bench.sh: `bench serve-gpu` in-process on
the static engine, run in parts, each part's report merged and written (JSON
and Markdown) as it ends, so that a phase cut off by its time limit keeps what
it ran.

    python scripts/gpu_bench_shape.py PHASE SHAPE OUT_DIR   # DEVICE=cuda|cpu

PHASE ``compiled``: forward_only on the eager, then the compiled decode step
(``--decode-step eager compiled``), B 64 then 256 -> serve-gpu-compiled-SHAPE.
PHASE ``served``: the modes at B 64 and 256 per (rows, top_p), forward_only
with the first -> serve-gpu-SHAPE (simple, simple_hot_first and, on fitted
rows, simple_overlap only where the kernels import).
PHASE ``serial``: fitted rows, top_p 1, B 64 and 256, every mode but
simple_overlap with ``launch_ahead`` off (the served phase's auto is on, on a
GPU) -> serve-gpu-serial-SHAPE: what launching ahead gives each mode.
"""
import json
import os
import sys

from simple_sampler.bench.serve_gpu import measuring as serve_gpu

BATCHES = (64, 256)


def parts(phase: str) -> tuple[str, str, list[dict]]:
    """(file name stem, title, run()'s arguments per part) of a phase."""
    if phase == "serial":
        return ("serve-gpu-serial-{shape}",
                "--model-config {shape} --rows fitted --top-p 1 --launch-ahead off",
                [{"modes": modes(kernel_modes(), overlap=False), "batches": BATCHES,
                  "instances": 8,
                  "top_p": (1.0,), "rows": ("fitted",), "forward_only": False,
                  "launch_ahead": "off"}])
    if phase == "compiled":
        return ("serve-gpu-compiled-{shape}",
                "--model-config {shape} --decode-step eager compiled (forward_only)",
                [{"modes": (), "batches": (batch,), "decode_steps": (step,)}
                 for step in ("eager", "compiled") for batch in BATCHES])
    cells = [(rows, top_p) for rows in ("flat", "fitted") for top_p in (1.0, 0.95)]
    return ("serve-gpu-{shape}", "--model-config {shape}",
            [{"modes": modes(kernel_modes(), overlap=rows == "fitted"), "batches": BATCHES,
              "instances": 8,
              "top_p": (top_p,), "rows": (rows,), "forward_only": index == 0}
             for index, (rows, top_p) in enumerate(cells)])


def kernel_modes() -> tuple[str, ...]:
    """The modes that can run here: the simple ones only where the kernels import."""
    try:
        import simple_sampler._sampling  # noqa: F401
        return ("simple", "simple_hot_first", "gpu_inline")
    except ImportError:
        return ("gpu_inline",)


def modes(wanted: tuple[str, ...], overlap: bool) -> list[tuple]:
    """serve-gpu's modes by name; with `overlap` also simple_overlap (two
    lanes, each its own window of the static engine's slots), where the
    kernels import."""
    if overlap and "simple" in wanted:
        wanted += ("simple_overlap",)
    return [m for m in serve_gpu.MODES if m[0] in wanted]


def main(phase: str, shape: str, out: str) -> None:
    stem, title, arguments = parts(phase)
    stem, title = stem.format(shape=shape), title.format(shape=shape)
    device_name = os.environ["DEVICE"]
    dtype_name = "bfloat16" if device_name == "cuda" else "float32"
    device, dtype = serve_gpu.resolve(device_name, dtype_name)
    loaded = serve_gpu.load(None, shape, False, device, dtype)
    merged, steps = None, []
    for part_arguments in arguments:
        failed = (merged or {}).get("errors", {})
        if any(step in failed for step in part_arguments.get("decode_steps", ())):
            continue  # that decode step failed in an earlier part: not compiled again
        part = serve_gpu.run(model_config=shape, dtype=dtype_name, device=device_name,
                             warmup=4, measure=16, loaded=loaded, **part_arguments)
        if merged is None:
            merged = part
        else:
            merged["results"] = serve_gpu.add_ratios(merged["results"] + part["results"])
            merged["errors"].update(part["errors"])
        steps += [s for s in part["settings"]["decode_steps"] if s not in steps]
        merged["settings"]["decode_steps"] = steps
        with open(f"{out}/{stem}.json", "w") as f:
            json.dump(merged, f, indent=1)
        with open(f"{out}/{stem}.md", "w") as f:
            f.write(f"# bench serve-gpu {title}\n\n```\n{serve_gpu.format_report(merged)}\n```\n")
        print(serve_gpu.format_report(merged), flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:4])
