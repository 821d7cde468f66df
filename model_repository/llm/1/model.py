"""The decode loop (decoupled unless decoupled_mode is false): prompt ids in, text and tokens out.

A thin adapter over ``simple_sampler.triton.llm_service``: the data plane
(PyTorch engine) runs in this process; in ``simple`` mode each step's rows are
sampled by the ``simple_sampler`` model's instances through BLS calls.
"""
import functools
import json
import logging
import os
import threading
import time

import ml_dtypes
import numpy as np
import torch
import triton_python_backend_utils as pb_utils

from simple_sampler.triton.counters import REPORT_INTERVAL_S
from simple_sampler.triton.byte_tensors import install_byte_serializer
from simple_sampler.triton.generate_io import INPUT_NAMES
from simple_sampler import heap, logs
from simple_sampler.stacks import StackSampler
from simple_sampler.schema import SAMPLER
from simple_sampler.settings import LlmSettings
from simple_sampler.schema import InvalidRequest
from simple_sampler.triton.llm_delivery import Cancelled, Unavailable
from simple_sampler.triton.llm_metrics import LlmMetrics
from simple_sampler.triton.llm_service import LlmService
from simple_sampler.serving.samplers import names_a_row
from simple_sampler.triton.sampler_targets import SamplerCallError

log = logging.getLogger("simple_sampler.llm")
#: The sampler's outputs: the token, its logprob and top logprobs when a row
#: asked, and for compact rows the handoff outcome.
SAMPLER_OUTPUTS = list(SAMPLER.output_names)


def bls_input(name, value):
    """A BLS input; numpy has no bfloat16, so those rows go through DLPack."""
    if value.dtype == ml_dtypes.bfloat16:
        return pb_utils.Tensor.from_dlpack(name, torch.from_numpy(value.view(np.int16))
                                           .view(torch.bfloat16))
    return pb_utils.Tensor(name, value)


def call_sampler(model_name):
    def call(arrays):
        request = pb_utils.InferenceRequest(
            model_name=model_name, requested_output_names=SAMPLER_OUTPUTS,
            inputs=[bls_input(name, value) for name, value in arrays.items()])
        try:
            response = request.exec()
        except Exception as error:  # noqa: BLE001 - a transport failure: worth another try
            raise SamplerCallError(f"{model_name}: {error}") from error
        if response.has_error():
            error = response.error()
            # INVALID_ARG: the sampler refused these rows, and would again. A
            # BLS response's error comes back INTERNAL whatever its code in
            # Triton 2.51 (triton-inference-server/server issue 7804), so a
            # refusal is also known by its message, which names the row.
            refused = (getattr(error, "code", lambda: None)() == pb_utils.TritonError.INVALID_ARG
                       or names_a_row(error.message()))
            raise SamplerCallError(f"{model_name}: {error.message()}", retryable=not refused)
        outputs = {}
        for name in SAMPLER_OUTPUTS:  # the logprobs only when a row asked
            tensor = pb_utils.get_output_tensor_by_name(response, name)
            if tensor is not None:
                outputs[name] = tensor.as_numpy()
        return outputs
    return call


def send_tokens(response_sender, batched, text_output, output_ids):
    """``llm_delivery.SendTokens``: a stream's token, its two tensors straight
    from the service's step arrays ([1, 1] and [1, n]); sent by the service.
    text_output goes as [1] (``_shaped``); output_ids keeps the batch
    dimension where the model has one."""
    return functools.partial(response_sender.send, pb_utils.InferenceResponse(
        output_tensors=[pb_utils.Tensor("text_output", text_output[0]),
                        pb_utils.Tensor("output_ids", output_ids if batched else output_ids[0])]))


def error_code(error):
    """Client mistakes are INVALID_ARG (HTTP 400); a server going away is
    UNAVAILABLE (503); a request its client cancelled, CANCELLED; everything
    else failed on our side: INTERNAL (500)."""
    if isinstance(error, InvalidRequest):
        return pb_utils.TritonError.INVALID_ARG
    if isinstance(error, Unavailable):
        return pb_utils.TritonError.UNAVAILABLE
    if isinstance(error, Cancelled):
        return pb_utils.TritonError.CANCELLED
    return pb_utils.TritonError.INTERNAL


