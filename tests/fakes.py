"""Fakes and helpers shared by the tests: a one-character-per-token
tokenizer, an engine whose logits follow a script (no model, no torch
forward), tiny random-weight Hugging Face models, the llm model's request
tensors and a recording client, concurrent seeded streams against a
real server, a CUDA runtime whose last error is kept per thread, and waits
and metrics for tests against a real server."""
import asyncio
import threading
import time

import numpy as np
import torch

from simple_sampler.client import GenerateClient, GenerationError

LETTERS = "abcdefghijklmnopqrstuvwxyz"
END_ID = 0
VOCAB = 1 + len(LETTERS) + 1  # end id, letters, space


class FakeTokenizer:
    """One token per character: 0 is the end of sequence, then a-z and ' '."""

    eos_token_id = END_ID
    chat_template = None
    alphabet = "\0" + LETTERS + " "

    def __call__(self, text, add_special_tokens=True):
        return {"input_ids": [self.alphabet.index(c) for c in text]}

    def decode(self, ids, skip_special_tokens=True):
        return "".join(self.alphabet[i] for i in ids if i != END_ID or not skip_special_tokens)


def next_letter(ids):
    """a -> b -> ... -> z -> a, as token ids."""
    return ids[-1] % len(LETTERS) + 1


class FakeEngine:
    """Logits peaked at `script(ids)` (10), the letter after it second (5).

    Records every step's rows, the most sequences active at once and every
    release; `delay` seconds of sleep per step stand in for the forward."""

    vocab_size = VOCAB
    label = "FakeEngine"

    def __init__(self, max_batch_size=4, max_context=64, script=next_letter, delay=0.0):
        self.max_batch_size, self.max_context = max_batch_size, max_context
        self.script, self.delay = script, delay
        self.ids, self.most_active, self.released, self.steps = {}, 0, [], []

    def add(self, seq_id, prompt_ids, max_tokens=None):
        assert len(self.ids) < self.max_batch_size
        self.ids[seq_id] = list(prompt_ids)
        self.most_active = max(self.most_active, len(self.ids))

    def step(self, seq_ids):
        time.sleep(self.delay)
        self.steps.append(list(seq_ids))
        logits = torch.full((len(seq_ids), VOCAB), -10.0)
        for row, seq_id in enumerate(seq_ids):
            target = self.script(self.ids[seq_id])
            logits[row, target] = 10.0
            logits[row, next_letter([target])] = 5.0
        return logits

    def append(self, seq_ids, token_ids):
        for seq_id, token in zip(seq_ids, token_ids):
            self.ids[seq_id].append(token)

    def release(self, seq_id):
        self.released.append(seq_id)
        del self.ids[seq_id]

    def length(self, seq_id):
        return len(self.ids[seq_id])


def tiny(family: str, dtype=torch.float32, device="cpu", vocab_size=97):
    """A tiny random-weight (seeded) Llama or Qwen2 of transformers: "llama" or "qwen2"."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    shape = dict(vocab_size=vocab_size, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    if family == "llama":  # Llama-3's scaled RoPE, as the shipped 1B and 8B configs
        model = LlamaForCausalLM(LlamaConfig(**shape, rope_theta=500000.0, rope_scaling={
            "rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 16}))
    else:  # q/k/v biases
        model = Qwen2ForCausalLM(Qwen2Config(**shape, tie_word_embeddings=True))
    return model.eval().to(device, dtype)


def reference_logits(model, ids: list[int]) -> torch.Tensor:
    """The next-token logits after `ids`: the full recompute, no cache."""
    with torch.inference_mode():
        return model(input_ids=torch.tensor([ids], device=model.device)).logits[0, -1].float()


#: the llm model's requests' max_tokens unless a test says otherwise
MAX_TOKENS = 60


def inputs(text="a", max_tokens=MAX_TOKENS, stream=True):
    """The llm model's input tensors for one request."""
    return {"text_input": np.array([[text.encode()]], dtype=object),
            "max_tokens": np.array([[max_tokens]], np.int32),
            "stream": np.array([[stream]])}


class Client:
    """Records responses; cancels (or fails, as a vanished client does) after `after`."""

    def __init__(self, after=None, fail=False):
        self.after, self.fail = after, fail
        self.responses, self.done = [], threading.Event()

    def send(self, outputs, error, final):
        if self.fail and len(self.responses) >= self.after:
            raise RuntimeError("Unable to send response: the client has gone")
        self.responses.append((outputs, error, final))

    def is_cancelled(self):
        return self.after is not None and not self.fail and len(self.responses) >= self.after



