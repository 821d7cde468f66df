"""The llm model's metrics (triton.llm_metrics), through a stand-in for the
Python backend's metric API: its own counters and gauges, and TensorRT-LLM's
gauges under that backend's family names and labels; only changes sent (each
is a round trip to the server process)."""
from simple_sampler.triton.llm_metrics import COUNTERS, LlmMetrics

LABELS = {"model": "llm", "version": "1"}


class Backend:
    """pb_utils' MetricFamily and Metric, recording every message sent."""

    sent: list = []

    class MetricFamily:
        COUNTER, GAUGE, HISTOGRAM = "counter", "gauge", "histogram"

        def __init__(self, name, description, kind):
            self.name, self.kind = name, kind

        def Metric(self, labels, buckets=None):  # noqa: N802 - pb_utils' name
            assert (buckets is not None) == (self.kind == "histogram")
            return Backend.Metric(self.name, labels)

    class Metric:
        def __init__(self, family, labels):
            self.key = (family, tuple(sorted(labels.items())))

        def observe(self, value):
            Backend.sent.append(("observe", self.key, value))

        def increment(self, value):
            Backend.sent.append(("increment", self.key, value))

        def set(self, value):
            Backend.sent.append(("set", self.key, value))


def key(family, **labels):
    return family, tuple(sorted({**LABELS, **labels}.items()))


def totals(**given):
    return {**dict.fromkeys(COUNTERS, 0), **given}


def test_tensorrt_llms_gauges_and_the_counters_report_changes_only():
    Backend.sent = []
    metrics = LlmMetrics(Backend, LABELS, max_requests=32)
    request = "nv_trt_llm_request_metrics"
    assert Backend.sent == [("set", key(request, request_type="max"), 32)]
    Backend.sent = []
    metrics.report(totals(steps=5, data_plane_us=700), active=3)
    assert sorted(Backend.sent) == sorted([
        ("increment", key("simple_llm_steps_total"), 5),
        ("increment", key("simple_llm_data_plane_us_total"), 700),
        ("set", key(request, request_type="active"), 3),
        ("set", key(request, request_type="scheduled"), 3),
        ("set", key("nv_trt_llm_general_metrics", general_type="iteration_counter"), 5)])
    Backend.sent = []
    metrics.report(totals(steps=5, data_plane_us=700), active=3)
    assert Backend.sent == []  # nothing changed: no message
    metrics.report(totals(steps=7, data_plane_us=700), active=0)
    assert sorted(Backend.sent) == sorted([
        ("increment", key("simple_llm_steps_total"), 2),
        ("set", key(request, request_type="active"), 0),
        ("set", key(request, request_type="scheduled"), 0),
        ("set", key("nv_trt_llm_general_metrics", general_type="iteration_counter"), 7)])


def test_each_generations_lengths_go_to_tensorrt_llms_histograms():
    """nv_llm_input_token_len / nv_llm_output_token_len, labelled by its
    response_metric_type, one observation each per generation."""
    metrics = LlmMetrics(Backend, LABELS, max_requests=8)
    Backend.sent = []
    metrics.observe_lengths(12, 40)
    assert Backend.sent == [
        ("observe", key("nv_llm_input_token_len", response_metric_type="total_input_tokens"), 12),
        ("observe", key("nv_llm_output_token_len", response_metric_type="total_output_tokens"),
         40)]