class TritonPythonModel:
    def initialize(self, args):
        logs.configure()
        install_byte_serializer(pb_utils)  # text_output per token: byte_tensors says why
        config = json.loads(args["model_config"])
        settings = LlmSettings.from_config(config)
        labels = {"model": args["model_name"], "version": args["model_version"]}
        self.metrics = LlmMetrics(pb_utils, labels, settings.engine_max_batch_size)
        self.service = LlmService(settings, call_sampler(settings.sampler_model)
                                  if settings.sampling_mode == "simple" else None,
                                  repository=os.path.dirname(args["model_repository"]),
                                  on_burst=self._report_if_due,
                                  on_finished=lambda event: self.metrics.observe_lengths(
                                      event.num_input_tokens, event.num_output_tokens))
        if not self.service.drain_on_sigterm():
            log.warning("initialize() is not on the stub's main thread: SIGTERM will not "
                        "drain requests")
        # max_batch_size 0 (Triton's vLLM backend's shapes): outputs without
        # the batch dimension
        self.batched = config.get("max_batch_size", 0) > 0
        self.instance = args["model_instance_name"]
        log.info("%s ready: max_batch_size %s, parameters %s; data plane: %s", self.instance,
                 config.get("max_batch_size"), settings.parameters(), self.service.data_plane)
        self.report_lock = threading.Lock()
        self.next_report = 0.0
        self.reported_in_flight = 0
        heap.freeze(self.instance)  # last: the model, its tokenizer and the service stay
        self.gc_pauses = heap.PauseClock().install()  # what collections cost from here on
        self.stacks = StackSampler.from_env(f"llm-{os.getpid()}")  # $SIMPLE_SAMPLER_STACKS_DIR

    def execute(self, requests):
        for request in requests:
            inputs = {}
            for name in INPUT_NAMES:
                tensor = pb_utils.get_input_tensor_by_name(request, name)
                if tensor is not None:
                    inputs[name] = tensor.as_numpy()
            sender = request.get_response_sender()
            self.service.submit(inputs, self._sender(sender), request.is_cancelled,
                                on_done=self._request_done, on_admitted=self._request_admitted,
                                send_tokens=functools.partial(send_tokens, sender,
                                                              self.batched),
                                parameters=request.parameters(),
                                request_id=request.request_id())
        return None

    def _sender(self, response_sender):
        def send(outputs, error, final):
            """Builds the response; the service sends it (``llm_delivery.Send``)."""
            if outputs is None and error is None:  # the final flag alone
                response = None
            elif error is not None:
                response = pb_utils.InferenceResponse(
                    error=pb_utils.TritonError(str(error), error_code(error)))
            else:
                response = pb_utils.InferenceResponse(output_tensors=[
                    pb_utils.Tensor(name, self._shaped(name, value))
                    for name, value in outputs.items()])
            # A partial, not a Python function: the service calls it per response.
            # It raises if the client has gone.
            return functools.partial(response_sender.send, response,
                                     flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
                                     if final else 0)
        return send

    def _shaped(self, name, value):
        """An output as a client reads it: with the batch dimension where the
        model has one, but text_output, [1] whatever the model, flattened
        over the batch and the beams as TensorRT-LLM's postprocessing writes
        it (its clients read ``as_numpy("text_output")[0].decode()``)."""
        return value[None] if self.batched and name != "text_output" else value

    def _report_if_due(self):
        """After each burst of responses: once per report interval, not per send."""
        if time.monotonic() >= self.next_report:
            self._report_stats()

    def _request_admitted(self):
        # The gauge must not read 0 while a request is held: `serve` stops
        # Triton once it reads 0 after the drain (launch.server.drain).
        if self.reported_in_flight == 0:
            self._report_stats()

    def _request_done(self):
        # B requests often end in the same step: one report for them, unless
        # the last one ended (the drain waits for the in-flight gauge's 0).
        if self.service.decoder.num_in_flight == 0 or time.monotonic() >= self.next_report:
            self._report_stats()

    def _report_stats(self):
        """Every metric update is a message to the server process: done at
        most every REPORT_INTERVAL_S while requests stream, and when the
        last request in flight ends."""
        with self.report_lock:
            self.next_report = time.monotonic() + REPORT_INTERVAL_S
            self._report_stats_locked()

    def _report_stats_locked(self):
        self.reported_in_flight = self.service.decoder.num_in_flight
        self.metrics.in_flight.set(self.reported_in_flight)
        stats = self.service.stats()
        self.metrics.report({
            "data_plane_us": int(stats.data_plane_s * 1e6),
            "sampler_us": int(stats.sampler_s * 1e6),
            "sampling_exposed_us": int(stats.sampling_exposed_s * 1e6),
            "busy_us": int(stats.busy_s * 1e6), "loop_us": int(stats.loop_s * 1e6),
            "forward_wait_us": int(stats.forward_wait_s * 1e6), "steps": stats.steps,
            "sampler_retries": stats.sampler_retries,
            "bridge_us": int(self.service.bridge_s * 1e6),
            "gc_pause_us": int(self.gc_pauses.seconds * 1e6)}, self.service.decoder.num_active)

    def finalize(self):
        # What tells a finalize under way from a model a client's open stream
        # holds, which is never finalized (launch/processes.StubsUnloading).
        self.metrics.closing.set(1)
        self.service.close()
        if self.stacks is not None:
            log.info("%s: its threads' stacks in %s", self.instance, self.stacks.stop())
        log.info("%s unloaded", self.instance)
