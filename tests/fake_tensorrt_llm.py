"""A fake of exactly the TensorRT-LLM API surface ``serving/trtllm.py`` uses.

Written from TensorRT-LLM's documented signatures (NVIDIA/TensorRT-LLM):

* ``LLM(model, tensor_parallel_size, pipeline_parallel_size,
  batched_logits_processor, skip_tokenizer_init, max_batch_size,
  max_seq_len)``: fields of ``tensorrt_llm/llmapi/llm_args.py``; the
  processor is pickled into the executor worker (``executor/executor.py``
  ``GenerationExecutor.create`` passes it in the worker's kwargs).
* ``LLM.generate_async(inputs, sampling_params, streaming)`` returns a
  ``RequestOutput`` whose ``request_id`` is the executor's client id
  (``executor/result.py``) and whose ``abort()`` cancels the request;
  ``LLM.shutdown()``.
* ``SamplingParams``: keyword-only fields of ``tensorrt_llm/sampling_params.py``
  (``ignore_eos`` makes the end id -1, ``executor/worker.py``).
* ``BatchedLogitsProcessor.__call__(req_ids, logits, token_ids, stream_ptr,
  client_ids)`` (``sampling_params.py``), modifying the logits in place;
  called once per iteration with the requests that set
  ``apply_batched_logits_processor`` (``cpp/tensorrt_llm/batch_manager/
  logitsPostProcessor.cpp``), each row ``[beam, 1, padded vocab]`` as in
  ``examples/llm-api/llm_logits_processor.py``; the greedy sampler then takes
  the argmax.

What the fake models: in-flight batching in which every active request is in
every iteration, or with ``pipeline_parallel_size`` p, p micro-batches that
take turns (a request's micro-batch fixed at arrival, as the last pipeline
stage processes them one after another); logits that are a deterministic
function of a request's tokens; a padded vocabulary whose padding would win
an unmasked argmax. What it does not model: CUDA (tensors are on the CPU and
``stream_ptr`` is None), separate worker processes (the processor runs in a
thread of this process, after a pickle round trip), timing, KV-cache limits.
"""
from __future__ import annotations

import json
import pickle
import threading
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import List, Optional

import numpy as np
import torch

PADDING = 3  # vocabulary padding columns (tensor-parallel padding in the real engine)


@dataclass(kw_only=True)
class SamplingParams:
    end_id: Optional[int] = None
    pad_id: Optional[int] = None
    max_tokens: int = 32
    top_k: Optional[int] = None
    ignore_eos: bool = False
    detokenize: bool = True
    apply_batched_logits_processor: bool = False


def model_row(tokens: List[int], vocab_size: int) -> torch.Tensor:
    """The fake model: next-token logits as a function of the tokens alone."""
    generator = torch.Generator().manual_seed(zlib.crc32(np.asarray(tokens, np.int64).tobytes()))
    row = torch.randn(vocab_size + PADDING, generator=generator) * 3
    row[vocab_size:] = 100.0  # an unmasked greedy pick would land here
    return row


class RequestOutput:
    def __init__(self, llm: "LLM", request_id: int):
        self._llm, self.request_id = llm, request_id

    def abort(self) -> None:
        self._llm.aborted.add(self.request_id)


@dataclass(eq=False)
class _Request:
    request_id: int
    tokens: List[int]
    params: SamplingParams
    micro_batch: int
    generated: int = 0


class LLM:
    """Runs iterations in a thread while requests are active. ``model`` is a
    directory whose ``config.json`` gives ``vocab_size`` (a checkpoint's)."""

    def __init__(self, model: str, *, tensor_parallel_size: int = 1,
                 pipeline_parallel_size: int = 1, batched_logits_processor=None,
                 skip_tokenizer_init: bool = False, max_batch_size: Optional[int] = None,
                 max_seq_len: Optional[int] = None):
        self.model, self.max_batch_size, self.max_seq_len = model, max_batch_size, max_seq_len
        self.vocab_size = json.loads((Path(model) / "config.json").read_text())["vocab_size"]
        self.tensor_parallel_size, self.pipeline_parallel_size = (tensor_parallel_size,
                                                                  pipeline_parallel_size)
        self.processor = pickle.loads(pickle.dumps(batched_logits_processor))
        self.requests: list[_Request] = []
        self.aborted: set[int] = set()
        self.finished: dict[int, List[int]] = {}  # request id -> generated tokens
        self.errors: list[BaseException] = []
        self.iterations: list[list[int]] = []  # request ids per iteration
        self.choose = lambda row: int(row.argmax())  # the greedy sampler (tests may override)
        self.next_id, self.arrivals = 1, 0
        self.condition = threading.Condition()
        self.running = True
        self.thread = threading.Thread(target=self._run, name="fake-trtllm", daemon=True)
        self.thread.start()

    def generate_async(self, inputs: List[int], sampling_params: SamplingParams,
                       streaming: bool = False) -> RequestOutput:
        assert sampling_params.apply_batched_logits_processor and sampling_params.top_k == 1
        with self.condition:
            request = _Request(self.next_id, list(inputs), sampling_params,
                               self.arrivals % self.pipeline_parallel_size)
            self.next_id += 1
            self.arrivals += 1
            self.requests.append(request)
            self.condition.notify_all()
        return RequestOutput(self, request.request_id)

    def shutdown(self) -> None:
        with self.condition:
            self.running = False
            self.condition.notify_all()
        self.thread.join(timeout=10)

    def _run(self) -> None:
        turn = 0
        while True:
            with self.condition:
                self.condition.wait_for(lambda: not self.running or self.requests)
                if not self.running:
                    return
                self.requests = [r for r in self.requests if r.request_id not in self.aborted]
                batch = [r for r in self.requests
                         if r.micro_batch == turn % self.pipeline_parallel_size]
                turn += 1
            if batch:
                self._iterate(batch)

    def _iterate(self, batch: list[_Request]) -> None:
        self.iterations.append([r.request_id for r in batch])
        logits = [model_row(r.tokens, self.vocab_size).reshape(1, 1, -1) for r in batch]
        try:
            self.processor([r.request_id for r in batch], logits, [[r.tokens] for r in batch],
                           None, [r.request_id for r in batch])
        except Exception as error:  # the real executor fails the iteration's requests
            self.errors.append(error)
            with self.condition:
                self.aborted.update(r.request_id for r in batch)
            return
        with self.condition:
            for request, row in zip(batch, logits):
                token = self.choose(row.reshape(-1))
                request.tokens.append(token)
                request.generated += 1
                end_id = -1 if request.params.ignore_eos else request.params.end_id
                if token == end_id or request.generated >= request.params.max_tokens:
                    self.finished[request.request_id] = request.tokens
                    self.requests.remove(request)
