"""TensorRT-LLM's postprocessing interface: its tensorrt_llm model's output_ids
and sequence_length to each sequence's text (triton.trtllm_text.postprocess).

The tokenizer (with transformers, and torch with it) is loaded at the first
request, not at start: every server has this model, few clients call it."""
import json
import logging

import triton_python_backend_utils as pb_utils

from simple_sampler import heap, logs
from simple_sampler.schema import InvalidRequest
from simple_sampler.triton.trtllm_text import postprocess, skip_special_tokens

log = logging.getLogger("simple_sampler.postprocessing")


class TritonPythonModel:
    def initialize(self, args):
        logs.configure()
        parameters = json.loads(args["model_config"]).get("parameters", {})
        self.source = parameters["model"]["string_value"] or None
        self.codec = None
        self.skip_special = skip_special_tokens(
            parameters.get("skip_special_tokens", {}).get("string_value"))
        self.instance = args["model_instance_name"]
        log.info("%s ready (its tokenizer loads at the first request)", self.instance)
        heap.freeze(self.instance)

    def _tokenizer(self):
        if self.codec is None:  # one execute at a time: the instance's own thread
            from simple_sampler.serving.text import TextCodec

            self.codec = TextCodec.from_source(self.source)
            log.info("%s: tokenizer of %s loaded", self.instance,
                     self.source or "SmolLM2-135M-Instruct")
        return self.codec

    def execute(self, requests):
        responses = []
        for request in requests:
            try:
                tokens, lengths = (pb_utils.get_input_tensor_by_name(request, name).as_numpy()
                                   for name in ("TOKENS_BATCH", "SEQUENCE_LENGTH"))
                text = postprocess(self._tokenizer(), tokens, lengths, self.skip_special)
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
