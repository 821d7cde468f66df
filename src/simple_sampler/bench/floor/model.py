"""Triton's floor for streaming tokens: a decoupled Python model that does no
work and streams one INT32 token per request per step.

`simple-sampler bench serve-cost` copies this directory into the temporary
repository of each server it starts, beside the project's models, and drives
it with the same client as the llm model, so that every figure of the llm
model has its ratio to what Triton and the Python backend cost by themselves.
It is not part of the served repository (model_repository/).

A step: sleep a + b * n ms (the same pace as the simulated engine's, the
``step_a_ms`` / ``step_b_ms`` parameters), then one response per active
request holding one token, the last one flagged final.
"""
import json
import threading
import time

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        parameters = json.loads(args["model_config"]).get("parameters", {})
        self.step_a_s = float(parameters["step_a_ms"]["string_value"]) / 1e3
        self.step_b_s = float(parameters["step_b_ms"]["string_value"]) / 1e3
        self.lock = threading.Lock()
        self.wake = threading.Event()
        self.arrived: list[list] = []
        self.running = True
        self.thread = threading.Thread(target=self._loop, name="floor-loop", daemon=True)
        self.thread.start()

    def execute(self, requests):
        with self.lock:
            for request in requests:
                max_tokens = pb_utils.get_input_tensor_by_name(request, "max_tokens")
                self.arrived.append([request.get_response_sender(),
                                     int(max_tokens.as_numpy().reshape(-1)[0])])
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
            token = np.array([[step]], np.int32)
            step += 1
            for entry in active:
                entry[1] -= 1
                entry[0].send(pb_utils.InferenceResponse([pb_utils.Tensor("output_ids", token)]),
                              flags=0 if entry[1] else pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
            active = [entry for entry in active if entry[1]]

    def finalize(self):
        self.running = False
        self.wake.set()
        self.thread.join()
