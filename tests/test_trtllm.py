"""TrtLlmEngine's bridge over the fake of TensorRT-LLM's API: the decode loop
on top of it (concurrency, pipeline micro-batches, requests joining, leaving,
cancelled), failures, the processor in another process, and the import guard.
The contract shared with TorchEngine is in test_engine_contract.py."""
import asyncio
import contextlib
import json
import os
import pickle
import signal
import subprocess
import sys
import threading
import time
import types

import pytest
import torch

import fake_tensorrt_llm as fake
from simple_sampler import SamplingParams
from simple_sampler.serving.decoder import Decoder
from simple_sampler.serving.device import CUDA_HOST_REGISTER_PORTABLE
from simple_sampler.serving.samplers import threaded
from simple_sampler.serving.generation import GenerationRequest
from simple_sampler.serving.engine import SequenceFailed
from simple_sampler.serving.text import TextCodec
from simple_sampler.serving import trtllm_api, trtllm_bridge
from simple_sampler.serving.trtllm import TrtLlmEngine
from simple_sampler.serving.trtllm_api import load_tensorrt_llm
from simple_sampler.settings import LlmSettings
from simple_sampler.triton.llm_service import build_engine
from fakes import VOCAB, FakeTokenizer, PerThreadCudart, wait_until
from simple_sampler.pids import alive


@pytest.fixture
def model_dir(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"vocab_size": VOCAB}))
    return tmp_path


@pytest.fixture
def make_engine(model_dir):
    engines = []

    def make(llm_class=fake.LLM, **kwargs):
        settings = dict(max_batch_size=4, max_context=64, step_timeout_s=10)
        engine = TrtLlmEngine.from_source(model_dir, api=(llm_class, *fake.API[1:]),
                                          **{**settings, **kwargs})
        engines.append(engine)
        return engine

    yield make
    for engine in engines:
        engine.close()


class ModelEngine:
    """The fake model's rows computed directly: the reference for the bridge."""

    vocab_size, max_batch_size, max_context = VOCAB, 4, 64

    def __init__(self):
        self.tokens = {}

    def add(self, seq_id, prompt_ids, max_tokens=None):
        self.tokens[seq_id] = list(prompt_ids)

    def step(self, seq_ids):
        return torch.stack([fake.model_row(self.tokens[i], VOCAB)[:VOCAB] for i in seq_ids])

    def append(self, seq_ids, token_ids):
        for seq_id, token in zip(seq_ids, token_ids):
            self.tokens[seq_id].append(token)

    def release(self, seq_id):
        del self.tokens[seq_id]

    def length(self, seq_id):
        return len(self.tokens[seq_id])


def requests(count):
    return [GenerationRequest(text="abcdefgh"[: 1 + i % 5], max_tokens=6 + i % 7,
                              sampling=SamplingParams(temperature=1.0, seed=100 + i))
            for i in range(count)]


def run(engine, first, later=(), cancel=(), sampler=None):
    """Submit `first`, then `later` once the first request has an event;
    cancel the requests at the indices in `cancel` after their second event."""
    seen = {}

    async def collect(handle, index):
        events = seen.setdefault(index, [])
        async for event in handle:
            events.append(event)
            if index in cancel and len(events) == 2:
                handle.cancel()
        return events

    async def main():
        decoder = Decoder(engine, TextCodec(FakeTokenizer()), sampler=sampler or threaded(),
                          micro_batches=2)
        await decoder.start()
        tasks = [asyncio.create_task(collect(decoder.submit(r), i)) for i, r in enumerate(first)]
        while not seen.get(0):  # generation is under way
            await asyncio.sleep(0.001)
        tasks += [asyncio.create_task(collect(decoder.submit(r), len(first) + i))
                  for i, r in enumerate(later)]
        results = await asyncio.gather(*tasks)
        await decoder.close()
        return results, decoder
    return asyncio.run(main())


def tokens_of(events):
    return [t for e in events for t in e.token_ids]


