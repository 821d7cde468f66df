"""SIMPLE for Triton: exact, batch-invariant, linear-time LLM sampling.

    from simple_sampler import SamplingParams, History, sample_requests
    out = sample_requests(logits, [SamplingParams(temperature=0.7, top_p=0.9, seed=1)])

The names below load on first use (PEP 562), so that importing a submodule
(the `simple-sampler` command's entry, console.py) does not import numpy and
the kernels first.
"""
import importlib

_EXPORTS = {
    "GREEDY_TEMPERATURE": "params", "History": "params", "SamplingBatch": "params",
    "SamplingParams": "params", "MAX_TOP_LOGPROBS": "sampling", "SampleOutput": "sampling",
    "sample": "sampling", "sample_requests": "sampling",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name):
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
    globals()[name] = value
    return value
