"""The llm model's metrics on Triton's metrics port: its counters
(``simple_llm_<name>_total``), its gauges (requests in flight, closing),
and TensorRT-LLM's request and iteration gauges under its backend's names,
for dashboards and alerts made for that backend.

TensorRT-LLM's backend reports its executor's iteration statistics as
gauges (tensorrtllm_backend, inflight_batcher_llm/src/custom_metrics_reporter/
custom_metrics_reporter.cc): ``nv_trt_llm_request_metrics`` by
``request_type`` and ``nv_trt_llm_general_metrics`` by ``general_type``.
Those whose meaning holds here are reported with the model's own labels:

* ``request_type="active"``: sequences in the engine's slots (its active
  requests; the queued ones are not, as there);
* ``"max"``: the most it holds at once (engine_max_batch_size);
* ``"scheduled"``: the sequences each step decodes, every active one here
  (no paused or chunked sequence);
* ``general_type="iteration_counter"``: decode steps so far.

Its histograms of each request's prompt and answer lengths
(``nv_llm_input_token_len`` with ``response_metric_type="total_input_tokens"``,
``nv_llm_output_token_len`` with ``"total_output_tokens"``, its buckets) are
observed per generation as it ends (``observe_lengths``): one message each.

Not reported, since nothing here measures them as there: ``"context"``
(requests in their prefill), the ``"timestamp"``, KV-cache blocks, runtime
memory, the inflight batcher's token counts.

Each update is a message to the server process (python_backend
``Metric::SendSetValueRequest``), so ``report`` sends only what changed,
and the llm model calls it at most every REPORT_INTERVAL_S.
"""
from __future__ import annotations

from typing import Mapping

#: The llm model's counters: name (``simple_llm_<name>_total``) -> description
COUNTERS = {
    "data_plane_us": "Data-plane forward time",
    "sampler_us": "Sampler time, overlapped or not",
    "sampling_exposed_us": "Sampling time with no forward running",
    "busy_us": "Time a forward or a sampler was running",
    "loop_us": "CPU time of the decode loop's own Python work, forwards and samplers excluded",
    "forward_wait_us": "Time forwards waited for the data-plane thread to start them and for "
                       "the decode loop to take their rows",
    "steps": "Decode steps (one forward each)",
    "sampler_retries": "Sampler requests sent again after a failure",
    "gc_pause_us": "Time the garbage collector's collections held this process (every thread "
                   "waits), since its heap was frozen",
    "bridge_us": "TensorRT-LLM bridge's own time per iteration, summed: staging rows, masking "
                 "them (0 for other engines)",
}
#: TensorRT-LLM's gauge families reported here: name -> (description, label key,
#: the label values reported)
TRTLLM_GAUGES = {
    "nv_trt_llm_request_metrics": ("TRT LLM request metrics", "request_type",
                                   ("active", "max", "scheduled")),
    "nv_trt_llm_general_metrics": ("General TRT LLM metrics", "general_type",
                                   ("iteration_counter",)),
}

#: TensorRT-LLM's length histograms: name -> (its response_metric_type label)
TRTLLM_LENGTHS = {"nv_llm_input_token_len": "total_input_tokens",
                  "nv_llm_output_token_len": "total_output_tokens"}
#: Their buckets, as its reporter's (custom_metrics_reporter.cc)
LENGTH_BUCKETS = [10.0, 50.0, 100.0, 500.0, 1000.0]


class LlmMetrics:
    """The llm model's metric families, declared once per instance through
    `pb_utils` (the model's module), each labelled `labels` (model, version)."""

    def __init__(self, pb_utils, labels: Mapping[str, str], max_requests: int):
        family = pb_utils.MetricFamily
        self.families = []  # kept: a family's metrics live while it does

        def declare(name: str, description: str, kind, **more):
            self.families.append(family(name=name, description=description, kind=kind))
            return self.families[-1].Metric(labels={**labels, **more})

        self.counters = {name: declare(f"simple_llm_{name}_total", text, family.COUNTER)
                         for name, text in COUNTERS.items()}
        self.in_flight = declare("simple_llm_requests_in_flight",
                                 "Requests decoding or queued (prompts being scored included)",
                                 family.GAUGE)
        self.closing = declare("simple_llm_closing", "1 while the model closes (its finalize): "
                               "serve's stop waits for it", family.GAUGE)
        self.trtllm = {}
        for name, (text, key, values) in TRTLLM_GAUGES.items():
            self.families.append(family(name=name, description=text, kind=family.GAUGE))
            for value in values:
                self.trtllm[value] = self.families[-1].Metric(labels={**labels, key: value})
        self.lengths = []
        for name, kind in TRTLLM_LENGTHS.items():
            self.families.append(family(name=name, description="TRT LLM response metrics",
                                        kind=family.HISTOGRAM))
            self.lengths.append(self.families[-1].Metric(
                labels={**labels, "response_metric_type": kind}, buckets=LENGTH_BUCKETS))
        self.reported = dict.fromkeys(self.counters, 0)
        self.gauges = {"max": max_requests}
        self.trtllm["max"].set(max_requests)

    def report(self, totals: Mapping[str, int], active: int) -> None:
        """Counters up to `totals` (name -> its running total), TensorRT-LLM's
        gauges to `active` sequences and the steps so far; only changes sent."""
        for name, total in totals.items():
            if total != self.reported[name]:
                self.counters[name].increment(total - self.reported[name])
                self.reported[name] = total
        for name, value in (("active", active), ("scheduled", active),
                            ("iteration_counter", totals["steps"])):
            if self.gauges.get(name) != value:
                self.trtllm[name].set(value)
                self.gauges[name] = value

    def observe_lengths(self, input_tokens: int, output_tokens: int) -> None:
        """A generation's prompt and answer lengths, into TensorRT-LLM's histograms."""
        for histogram, tokens in zip(self.lengths, (input_tokens, output_tokens)):
            histogram.observe(tokens)
