"""Triton's floor for streaming tokens: a decoupled Python model that does no
work and streams one token per request per step.

`simple-sampler bench serve-cost` copies this directory into the temporary
repository of each server it starts, beside the project's models, and drives
it with the same client as the llm model, so that every figure of the llm
model has its ratio to what Triton and the Python backend cost by themselves.
It is not part of the served repository (model_repository/).

A step: sleep a + b * n ms (the same pace as the simulated engine's, the
``step_a_ms`` / ``step_b_ms`` parameters), then one response per active
request holding one token, the last one flagged final. The responses go out
from a second thread while the next step sleeps, at most one step behind (as
the llm model sends a step's responses during the next forward): at GPU
pace the floor's throughput is then the step's, not the step's plus B sends.

Two response shapes, by request: a request of ``max_tokens`` alone gets one
INT32 output (``output_ids``), the least Triton can carry; a request that
sends the llm model's inputs (``text_input`` among them: the bench's
``floor-llm`` route) gets what the llm model sends a stream with
``stream_interval`` 1 (``generate_outputs.encode_event``): ``text_output`` (BYTES)
and ``output_ids`` per token, and all eight outputs on the last response.
The difference between the two is Triton's cost of our response shape,
without any of our own work.
"""
import json
import queue
import threading
import time

import numpy as np
import triton_python_backend_utils as pb_utils

#: The llm model's inputs the floor-llm route sends (read, as the llm model
#: reads them, then ignored).
LLM_INPUTS = ("text_input", "min_length", "stream", "random_seed", "stream_interval")


class TritonPythonModel:
    def initialize(self, args):
        parameters = json.loads(args["model_config"]).get("parameters", {})
        self.step_a_s = float(parameters["step_a_ms"]["string_value"]) / 1e3
        self.step_b_s = float(parameters["step_b_ms"]["string_value"]) / 1e3
        self.lock = threading.Lock()
        self.wake = threading.Event()
        self.arrived: list[list] = []
        self.running = True
        #: a step's responses, sent by the sender thread; one step may wait
        self.steps: queue.Queue = queue.Queue(maxsize=1)
        self.sender = threading.Thread(target=self._send_steps, name="floor-send", daemon=True)
        self.sender.start()
        self.thread = threading.Thread(target=self._loop, name="floor-loop", daemon=True)
        self.thread.start()

    def execute(self, requests):
        with self.lock:
            for request in requests:
                max_tokens = pb_utils.get_input_tensor_by_name(request, "max_tokens")
                llm_inputs = [pb_utils.get_input_tensor_by_name(request, name)
                              for name in LLM_INPUTS]
                llm_shape = llm_inputs[0] is not None
                for tensor in llm_inputs:
                    if tensor is not None:
                        tensor.as_numpy()
                self.arrived.append([request.get_response_sender(),
                                     int(max_tokens.as_numpy().reshape(-1)[0]), llm_shape])
        self.wake.set()
        return None

    def _loop(self):
        active, step = [], 0
        while self.running:
            with self.lock:
                active, self.arrived = active + self.arrived, []
            if not active:
                self.wake.wait(0.1)
                self.wake.clear()
                continue
            time.sleep(self.step_a_s + self.step_b_s * len(active))
            sends = []
            for entry in active:
                entry[1] -= 1
                sends.append((entry[0], entry[2], not entry[1]))
            self.steps.put((step, sends))
            step += 1
            active = [entry for entry in active if entry[1]]

    def _send_steps(self):
        while True:
            item = self.steps.get()
            if item is None:
                return
            step, sends = item
            token = np.array([[step]], np.int32)
            text = np.array([f" t{step}".encode()], object)  # [1], as the llm model's
            for sender, llm_shape, final in sends:
                outputs = [pb_utils.Tensor("output_ids", token)]
                if llm_shape:
                    outputs.append(pb_utils.Tensor("text_output", text))
                    if final:
                        outputs += last_outputs()
                sender.send(pb_utils.InferenceResponse(outputs),
                            flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL if final else 0)

    def finalize(self):
        self.running = False
        self.wake.set()
        self.thread.join()
        self.steps.put(None)
        self.sender.join()


def last_outputs():
    """The outputs only a stream's last response carries (values immaterial)."""
    return [pb_utils.Tensor("output_log_probs", np.zeros((1, 1, 1), np.float32)),
            pb_utils.Tensor("cum_log_probs", np.zeros((1, 1), np.float32)),
            pb_utils.Tensor("num_input_tokens", np.ones((1, 1), np.int32)),
            pb_utils.Tensor("num_output_tokens", np.ones((1, 1), np.int32)),
            pb_utils.Tensor("finish_reason", np.array([[b"length"]], object)),
            pb_utils.Tensor("stop_reason", np.array([[b"null"]], object))]