@pytest.mark.parametrize("pipeline_parallel_size", [1, 2])
def test_the_decode_loop_over_the_bridge_gives_the_tokens_of_the_direct_model(
        make_engine, pipeline_parallel_size):
    engine = make_engine(pipeline_parallel_size=pipeline_parallel_size)
    batch = requests(9)
    results, decoder = run(engine, batch[:3], batch[3:])
    expected, _ = run(ModelEngine(), requests(9)[:3], requests(9)[3:])
    assert [tokens_of(r) for r in results] == [tokens_of(r) for r in expected]
    assert all(r[-1].finish_reason in ("stop", "length") for r in results)
    assert len(decoder.lanes) == 1  # the engine's own batching replaces the lanes
    iterations = engine.llm.iterations
    assert max(len(i) for i in iterations) <= 4  # max_batch_size, the rest queued
    # The processor got the engine's ids and ours, never equal: rows were matched by ours.
    assert not {i for it in iterations for i in it} & {i for it in engine.llm.engine_ids
                                                         for i in it}
    if pipeline_parallel_size == 2:  # micro-batches took turns: partial iterations
        assert any(len(i) < len(set().union(*iterations[k - 1:k + 1]))
                   for k, i in enumerate(iterations) if k)
    assert len(engine.sequences) == 0 and engine.exchange.by_client == {}


def test_cancelled_requests_are_aborted_and_the_others_are_unaffected(make_engine):
    engine = make_engine()
    batch = [GenerationRequest(text="ab", max_tokens=40, sampling=SamplingParams(seed=i),
                               ignore_end=True) for i in range(4)]
    results, _ = run(engine, batch, cancel={1, 2})
    expected, _ = run(ModelEngine(), [GenerationRequest(text="ab", max_tokens=40, ignore_end=True,
                                                        sampling=SamplingParams(seed=i))
                                      for i in range(4)])
    assert [r[-1].finish_reason for r in results] == ["length", "cancelled", "cancelled", "length"]
    assert tokens_of(results[3]) == tokens_of(expected[3])
    assert len(engine.llm.aborted) == 4  # cancelled, and the finished ones released
    assert not engine.llm.errors


def test_a_failing_sampler_fails_its_rows_and_the_engine_keeps_serving(make_engine):
    engine = make_engine()
    calls = []

    async def flaky(logits, batch):
        calls.append(len(batch))
        if len(calls) == 3:
            raise RuntimeError("sampler instance died")
        return await threaded()(logits, batch)

    results, _ = run(engine, requests(4), sampler=flaky)
    errors = [r[-1].error for r in results if r[-1].error]
    assert errors and all("sampler instance died" in e for e in errors)
    assert all(r[-1].final for r in results) and len(engine.sequences) == 0
    # Their rows were answered when they were released: nothing is stuck.
    results, _ = run(engine, requests(5))
    expected, _ = run(ModelEngine(), requests(5))
    assert [tokens_of(r) for r in results] == [tokens_of(r) for r in expected]


def test_a_stalled_engine_times_out_and_a_wrong_token_is_detected(make_engine):
    engine = make_engine(llm_class=InertLLM, step_timeout_s=0.3)  # no iterations
    engine.add("a", [1, 2])
    with pytest.raises(RuntimeError, match="no row within 0.3 s"):
        engine.step(["a"])

    engine = make_engine()
    engine.llm.choose = lambda row: 5  # a sampler that ignores the mask
    engine.add("a", [1, 2])
    engine.step(["a"])
    engine.append(["a"], [7])
    with pytest.raises(RuntimeError, match="continued with token 5 where the decision plane "
                                           "chose 7"):
        engine.step(["a"])


def test_a_sequence_at_max_context_is_not_stepped(make_engine):
    engine = make_engine(max_context=4)
    engine.add("a", [1, 2, 3])
    engine.step(["a"])
    engine.append(["a"], [4])
    with pytest.raises(ValueError, match="max_context=4"):
        engine.step(["a"])


class InertLLM(fake.LLM):
    """Accepts requests, never iterates: another process calls the processor."""

    def _run(self):
        pass


CHILD = """
import pickle, sys, torch
processor = pickle.load(sys.stdin.buffer)
rows = [torch.arange(31, dtype=torch.float16).reshape(1, 1, 31) * (i + 1) for i in range(3)]
processor([0, 1, 2], rows, [[[1, 2]], [[3]], [[4]]], None, [1, 99, 2])
print([int(r.reshape(-1).argmax()) for r in rows], [bool(torch.isinf(r).all()) for r in rows])
"""


