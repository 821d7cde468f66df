"""SIMPLE for Triton: exact, batch-invariant, linear-time LLM sampling.

    from simple_sampler import SamplingParams, History, sample_requests
    out = sample_requests(logits, [SamplingParams(temperature=0.7, top_p=0.9, seed=1)])
"""
from .params import GREEDY_TEMPERATURE, History, SamplingBatch, SamplingParams
from .sampling import MAX_TOP_LOGPROBS, SampleOutput, sample, sample_requests

__all__ = [
    "GREEDY_TEMPERATURE", "History", "MAX_TOP_LOGPROBS", "SampleOutput", "SamplingBatch",
    "SamplingParams", "sample", "sample_requests",
]
