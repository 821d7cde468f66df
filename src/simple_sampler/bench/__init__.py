"""Benchmarks behind `simple-sampler bench ...`: figures measured side by side in one run."""