def test_the_processor_reaches_the_engine_from_another_process(make_engine):
    engine = make_engine(llm_class=InertLLM)
    engine.add("a", [1, 2])
    engine.add("b", [4])  # client ids 1 and 2; 99 is a request this engine does not know
    child = subprocess.Popen([sys.executable, "-c", CHILD], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=False)
    try:
        child.stdin.write(pickle.dumps(engine.llm.processor))
        child.stdin.close()
        assert engine.wait_ready(["a", "b"], timeout=30) == ["a", "b"]
        rows = engine.step(["b", "a"])
        assert rows.dtype == torch.float32  # the engine's logits dtype (its config names none)
        base = torch.arange(VOCAB, dtype=torch.float32)
        assert torch.equal(rows[0], base * 3) and torch.equal(rows[1], base)  # padding cut off
        engine.append(["b", "a"], [11, 7])
        output = child.stdout.read().decode().split("]")
        assert child.wait(timeout=30) == 0
    finally:
        child.kill()
    # Masked rows keep only the chosen token; the unknown request's row is untouched.
    assert output[0].strip(" [") == "7, 30, 11"
    assert "False, False, False" in output[1]
    assert engine.bridge_s > 0.0  # the processor's own time came with its rows


def test_the_staged_rows_are_referenced_where_the_processor_put_them(make_engine):
    """With an arena (``share_rows``) a step over an iteration's rows in order
    is a view of the staging block, which the arena references in place and
    a sampler instance's reader maps; another order is a copy."""
    from simple_sampler.row_arena import RowArena
    from simple_sampler.row_reader import RowReader

    engine = make_engine(llm_class=InertLLM, logits_dtype="fp16")  # as the rows: no cast
    arena = RowArena(2, 4 * VOCAB * 4)
    try:
        engine.share_rows(arena)
        assert engine.server.region.name in arena.names
        engine.add("a", [1, 2])
        engine.add("b", [4])  # client ids 1 and 2
        last = [2, 4]  # the tokens the engine last consumed, per client id
        for order, tokens in ((["a", "b"], [7, 11]), (["b", "a"], [12, 8])):
            rows = [torch.arange(31, dtype=torch.float16).reshape(1, 1, 31) * (i + 1)
                    for i in range(2)]
            call = threading.Thread(target=engine.llm.processor,
                                    args=([0, 1], rows, [[[last[0]]], [[last[1]]]], None,
                                          [1, 2]))
            call.start()
            assert engine.wait_ready(["a", "b"], timeout=30) == ["a", "b"]
            stepped = engine.step(order)
            assert stepped.dtype == torch.float16  # staged as they came
            stepped = stepped.numpy()
            base = torch.arange(VOCAB, dtype=torch.float32).numpy()
            expected = [base * (1 + ["a", "b"].index(i)) for i in order]
            assert (stepped == expected).all()
            lease = arena.reference(stepped)
            if order == ["a", "b"]:  # the iteration's rows in order: where they landed
                assert lease is not None and lease.slot == -1
                assert lease.region is engine.server.region
                assert (RowReader().rows(lease.refs()) == expected).all()
            else:  # gathered into a copy: the arena would put it in a slot
                assert lease is None
            engine.append(order, tokens)
            call.join(timeout=30)
            assert not call.is_alive()
            last = [tokens[order.index("a")], tokens[order.index("b")]]
            assert [int(r.reshape(-1).argmax()) for r in rows] == last  # masked to the choice
    finally:
        arena.close()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU: the processor's "
                    "device path (run where there is one: docs/GPU.md)")
@pytest.mark.parametrize("dtype, staged", [(torch.bfloat16, "bf16"), (torch.float32, "fp32"),
                                           (torch.bfloat16, "fp32")])
def test_cuda_rows_land_in_the_page_locked_block_in_the_engines_dtype(make_engine, dtype,
                                                                       staged):
    """What TensorRT-LLM hands the processor on a GPU, without TensorRT-LLM:
    rows on the device, padded, computed on a stream of the engine's. They
    are staged in the engine's logits dtype (cast on the device only where
    the rows disagree with it) in the page-locked block, equal to the
    device's, and masked to the chosen tokens on that stream."""
    engine = make_engine(llm_class=InertLLM, logits_dtype=staged)
    engine.add("a", [1, 2])
    engine.add("b", [4])  # client ids 1 and 2
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        rows = [torch.randn(1, 1, VOCAB + fake.PADDING, device="cuda").to(dtype)
                for _ in range(2)]
    stream.synchronize()
    as_staged = trtllm_bridge.STAGED_DTYPES[staged][1]
    expected = torch.stack([row.reshape(-1)[:VOCAB].to(as_staged).cpu() for row in rows])
    call = threading.Thread(target=engine.llm.processor,
                            args=([0, 1], rows, [[[2]], [[4]]], stream.cuda_stream, [1, 2]))
    call.start()
    assert engine.wait_ready(["a", "b"], timeout=30) == ["a", "b"]
    stepped = engine.step(["a", "b"])
    assert stepped.dtype == as_staged and torch.equal(stepped, expected)
    engine.append(["a", "b"], [5, 6])
    call.join(timeout=30)
    assert not call.is_alive() and engine.llm.processor.page_locked is True
    stream.synchronize()
    assert [int(row.reshape(-1).argmax()) for row in rows] == [5, 6]


