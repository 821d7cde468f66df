"""Triton Python-based backend `simple_sampler`: logits in, tokens out.

A thin adapter: tensors are decoded, checked and sampled by
``simple_sampler.triton.sampler_serve.serve_request`` (tested without a
server) and the Cython kernels. Each model instance is its own process; the sampler keeps
no state between requests (draws are keyed by seed and step), so any
instance can serve any row.
"""
import json
import logging
import os
import time

import triton_python_backend_utils as pb_utils

from simple_sampler.row_reader import RowReader
from simple_sampler.sampling import dlpack_array
from simple_sampler.settings import SamplerSettings
from simple_sampler.shvs.hot_vocab import HotVocabMonitor, load_profile, untruncated_rows
from simple_sampler import heap, logs
from simple_sampler.schema import InvalidRequest
from simple_sampler.triton.counters import BatchedCounters
from simple_sampler.triton.sampler_serve import serve_request
from simple_sampler.triton.stub_profile import StubProfile

log = logging.getLogger("simple_sampler.backend")


class TritonPythonModel:
    def initialize(self, args):
        logs.configure()
        config = json.loads(args["model_config"])
        settings = SamplerSettings.from_parameters(
            {k: v["string_value"] for k, v in config.get("parameters", {}).items()})
        self.num_threads, self.vocab_size = settings.num_threads, settings.vocab_size
        # numpy for every dtype; BF16, which python_backend's ``as_numpy``
        # refuses (src/pb_tensor.cc, ``PbTensor::AsNumpy``), through its DLPack
        # capsule (the config's dtype decides, not a raised exception per request).
        self.bf16_inputs = frozenset(tensor["name"] for tensor in config["input"]
                                     if tensor["data_type"] == "TYPE_BF16")
        self.hot_vocab = self.monitor = None
        if settings.hot_vocab_profile:
            path = os.path.join(args["model_repository"], settings.hot_vocab_profile)
            profile = load_profile(path)
            self.hot_vocab = profile.hot_vocab()
            # Drift is only reported (logged below); the hot set never changes here.
            self.monitor = HotVocabMonitor(profile, len(self.hot_vocab.ids))
            if self.vocab_size and self.hot_vocab.vocab_size != self.vocab_size:
                raise ValueError(f"{path} is for a vocabulary of {self.hot_vocab.vocab_size} "
                                 f"tokens, the model's is {self.vocab_size}")
        labels = {"model": args["model_name"], "version": args["model_version"],
                  "instance": args["model_instance_name"]}
        # A MetricFamily must outlive its Metric objects, so both are kept.
        self.metric_families = []

        def counter(name, text):
            family = pb_utils.MetricFamily(name=name, description=text,
                                           kind=pb_utils.MetricFamily.COUNTER)
            self.metric_families.append(family)
            return family.Metric(labels=labels)

        # Sent in batches, not per request: each increment is a round trip.
        self.counters = BatchedCounters({
            "rows": counter("simple_sampler_rows_total", "Rows sampled"),
            "failed": counter("simple_sampler_failed_requests_total",
                              "Requests refused (bad input)"),
            "duration_us": counter("simple_sampler_sample_duration_us_total",
                                   "Time spent decoding and sampling, microseconds"),
            "hot_tried": counter("simple_sampler_hot_tried_rows_total",
                                 "Rows SHVS tried to decide from the hot set"),
            "hot_accepted": counter("simple_sampler_hot_accepted_rows_total",
                                    "Rows SHVS decided from the hot set alone"),
            "in_place": counter("simple_sampler_handoff_full_rows_total",
                                "Undecided compact rows decided from their full rows "
                                "(logits_ref) in the same request"),
            "history_ref": counter("simple_sampler_history_ref_rows_total",
                                   "Rows of requests that named their histories in the llm "
                                   "model's shared token histories (history_ref)"),
            "execute_cpu_us": counter("simple_sampler_execute_cpu_us_total",
                                      "CPU time of execute's thread, microseconds: decoding, "
                                      "kernels, responses (the rest of the stub's CPU is the "
                                      "Python backend's own)")})
        # The llm model's row arena, mapped on the first request that names it.
        self.reader = RowReader()
        self.instance = args["model_instance_name"]
        self.profile = StubProfile(self.instance)
        log.info("%s ready: max_batch_size %s, parameters %s, hot set %s", self.instance,
                 config.get("max_batch_size"), settings.parameters(),
                 f"of {len(self.hot_vocab.ids)} ids" if self.hot_vocab else "off")
        heap.freeze(self.instance)

    def execute(self, requests):
        started = time.thread_time()
        responses, counts = self.profile.run(self._execute, requests)
        counts["execute_cpu_us"] = int((time.thread_time() - started) * 1e6)
        self.counters.add(counts)
        return responses

    def _execute(self, requests):
        """(the responses, the counts they add)."""
        started = time.perf_counter()
        responses = []
        rows = failed = tried = accepted = in_place = named = 0
        for request in requests:
            # One pass over the request's tensors: pb_utils.get_input_tensor_by_name
            # rebuilds request.inputs() and scans it on every call (a name each).
            tensors, bf16 = request.inputs(), self.bf16_inputs
            try:
                inputs = {name: dlpack_array(tensor.to_dlpack()) if name in bf16
                          else tensor.as_numpy()
                          for tensor in tensors for name in (tensor.name(),)}
                served = serve_request(inputs, self.vocab_size, self.hot_vocab, self.reader,
                                       self.num_threads)
            except InvalidRequest as error:
                failed += 1
                responses.append(pb_utils.InferenceResponse(
                    error=pb_utils.TritonError(str(error), pb_utils.TritonError.INVALID_ARG)))
                continue
            except Exception as error:  # noqa: BLE001 - ours, not the client's: log, answer, go on
                log.exception("sampling a request with inputs %s failed",
                              ", ".join(tensor.name() for tensor in tensors))
                responses.append(pb_utils.InferenceResponse(error=pb_utils.TritonError(
                    f"{type(error).__name__}: {error}", pb_utils.TritonError.INTERNAL)))
                continue
            rows += served.rows
            in_place += served.in_place
            named += served.rows if "history_ref" in inputs else 0
            if served.batch is not None:  # else decided in C: no row was tried by SHVS
                tried_here = int((served.outcomes >= 0).sum())
                tried += tried_here
                accepted += int((served.outcomes == 1).sum())
                if self.monitor is not None and tried_here:  # it counts tried rows only
                    self.monitor.observe(served.outcomes, untruncated_rows(served.batch))
            responses.append(pb_utils.InferenceResponse(output_tensors=[
                pb_utils.Tensor(name, value) for name, value in served.outputs.items()]))
        drift = self.monitor and self.monitor.drift_warning(time.monotonic())
        if drift:
            log.warning("%s: %s", self.instance, drift)
        return responses, {"rows": rows, "failed": failed, "hot_tried": tried,
                           "hot_accepted": accepted, "in_place": in_place, "history_ref": named,
                           "duration_us": int((time.perf_counter() - started) * 1e6)}

    def finalize(self):
        self.counters.close()
        profile = self.profile.dump()
        if profile:
            log.info("%s: execute's profile (thread CPU time) in %s", self.instance, profile)
        log.info("%s unloaded", self.instance)
