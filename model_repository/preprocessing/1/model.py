"""Text to token ids with the model's own tokenizer (chat template on request):
input_ids [B, L], a row per prompt, and input_lengths [B, 1] (triton.prompt_batch);
or, for a request in TensorRT-LLM's preprocessing interface (QUERY, ...), that
model's outputs (triton.trtllm_text)."""
import json
import logging

import triton_python_backend_utils as pb_utils

from simple_sampler.serving.text import TextCodec
from simple_sampler import heap, logs
from simple_sampler.schema import InvalidRequest
from simple_sampler.triton.prompt_batch import INPUT_LENGTHS, encode_prompts
from simple_sampler.triton.trtllm_text import TRTLLM_NAMES, preprocess, speaks_trtllm
from simple_sampler.triton.vllm_params import SAMPLING_PARAMETERS

log = logging.getLogger("simple_sampler.preprocessing")


class TritonPythonModel:
    def initialize(self, args):
        logs.configure()
        config = json.loads(args["model_config"])
        parameters = config.get("parameters", {})
        self.codec = TextCodec.from_source(parameters["model"]["string_value"] or None)
        # max_batch_size 0 (Triton's vLLM backend's shapes): input_ids [L], not [1, L]
        self.batched = config.get("max_batch_size", 0) > 0
        self.instance = args["model_instance_name"]
        log.info("%s ready: tokenizer of %s", self.instance,
                 parameters["model"]["string_value"] or "SmolLM2-135M-Instruct")
        heap.freeze(self.instance)

    def execute(self, requests):
        responses = []
        for request in requests:
            inputs = {tensor.name(): tensor for tensor in request.inputs()}
            try:
                if speaks_trtllm(inputs):
                    responses.append(self._trtllm_preprocess(inputs))
                    continue
                inputs = {name: inputs[name].as_numpy() for name in
                          ("text_input", "apply_chat_template", SAMPLING_PARAMETERS)
                          if name in inputs}
                ids, lengths = encode_prompts(self.codec, inputs, request.parameters())
            except InvalidRequest as error:
                responses.append(pb_utils.InferenceResponse(
                    error=pb_utils.TritonError(str(error), pb_utils.TritonError.INVALID_ARG)))
                continue
            except Exception as error:  # noqa: BLE001 - ours: log it, answer, serve the rest
                log.exception("tokenizing a request failed")
                responses.append(pb_utils.InferenceResponse(error=pb_utils.TritonError(
                    f"{type(error).__name__}: {error}", pb_utils.TritonError.INTERNAL)))
                continue
            if not self.batched:  # one prompt: [L] and [1]
                ids = ids[0]
            responses.append(pb_utils.InferenceResponse(output_tensors=[
                pb_utils.Tensor("input_ids", ids),
                pb_utils.Tensor(INPUT_LENGTHS, lengths[:, None] if self.batched else lengths)]))
        return responses

    def _trtllm_preprocess(self, inputs):
        """TensorRT-LLM's preprocessing interface: its outputs (schema.text_steps)."""
        if not self.batched:
            raise InvalidRequest("TensorRT-LLM's preprocessing interface (QUERY) needs the batch "
                                 "dimension: this server has generate_max_batch_size 0")
        outputs = preprocess(self.codec, {name: tensor.as_numpy() for name, tensor in
                                          inputs.items() if name in TRTLLM_NAMES})
        return pb_utils.InferenceResponse(output_tensors=[
            pb_utils.Tensor(name, array) for name, array in outputs.items()])

    def finalize(self):
        log.info("%s unloaded", self.instance)