@pytest.mark.parametrize("result", [0, 801])  # success, cudaErrorNotSupported
def test_a_refused_page_lock_leaves_no_cuda_error_on_the_engines_thread(
        make_engine, monkeypatch, caplog, result):
    """When CUDA refuses ``cudaHostRegister`` the copy must stay pageable and
    work: the refusal's error must not be left on the thread that calls the
    processor, where the next launch (the rows' gather) would raise it and
    fail the iteration. Registered on the rows' device, portable, the whole
    staging block."""
    cudart = PerThreadCudart(result)
    monkeypatch.setattr(torch.cuda, "cudart", lambda: cudart)
    monkeypatch.setattr(torch.cuda, "set_device", cudart.set_device)
    processor = make_engine(llm_class=InertLLM).llm.processor
    processor.shared = trtllm_bridge._attach(processor.shared_name)
    device = torch.device("cuda", 1)
    with caplog.at_level("WARNING", logger=trtllm_bridge.__name__):
        processor._page_lock(device)
    cudart.launch_check()  # the engine thread's next launch: no stale error
    [(thread, on_device, size, flags)] = cudart.registered
    assert thread is not threading.current_thread() and on_device == device
    assert size == processor.shared.buf.nbytes and flags == CUDA_HOST_REGISTER_PORTABLE
    assert processor.page_locked is (result == 0)
    assert ("stays pageable: cudaHostRegister returned 801" in caplog.text) is bool(result)


def test_the_logits_dtype_comes_from_a_prebuilt_engines_config(tmp_path):
    """A prebuilt engine's pretrained_config.logits_dtype sets the staging
    block's dtype and the sampler's (the engine spec); a checkpoint's config
    names none: float32 for both."""
    from simple_sampler.serving.engines import engine_spec
    from simple_sampler.settings import LlmSettings

    spec = engine_spec("tensorrt_llm")
    (tmp_path / "config.json").write_text(json.dumps({"vocab_size": VOCAB}))
    assert trtllm_api.read_logits_dtype(tmp_path) is None
    assert spec.logits_dtype(LlmSettings(engine="tensorrt_llm", model=str(tmp_path))) == "fp32"
    for name, expected in (("bfloat16", "bf16"), ("float16", "fp16"), ("float32", "fp32")):
        (tmp_path / "config.json").write_text(json.dumps(
            {"pretrained_config": {"vocab_size": VOCAB, "logits_dtype": name},
             "build_config": {}}))
        assert trtllm_api.read_logits_dtype(tmp_path) == expected
        assert spec.logits_dtype(LlmSettings(engine="tensorrt_llm",
                                             model=str(tmp_path))) == expected
    assert trtllm_api.read_logits_dtype(tmp_path / "absent") is None


def test_tensorrt_llm_is_imported_only_when_asked_for():
    try:
        import tensorrt_llm  # noqa: F401
        pytest.skip("TensorRT-LLM is installed here")
    except ImportError:
        pass
    with pytest.raises(ImportError):
        load_tensorrt_llm()
    settings = LlmSettings.from_parameters({"engine": "tensorrt_llm", "model": "/nonexistent",
                                            "tensor_parallel_size": "2",
                                            "pipeline_parallel_size": "4"})
    assert (settings.tensor_parallel_size, settings.pipeline_parallel_size) == (2, 4)
    with pytest.raises(ImportError):
        build_engine(settings)
    with pytest.raises(ValueError, match="needs model"):
        build_engine(LlmSettings(engine="tensorrt_llm"))


