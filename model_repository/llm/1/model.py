"""The decode loop (decoupled): prompt ids in, streamed text and tokens out.

A thin adapter over ``simple_sampler.triton.llm_service``: the data plane
(PyTorch engine) runs in this process; in ``simple`` mode each step's rows are
sampled by the ``simple_sampler`` model's instances through BLS calls.
"""
import json
import threading

import numpy as np
import triton_python_backend_utils as pb_utils

from simple_sampler.triton.generate_io import INPUT_NAMES
from simple_sampler.triton.llm_service import LlmService, LlmSettings

SAMPLER_OUTPUTS = ["output_ids", "output_log_probs"]


def call_sampler(model_name):
    def call(arrays):
        request = pb_utils.InferenceRequest(
            model_name=model_name, requested_output_names=SAMPLER_OUTPUTS,
            inputs=[pb_utils.Tensor(name, value) for name, value in arrays.items()])
        response = request.exec()
        if response.has_error():
            raise RuntimeError(f"{model_name}: {response.error().message()}")
        outputs = {}
        for name in SAMPLER_OUTPUTS:  # output_log_probs only when a row asked
            tensor = pb_utils.get_output_tensor_by_name(response, name)
            if tensor is not None:
                outputs[name] = tensor.as_numpy()
        return outputs
    return call


class TritonPythonModel:
    def initialize(self, args):
        config = json.loads(args["model_config"])
        parameters = {k: v["string_value"] for k, v in config.get("parameters", {}).items()}
        sampler_model = parameters.pop("sampler_model", "simple_sampler")
        settings = LlmSettings.from_parameters(parameters)
        self.service = LlmService(settings, call_sampler(sampler_model)
                                  if settings.sampling_mode == "simple" else None)
        labels = {"model": args["model_name"], "version": args["model_version"]}
        self.metric_families, self.metrics = [], {}
        for name, text in (("data_plane_us", "Data-plane forward time"),
                           ("sampler_us", "Sampler time, overlapped or not"),
                           ("sampling_exposed_us", "Sampling time with no forward running"),
                           ("busy_us", "Time a forward or a sampler was running")):
            family = pb_utils.MetricFamily(name=f"simple_llm_{name}_total", description=text,
                                           kind=pb_utils.MetricFamily.COUNTER)
            self.metric_families.append(family)
            self.metrics[name] = family.Metric(labels=labels)
        family = pb_utils.MetricFamily(name="simple_llm_requests_in_flight",
                                       description="Requests decoding or queued",
                                       kind=pb_utils.MetricFamily.GAUGE)
        self.metric_families.append(family)
        self.in_flight = family.Metric(labels=labels)
        self.reported = {name: 0 for name in self.metrics}
        self.report_lock = threading.Lock()

    def execute(self, requests):
        for request in requests:
            inputs = {}
            for name in INPUT_NAMES:
                tensor = pb_utils.get_input_tensor_by_name(request, name)
                if tensor is not None:
                    inputs[name] = tensor.as_numpy()
            self.service.submit(inputs, self._sender(request.get_response_sender()),
                                request.is_cancelled, on_done=self._report_stats)
        return None

    def _sender(self, response_sender):
        def send(outputs, error, final):
            if error is not None:
                code = (pb_utils.TritonError.INVALID_ARG if isinstance(error, ValueError)
                        else pb_utils.TritonError.INTERNAL)
                response = pb_utils.InferenceResponse(error=pb_utils.TritonError(str(error), code))
            else:
                response = pb_utils.InferenceResponse(output_tensors=[
                    pb_utils.Tensor(name, np.expand_dims(value, 0)) for name, value in outputs.items()])
            flags = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL if final else 0
            response_sender.send(response, flags=flags)  # raises if the client has gone
            self._report_stats()
        return send

    def _report_stats(self):
        with self.report_lock:
            self._report_stats_locked()

    def _report_stats_locked(self):
        self.in_flight.set(self.service.decoder.num_active + self.service.decoder.num_queued)
        stats = self.service.stats()
        totals = {"data_plane_us": stats.data_plane_s, "sampler_us": stats.sampler_s,
                  "sampling_exposed_us": stats.sampling_exposed_s, "busy_us": stats.busy_s}
        for name, seconds in totals.items():
            micros = int(seconds * 1e6)
            self.metrics[name].increment(micros - self.reported[name])
            self.reported[name] = micros

    def finalize(self):
        self.service.close()
