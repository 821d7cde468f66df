"""TensorRT-LLM's postprocessing interface: its tensorrt_llm model's output_ids
and sequence_length to each sequence's text (triton.trtllm_text.postprocess)."""
import json
import logging

import triton_python_backend_utils as pb_utils

from simple_sampler import heap, logs
from simple_sampler.schema import InvalidRequest
from simple_sampler.serving.text import TextCodec
from simple_sampler.triton.trtllm_text import postprocess, skip_special_tokens

log = logging.getLogger("simple_sampler.postprocessing")


class TritonPythonModel:
    def initialize(self, args):
        logs.configure()
        parameters = json.loads(args["model_config"]).get("parameters", {})
        self.codec = TextCodec.from_source(parameters["model"]["string_value"] or None)
        self.skip_special = skip_special_tokens(
            parameters.get("skip_special_tokens", {}).get("string_value"))
        self.instance = args["model_instance_name"]
        log.info("%s ready", self.instance)
        heap.freeze(self.instance)

    def execute(self, requests):
        responses = []
        for request in requests:
            try:
                text = postprocess(
                    self.codec, pb_utils.get_input_tensor_by_name(request, "TOKENS_BATCH").as_numpy(),
                    pb_utils.get_input_tensor_by_name(request, "SEQUENCE_LENGTH").as_numpy(),
                    self.skip_special)
                responses.append(pb_utils.InferenceResponse(
                    output_tensors=[pb_utils.Tensor("OUTPUT", text)]))
            except InvalidRequest as error:
                responses.append(pb_utils.InferenceResponse(
                    error=pb_utils.TritonError(str(error), pb_utils.TritonError.INVALID_ARG)))
            except Exception as error:  # noqa: BLE001 - ours: log it, answer, serve the rest
                log.exception("decoding a request failed")
                responses.append(pb_utils.InferenceResponse(error=pb_utils.TritonError(
                    f"{type(error).__name__}: {error}", pb_utils.TritonError.INTERNAL)))
        return responses

    def finalize(self):
        log.info("%s unloaded", self.instance)