@pytest.mark.parametrize("config, message", [
    (LlmSettings(engine="vllm"), "engine must be one of torch, static, tensorrt_llm, simulated"),
    (LlmSettings(engine="tensorrt_llm"), "needs model"),
    (LlmSettings(tensor_parallel_size=2), "applies to engine tensorrt_llm only"),
    (LlmSettings(engine="tensorrt_llm", model="/m", pipeline_parallel_size=0), "must be >= 1"),
])
def test_serve_configuration_is_checked(config, message):
    with pytest.raises(ValueError, match=message):
        config.validate()


def test_an_engine_error_mid_generation_ends_that_request_and_the_others_continue(make_engine):
    engine = make_engine()
    calls = []

    async def sampler(logits, batch):
        calls.append(len(batch))
        if len(calls) == 3:  # request 1 is live: the engine fails it after submission
            engine.llm.fail(engine.sequences[1].client_id, "CUDA error: an illegal memory access")
        return await threaded()(logits, batch)

    batch = [GenerationRequest(text="abc", max_tokens=12, ignore_end=True,
                               sampling=SamplingParams(seed=i)) for i in range(3)]
    results, _ = run(engine, batch, sampler=sampler)
    assert results[1][-1].error == ("TensorRT-LLM failed the request: RequestError: CUDA error: "
                                    "an illegal memory access")
    # Reported within one step: the failed request got no further token after
    # the engine's next iteration.
    assert len(tokens_of(results[1])) <= 4
    expected, _ = run(ModelEngine(), [GenerationRequest(text="abc", max_tokens=12, ignore_end=True,
                                                        sampling=SamplingParams(seed=i))
                                      for i in range(3)])
    for index in (0, 2):
        assert results[index][-1].finish_reason == "length"
        assert tokens_of(results[index]) == tokens_of(expected[index])
    assert len(engine.sequences) == 0 and engine.exchange.by_client == {}


def test_a_prompt_the_engine_rejects_fails_at_once_and_max_input_len_follows_max_context(
        make_engine):
    engine = make_engine(max_context=2000, max_batch_size=2)
    assert engine.llm.max_input_len == 1999 and engine.llm.max_seq_len == 2000
    engine.add("long", [i % VOCAB for i in range(1, 1500)])  # above TensorRT-LLM's default 1024
    assert engine.wait_ready(["long"], timeout=10) == ["long"]
    assert engine.step(["long"]).shape == (1, VOCAB)

    class DefaultLimitLLM(fake.LLM):  # an engine left at max_input_len 1024
        def __init__(self, model, **kwargs):
            super().__init__(model, **{**kwargs, "max_input_len": None})

    engine = make_engine(llm_class=DefaultLimitLLM, max_context=2000, max_batch_size=2)
    engine.add("long", [i % VOCAB for i in range(1, 1500)])
    engine.add("short", [1, 2])
    assert engine.wait_ready(["long", "short"], timeout=10)
    with pytest.raises(SequenceFailed) as failure:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            engine.step(engine.wait_ready(["long"]))
    assert list(failure.value.failed) == ["long"]
    assert "Prompt length (1499) exceeds maximum input length (1024)" in failure.value.failed["long"]
    assert engine.step(["short"]).shape == (1, VOCAB)  # the other one goes on


def test_a_request_aborted_between_iterations_is_in_one_more_and_its_row_is_not_answered(
        make_engine):
    class Paced(fake.LLM):
        iteration_s = 1.0  # a pause between iterations to abort in
        paused = True

    engine = make_engine(llm_class=Paced)
    engine.add("a", [1, 2])
    engine.add("b", [3])
    engine.llm.resume()  # both in the first iteration
    ids = {key: engine.sequences[key].client_id for key in "ab"}
    assert engine.wait_ready(["a", "b"], timeout=10) == ["a", "b"]
    engine.step(["a", "b"])
    request = engine.sequences["a"].request
    engine.append(["a", "b"], [4, 5])
    deadline = time.monotonic() + 10
    while engine.llm.in_iteration and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not engine.llm.in_iteration  # it has ended; the next starts 1 s after it
    engine.release("a")  # between iterations: the next one still has it
    for token in (6, 7):
        assert engine.wait_ready(["b"], timeout=10) == ["b"]
        engine.step(["b"])
        engine.append(["b"], [token])
    assert engine.wait_ready(["b"], timeout=10) == ["b"]
    iterations = [sorted(i) for i in engine.llm.iterations]
    assert iterations[-3:] == [sorted(ids.values()), [ids["b"]], [ids["b"]]]
    deadline = time.monotonic() + 10
    while request.finish_reason is None and time.monotonic() < deadline:
        time.sleep(0.01)
    assert request.finish_reason == "cancelled" and ids["a"] in engine.llm.aborted
    # b's rows followed b alone: its tokens reached the engine in order.
    assert engine.llm.requests[0].tokens == [3, 5, 6, 7]


