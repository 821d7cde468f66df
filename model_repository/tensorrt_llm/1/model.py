"""TensorRT-LLM's core model's names and shapes over the llm model (decoupled).

Each request is renamed, sent to llm through BLS on a thread of its own and
its responses given back in that model's shapes (simple_sampler.triton.trtllm_core).
"""
import logging
import threading

import triton_python_backend_utils as pb_utils

from simple_sampler import heap, logs
from simple_sampler.schema import InvalidRequest
from simple_sampler.triton.trtllm_core import (INPUT_NAMES, LLM_OUTPUTS, core_outputs,
                                               llm_inputs, prompts_of)

log = logging.getLogger("simple_sampler.tensorrt_llm")
FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL


def flag(inputs, name):
    value = inputs.get(name)
    return value is not None and bool(value.reshape(-1)[0])


class TritonPythonModel:
    def initialize(self, args):
        logs.configure()
        self.instance = args["model_instance_name"]
        log.info("%s ready: TensorRT-LLM's core model's interface over llm", self.instance)
        heap.freeze(self.instance)

    def execute(self, requests):
        for request in requests:
            inputs = {name: tensor.as_numpy() for name in INPUT_NAMES
                      if (tensor := pb_utils.get_input_tensor_by_name(request, name)) is not None}
            sender = request.get_response_sender()
            try:
                renamed, prompts = llm_inputs(inputs), prompts_of(inputs)
            except InvalidRequest as error:
                sender.send(pb_utils.InferenceResponse(error=pb_utils.TritonError(
                    str(error), pb_utils.TritonError.INVALID_ARG)), flags=FINAL)
                continue
            whole = not flag(inputs, "streaming") and not flag(inputs, "exclude_input_in_output")
            threading.Thread(target=self._relay, name="tensorrt_llm-relay", daemon=True,
                             args=(request, sender, renamed, prompts, whole,
                                   flag(inputs, "return_log_probs"))).start()
        return None

    def _relay(self, request, sender, renamed, prompts, whole, log_probs):
        """llm's responses to one request, in this model's shapes, then the
        final flag; an error response of llm's goes as it is."""
        try:
            responses = pb_utils.InferenceRequest(
                model_name="llm", requested_output_names=list(LLM_OUTPUTS),
                inputs=[pb_utils.Tensor(name, value) for name, value in renamed.items()]
            ).exec(decoupled=True)
            for response in responses:
                if response.has_error():
                    sender.send(pb_utils.InferenceResponse(error=response.error()))
                    continue
                outputs = {name: tensor.as_numpy() for name in LLM_OUTPUTS
                           if (tensor := pb_utils.get_output_tensor_by_name(response, name))
                           is not None}
                if "output_ids" in outputs:  # not llm's final flag alone
                    sender.send(pb_utils.InferenceResponse(output_tensors=[
                        pb_utils.Tensor(name, value) for name, value in
                        core_outputs(outputs, prompts, whole, log_probs).items()]))
                if request.is_cancelled() and hasattr(responses, "cancel"):
                    responses.cancel()  # llm ends it at its next step
        except Exception as error:  # noqa: BLE001 - ours: logged, the request still ends
            log.exception("relaying llm's responses failed")
            try:
                sender.send(pb_utils.InferenceResponse(error=pb_utils.TritonError(
                    f"{type(error).__name__}: {error}", pb_utils.TritonError.INTERNAL)))
            except Exception:  # noqa: BLE001 - the client has gone
                log.debug("the error response was refused", exc_info=True)
        try:
            sender.send(flags=FINAL)
        except Exception:  # noqa: BLE001 - the client has gone
            log.debug("the final flag was refused", exc_info=True)

    def finalize(self):
        log.info("%s unloaded", self.instance)