#: the prompt `Streams` sends, and sampling parameters that really sample
PROMPT = "Tell me a story about a cat."
SAMPLED = dict(temperature=0.7, top_p=0.9, apply_chat_template=True)


class Streams:
    """Concurrent seeded streams of PROMPT to a server's ensemble over gRPC;
    `started` is set once each has a token."""

    def __init__(self, url, seeds, **params):
        self.tokens = {seed: [] for seed in seeds}
        self.errors, self.ended_at = {}, {}
        self._first = threading.Semaphore(0)
        self.threads = [threading.Thread(target=self._run, args=(url, seed, params))
                        for seed in seeds]
        for thread in self.threads:
            thread.start()

    def _run(self, url, seed, params):
        first = True
        try:
            for chunk in GenerateClient(url, "grpc").stream(PROMPT, seed=seed, **params):
                self.tokens[seed] += chunk.token_ids
                if first:
                    first = False
                    self._first.release()
        except GenerationError as error:
            self.errors[seed] = str(error)
        finally:
            self.ended_at[seed] = time.monotonic()
            if first:
                self._first.release()

    def wait_started(self, timeout=120):
        for _ in self.threads:
            assert self._first.acquire(timeout=timeout), "a stream produced no token"
        assert not self.errors, self.errors

    def join(self, timeout=300):
        for thread in self.threads:
            thread.join(timeout)
        assert not any(thread.is_alive() for thread in self.threads), "a client hangs"
        return self


class PerThreadCudart:
    """``torch.cuda.cudart()`` as far as ``serving.device.page_lock`` and
    ``page_unlock`` use it (with ``set_device`` for ``torch.cuda.set_device``), with the CUDA
    runtime's last error, which is kept per host thread: a call that fails
    leaves its code there, and torch's check after the thread's next kernel
    launch (``C10_CUDA_KERNEL_LAUNCH_CHECK``: ``cudaGetLastError``) raises it."""

    def __init__(self, result: int):
        self.result = result
        self.last_error = threading.local()
        self.device = threading.local()
        self.registered = []  # (thread, device, size, flags)
        self.addresses = []  # registered, in order
        self.unregistered = []  # (thread, device, address)

    def set_device(self, device):
        self.device.current = device

    def cudaHostRegister(self, address, size, flags):  # noqa: N802 - CUDA's name
        self.registered.append((threading.current_thread(), getattr(self.device, "current",
                                                                    None), size, flags))
        self.addresses.append(address)
        if self.result:
            self.last_error.code = self.result
        return self.result

    def cudaHostUnregister(self, address):  # noqa: N802 - CUDA's name
        self.unregistered.append((threading.current_thread(),
                                  getattr(self.device, "current", None), address))
        return 0

    def launch_check(self):
        code, self.last_error.code = getattr(self.last_error, "code", 0), 0
        if code:
            raise RuntimeError(f"CUDA error {code} (raised at the next kernel launch)")


def on_loop_recorder(function):
    """(a wrapper of `function`, the list it appends to): for each call,
    whether it ran on an event loop's thread (work that must run off it)."""
    on_loop = []

    def recording(*args, **kwargs):
        try:
            asyncio.get_running_loop()
            on_loop.append(True)
        except RuntimeError:
            on_loop.append(False)
        return function(*args, **kwargs)

    return recording, on_loop


def wait_until(condition, timeout_s: float = 30.0, interval_s: float = 0.05):
    """Polls ``condition()`` until it is true or ``timeout_s`` has passed, and
    returns its last value for the caller to assert on: a bound only a hang
    reaches, however loaded the machine."""
    deadline = time.monotonic() + timeout_s
    while not (value := condition()) and time.monotonic() < deadline:
        time.sleep(interval_s)
    return value


def llm_metric(server, name: str) -> float:
    """The llm model's metric ``simple_llm_<name>`` on a real server's
    metrics port (every series summed)."""
    from simple_sampler.triton.counters import read_counter

    return read_counter(server.metrics_url, f"simple_llm_{name}")


def in_flight(server) -> float:
    """Requests in the llm model's decode loop: its gauge, reported at most
    every 0.5 s while streaming, so it may lag a new request by that much."""
    return llm_metric(server, "requests_in_flight")