def test_close_aborts_live_requests_instead_of_waiting_for_their_token_limit(make_engine):
    class SlowLLM(fake.LLM):
        iteration_s = 0.01  # 10,000 tokens: 100 s if shutdown waited for them

    engine = make_engine(llm_class=SlowLLM, max_context=10_000)
    engine.add("a", [1, 2])
    assert engine.wait_ready(["a"], timeout=10) == ["a"]
    engine.step(["a"])
    engine.append(["a"], [3])
    request = engine.sequences["a"].request
    started = time.monotonic()
    engine.close()
    assert time.monotonic() - started < 5
    assert request.finish_reason == "cancelled" and not engine.llm.requests


def test_a_prebuilt_engine_is_checked_against_the_flags_and_not_rebuilt(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({
        "pretrained_config": {"vocab_size": VOCAB},
        "build_config": {"max_batch_size": 8, "max_input_len": 511, "max_seq_len": 512}}))
    for kwargs, field in ((dict(max_batch_size=16, max_context=512), "max_batch_size=8"),
                          (dict(max_batch_size=8, max_context=600), "max_input_len=511")):
        with pytest.raises(ValueError, match=rf"prebuilt engine .* has {field}, below"):
            TrtLlmEngine.from_source(tmp_path, api=fake.API, **kwargs)
    engine = TrtLlmEngine.from_source(tmp_path, api=fake.API, max_batch_size=8, max_context=512)
    try:
        assert not engine.llm.built and engine.llm.enable_build_cache is False
        assert engine.llm.max_input_len == 511  # the engine's own, not passed
    finally:
        engine.close()


def test_a_checkpoint_is_built_once_then_loaded_from_the_build_cache(model_dir, tmp_path):
    class SlowBuild(fake.LLM):
        build_s = 1.0

    times = []
    for _ in range(2):
        started = time.monotonic()
        engine = TrtLlmEngine.from_source(model_dir, api=(SlowBuild, *fake.API[1:]),
                                          max_batch_size=2, max_context=64,
                                          build_cache_dir=tmp_path / "cache")
        times.append((time.monotonic() - started, engine.llm.built))
        assert engine.llm.enable_build_cache.cache_root == tmp_path / "cache"
        engine.close()
    assert times[0][1] and times[0][0] >= 1.0
    assert not times[1][1] and times[1][0] < 1.0


def fake_module(version, tensorrt_backend=True):
    module = types.ModuleType("tensorrt_llm")
    module.__version__, module.LLM, module.SamplingParams = version, "pytorch LLM", fake.SamplingParams
    modules = {"tensorrt_llm": module}
    if tensorrt_backend:
        modules["tensorrt_llm._tensorrt_engine"] = types.SimpleNamespace(LLM=fake.LLM)
    llmapi = types.ModuleType("tensorrt_llm.llmapi")
    llmapi.BuildCacheConfig = fake.BuildCacheConfig
    modules["tensorrt_llm.llmapi"] = llmapi
    return modules


def test_the_import_takes_the_tensorrt_backend_and_refuses_a_release_without_it(monkeypatch):
    for name, module in fake_module("1.0.0").items():
        monkeypatch.setitem(sys.modules, name, module)
    api = load_tensorrt_llm()
    assert api.LLM is fake.LLM and api.BuildCacheConfig is fake.BuildCacheConfig
    assert api.version == "1.0.0"
    monkeypatch.setitem(sys.modules, "tensorrt_llm._tensorrt_engine", None)  # import fails
    with pytest.raises(ImportError, match=r"TensorRT-LLM 1\.0\.0 has no tensorrt_llm\."
                                          r"_tensorrt_engine\.LLM.*PyTorch backend") as refused:
        load_tensorrt_llm()
    assert isinstance(refused.value.__cause__, ImportError)  # why the import failed stays visible
    sys.modules["tensorrt_llm"].__version__ = "0.17.0"  # 0.x: LLM is the TensorRT backend
    assert load_tensorrt_llm().LLM == "pytorch LLM"


def test_each_request_reserves_its_own_max_tokens_not_the_whole_context(make_engine):
    class SmallCache(fake.LLM):
        # GUARANTEED_NO_EVICT over a cache of 4 short requests: with
        # full-context reservations (64 tokens each) only one would run at once.
        kv_cache_tokens = 4 * (3 + 6 + 1)
        paused = True

    engine = make_engine(llm_class=SmallCache)
    batch = [GenerationRequest(text="abc", max_tokens=6, ignore_end=True,
                               sampling=SamplingParams(seed=i)) for i in range(4)]
    threading.Timer(0.5, engine.llm.resume).start()  # all four queued first
    results, _ = run(engine, batch)
    assert all(len(tokens_of(r)) == 6 and r[-1].finish_reason == "length" for r in results)
    assert max(len(i) for i in engine.llm.iterations) == 4
    # The engine got one more than the request's own limit: it never ends a
    # request before the decode loop does.
    assert not engine.llm.errors and all(r[-1].error is None for r in results)


@pytest.mark.parametrize("max_tokens, submitted", [(None, 61), (6, 7), (60, 61), (61, 61)])
def test_the_submitted_max_tokens_is_the_request_s_own_plus_one_within_the_context(
        make_engine, max_tokens, submitted):
    engine = make_engine(llm_class=InertLLM)  # context 64, prompt 3
    engine.add("a", [1, 2, 3], max_tokens=max_tokens)
    assert engine.sequences["a"].request._llm.requests[0].params.max_tokens == submitted
    with pytest.raises(ValueError, match="max_tokens must be >= 1, got 0"):
        engine.add("b", [1], max_tokens=0)
    assert "b" not in engine.sequences


def test_the_bridge_reports_its_own_time(make_engine):
    engine = make_engine()
    assert engine.bridge_s == 0.0
    run(engine, requests(3))
    assert engine.bridge_s > 0.0


OWNER = """
import pickle, subprocess, sys, time
from simple_sampler.serving.trtllm_bridge import DecisionPlaneProcessor
processor = DecisionPlaneProcessor("unused", b"key", "unused", 1, 1)
WORKER = ("import pickle, sys, time; pickle.load(sys.stdin.buffer); print('unpickled', flush=True); "
          "time.sleep(60)")
worker = subprocess.Popen([sys.executable, "-c", WORKER], stdin=subprocess.PIPE)
worker.stdin.write(pickle.dumps(processor))
worker.stdin.close()
print(worker.pid, flush=True)
time.sleep(60)
"""


def test_a_worker_exits_when_the_process_that_owns_its_processor_dies():
    """The MPI worker's case on CPU: a process unpickles the processor (as
    TensorRT-LLM's worker does), its owner is killed (a supervisor restart),
    and the worker exits instead of holding the GPU."""
    owner = subprocess.Popen([sys.executable, "-c", OWNER], stdout=subprocess.PIPE, text=True)
    # the owner's pid line and the worker's "unpickled" (it writes to its
    # owner's stdout), in either order: then the worker watches its owner
    worker_pid = None
    try:
        lines = {owner.stdout.readline().strip() for _ in range(2)}
        assert "unpickled" in lines, lines
        [worker_pid] = [int(line) for line in lines if line.isdigit()]
        assert alive(worker_pid)  # while its owner is
        owner.send_signal(signal.SIGKILL)
        owner.wait(timeout=30)
        # a zombie, gone but not yet reaped by whoever adopted it, is not alive
        assert wait_until(lambda: not alive(worker_pid)), "the worker outlived its owner"
    finally:
        if worker_pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(worker_pid, signal.SIGKILL)
        owner.kill()


@pytest.mark.parametrize("pidfd", [True, False])
def test_the_owner_watch_sees_the_owner_go_with_or_without_pidfd(monkeypatch, pidfd):
    if not pidfd:
        monkeypatch.setattr(trtllm_bridge, "OWNER_POLL_S", 0.05)
        monkeypatch.delattr(os, "pidfd_open", raising=False)
    owner = subprocess.Popen(["sleep", "60"])
    exits = []
    trtllm_bridge.OwnerWatch(owner.pid, exit=exits.append).start()
    time.sleep(0.2)
    assert exits == []
    owner.kill()
    owner.wait()
    deadline = time.monotonic() + 10
    while not exits and time.monotonic() < deadline:
        time.sleep(0.01)
    assert exits == [trtllm_bridge.ORPHANED_EXIT_STATUS]
