"""Prompt logprobs (``GenerationRequest.prompt_logprobs``): each engine that
scores prompts gives each prompt token's logprob and the n most likely at
its place as the float64 reference computes them, in an event of their own
before any token, without changing a token; the generate tensors carry
them; the refusals name the field."""
import asyncio
import threading

import numpy as np
import pytest
import torch

from simple_sampler import SamplingParams
from simple_sampler.schema import PROMPT_OUTPUTS, InvalidRequest
from simple_sampler.serving.decoder import Decoder
from simple_sampler.serving.generation import GenerationRequest
from simple_sampler.serving.prompt_scores import (ROWS_PER_CHUNK, PromptScores, most_likely,
                                                  score_prompt_rows)
from simple_sampler.serving.samplers import threaded
from simple_sampler.serving.simulated import SimulatedEngine, SimulatedSpec
from simple_sampler.serving.static_decode import StaticEngine
from simple_sampler.serving.text import TextCodec
from simple_sampler.serving.torch_engine import TorchEngine
from simple_sampler.triton.generate_io import decode_generate
from simple_sampler.triton.generate_outputs import LOGPROB_FLOOR, encode_event, merge_events

from fakes import VOCAB, FakeEngine, FakeTokenizer, tiny


def reference(rows: np.ndarray, prompt: list[int], n: int):
    """float64 scores of a prompt from its rows [T - 1, V]: the logprob of
    each next token, and the n most likely, ties by lower id."""
    rows = rows.astype(np.float64)
    logprobs = rows - np.logaddexp.reduce(rows, axis=1, keepdims=True)
    chosen = logprobs[np.arange(len(rows)), prompt[1:]]
    order = np.argsort(-logprobs, axis=1, kind="stable")[:, :n]
    return chosen, order, np.take_along_axis(logprobs, order, axis=1), logprobs


def check(scores: PromptScores, rows: np.ndarray, prompt: list[int], n: int, tol=2e-5):
    chosen, order, values, logprobs = reference(rows, prompt, n)
    assert scores.prompt_ids.tolist() == prompt
    assert scores.token_logprobs.shape == scores.token_ranks.shape == (len(prompt) - 1,)
    np.testing.assert_allclose(scores.token_logprobs, chosen, atol=tol, rtol=0)
    # the rank: 1 + how many are more likely, ties (within the float32
    # rounding `tol` allows) counted against the token
    above = (logprobs > chosen[:, None] + tol).sum(axis=1)
    at_least = (logprobs >= chosen[:, None] - tol).sum(axis=1)
    assert np.all(above + 1 <= scores.token_ranks) and np.all(scores.token_ranks <= at_least)
    assert scores.top_ids.shape == scores.top_logprobs.shape == (len(prompt) - 1, n)
    assert scores.top_ids.tolist() == order.tolist()
    np.testing.assert_allclose(scores.top_logprobs, values, atol=tol, rtol=0)


def test_a_prompt_tokens_rank_counts_the_tokens_at_least_as_likely():
    rows = torch.tensor([[2.0, 2.0, 1.0, 0.0], [0.0, 1.0, 3.0, 1.0], [5.0, 0.0, 0.0, 0.0]])
    scores = score_prompt_rows(lambda start, stop: rows[start:stop], [0, 1, 3, 0], 0)
    assert scores.token_ranks.tolist() == [2, 3, 1]  # a tie counts against the token


def test_most_likely_ranks_as_a_stable_sort_with_ties_across_the_nth_place():
    rng = np.random.default_rng(0)
    rows = rng.normal(size=(40, 50)).astype(np.float32)
    rows[::3, 10:20] = rows[::3, 10:11]  # ten equal values, across every n below
    rows[1::3, 5:45:4] = 2.0             # the row's largest, tied
    for n in (1, 3, 7, 12, 50):
        values, order = most_likely(torch.from_numpy(rows), n)
        expected = np.argsort(-rows, axis=1, kind="stable")[:, :n]
        assert order.tolist() == expected.tolist(), n
        assert np.array_equal(values.numpy(), np.take_along_axis(rows, expected, axis=1))


@pytest.mark.parametrize("n", [0, 5])
def test_rows_are_scored_a_chunk_at_a_time_as_one(n):
    rng = np.random.default_rng(1)
    rows = rng.normal(size=(2 * ROWS_PER_CHUNK + 5, 30)).astype(np.float32) * 3
    prompt = rng.integers(0, 30, size=len(rows) + 1).tolist()
    asked = []

    def chunk(start, stop):
        asked.append((start, stop))
        return torch.from_numpy(rows[start:stop]).to(torch.bfloat16).float()

    widened = torch.from_numpy(rows).to(torch.bfloat16).float().numpy()
    check(score_prompt_rows(chunk, prompt, n), widened, prompt, n)
    assert max(stop - start for start, stop in asked) == ROWS_PER_CHUNK


@pytest.mark.parametrize("family", ["llama", "qwen2"])
@pytest.mark.parametrize("kind", [TorchEngine, StaticEngine])
def test_a_model_engine_scores_a_prompt_as_its_full_forward(family, kind):
    model = tiny(family)
    engine = kind(model, max_batch_size=2, max_context=48)
    prompt = np.random.default_rng(2).integers(0, model.config.vocab_size, 40).tolist()
    with torch.inference_mode():
        rows = model(input_ids=torch.tensor([prompt])).logits[0, :-1].double().numpy()
    check(engine.score_prompt(prompt, 6), rows, prompt, 6)
    assert engine.score_prompt(prompt[:1], 3).token_logprobs.shape == (0,)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("kind", [TorchEngine, StaticEngine])
def test_cuda_scores_a_prompt_as_its_full_forward(kind):
    """On the device, between the static engine's graph replays: the same
    scores as the float64 forward (bfloat16 logits: to their precision)."""
    model = tiny("llama", dtype=torch.bfloat16, device="cuda")
    engine = kind(model, max_batch_size=2, max_context=48)
    prompt = np.random.default_rng(5).integers(0, model.config.vocab_size, 40).tolist()
    with torch.inference_mode():
        rows = model(input_ids=torch.tensor([prompt], device="cuda")).logits[0, :-1]
    scores = engine.score_prompt(prompt, 4)
    chosen, _, _, _ = reference(rows.double().cpu().numpy(), prompt, 4)
    np.testing.assert_allclose(scores.token_logprobs, chosen, atol=5e-2)
    assert scores.top_ids.shape == (39, 4)


def test_the_simulated_engine_scores_with_its_bank_rows():
    engine = SimulatedEngine(SimulatedSpec(), max_batch_size=2)
    prompt = np.random.default_rng(3).integers(0, engine.vocab_size, 30).tolist()
    rows = engine.bank[torch.arange(29) % engine.bank.shape[0]].float().numpy()
    # torch's float32 log_softmax sums 49,152 exps: its log-sum-exp errs by up
    # to a few 1e-5 (3.5e-5 on an AVX2 host), a shift of every logprob of a row
    check(engine.score_prompt(prompt, 4), rows, prompt, 4, tol=1e-4)


class ScoringEngine(FakeEngine):
    """The fake engine, scoring a prompt with rows of its own (row i peaked
    at token i % VOCAB), each call counted; `gate` holds scoring until set."""

    def __init__(self, fail=False, **kwargs):
        super().__init__(**kwargs)
        self.fail, self.scored, self.gate, self.threads = fail, [], None, set()
        self.started = threading.Event()

    def rows(self, count):
        logits = torch.zeros((count, VOCAB))
        logits[torch.arange(count), torch.arange(count) % VOCAB] = 4.0
        return logits

    def score_prompt(self, prompt_ids, num_top):
        self.threads.add(threading.current_thread().name)
        self.started.set()
        if self.gate is not None:
            self.gate.wait(10)
        if self.fail:
            raise RuntimeError("out of device memory")
        self.scored.append(list(prompt_ids))
        rows = self.rows(len(prompt_ids) - 1)
        return score_prompt_rows(lambda start, stop: rows[start:stop], prompt_ids, num_top)


def run(engine, *requests, meanwhile=None):
    """Each request's events, run together on one decoder; `meanwhile`
    (decoder, handles) is awaited once they are submitted."""
    async def main():
        decoder = Decoder(engine, TextCodec(FakeTokenizer()), sampler=threaded())
        await decoder.start()
        try:
            handles = [decoder.submit(request) for request in requests]
            if meanwhile is not None:
                await meanwhile(decoder, handles)

            async def events(handle):
                return [event async for event in handle]
            return await asyncio.wait_for(asyncio.gather(*map(events, handles)), 30)
        finally:
            await decoder.close()
    return asyncio.run(main())


def seeded(prompt_logprobs=None, max_tokens=6, **kwargs):
    return GenerationRequest(text="abcde", max_tokens=max_tokens, prompt_logprobs=prompt_logprobs,
                             sampling=SamplingParams(seed=11, temperature=1.5), **kwargs)


def test_the_scores_come_first_alone_and_change_no_token():
    engine = ScoringEngine()
    plain, scored = run(engine, seeded(), seeded(3, return_log_probs=True))
    first = scored[0]
    assert first.prompt_scores is not None and not first.final and first.token_ids == []
    assert all(event.prompt_scores is None for event in scored[1:] + plain)
    prompt = [1, 2, 3, 4, 5]  # a-e
    assert engine.scored == [prompt]
    check(first.prompt_scores, engine.rows(4).numpy(), prompt, 3)
    assert [t for e in plain for t in e.token_ids] == [t for e in scored for t in e.token_ids]
    assert len([t for e in plain for t in e.token_ids]) == 6


def test_max_tokens_zero_scores_the_prompt_and_generates_nothing():
    engine = ScoringEngine()
    (events,) = run(engine, seeded(0, max_tokens=0))
    assert [e.prompt_scores is not None for e in events] == [True, False]
    assert events[1].finish_reason == "length" and events[1].token_ids == []
    assert events[1].num_output_tokens == 0 and events[1].num_input_tokens == 5
    assert events[0].prompt_scores.top_ids.shape == (4, 0)
    assert engine.steps == []  # nothing took a slot


def test_a_request_cancelled_while_scored_or_waiting_ends_at_once_and_is_not_scored():
    """The first is cancelled while its prompt is scored, the second while
    it waits its turn: both end "cancelled" before the scoring returns, the
    second's prompt is never scored; the others go on. Scoring runs on its
    own thread, not the loop's default executor (the sampler calls')."""
    engine = ScoringEngine()
    engine.gate = threading.Event()
    ended = []

    async def cancel_both(decoder, handles):
        await asyncio.get_running_loop().run_in_executor(None, engine.started.wait, 10)
        handles[0].cancel()
        handles[1].cancel()
        ended.extend(handle.pending[-1].finish_reason for handle in handles[:2])
        engine.gate.set()

    first, second, other = run(engine, seeded(2), seeded(1), seeded(), meanwhile=cancel_both)
    assert ended == ["cancelled", "cancelled"]
    assert [e.finish_reason for e in first + second] == ["cancelled", "cancelled"]
    assert other[-1].finish_reason == "length"
    assert len(engine.scored) == 1 and engine.threads == {"prompt-scores_0"}


def test_requests_aborted_while_waiting_to_be_scored_are_not_scored():
    engine = ScoringEngine()
    engine.gate = threading.Event()

    async def abort(decoder, handles):
        await asyncio.get_running_loop().run_in_executor(None, engine.started.wait, 10)
        assert decoder.abort_all("the server is shutting down") == 4
        engine.gate.set()

    events = run(engine, *[seeded(1)] * 4, meanwhile=abort)
    assert all(len(e) == 1 and e[0].retryable for e in events)
    assert len(engine.scored) == 1  # the one running when they were aborted


def test_a_long_prompts_logits_exist_a_chunk_at_a_time_or_whole_past_a_plain_head(monkeypatch):
    """Llama-family heads are applied ROWS_PER_CHUNK positions at a time;
    another family's whole forward gives the same scores."""
    from simple_sampler.serving import prompt_scores, torch_engine

    monkeypatch.setattr(prompt_scores, "ROWS_PER_CHUNK", 8)
    model = tiny("llama")
    engine = TorchEngine(model, max_batch_size=1, max_context=48)
    prompt = np.random.default_rng(4).integers(0, model.config.vocab_size, 40).tolist()
    head, widths = model.get_output_embeddings(), []
    handle = head.register_forward_hook(lambda module, args, out: widths.append(out.shape[0]))
    chunked = engine.score_prompt(prompt, 3)
    handle.remove()
    assert max(widths) == 8 and sum(widths) == 39
    monkeypatch.setattr(torch_engine, "PLAIN_HEAD_FAMILIES", ())
    whole = engine.score_prompt(prompt, 3)
    np.testing.assert_allclose(whole.token_logprobs, chunked.token_logprobs, atol=1e-5)
    assert whole.top_ids.tolist() == chunked.top_ids.tolist()


def test_a_failed_scoring_ends_its_request_with_the_error_alone():
    failed, other = run(ScoringEngine(fail=True), seeded(1), seeded())
    assert len(failed) == 1 and "scoring the prompt failed: out of device memory" in failed[0].error
    assert other[-1].finish_reason == "length"


@pytest.mark.parametrize("request_kwargs, message", [
    (dict(prompt_logprobs=21), "prompt_logprobs must be an integer in [0, 20], got 21"),
    (dict(prompt_logprobs=-1), "prompt_logprobs must be an integer in [0, 20], got -1"),
    (dict(prompt_logprobs=True), "prompt_logprobs must be an integer in [0, 20], got True"),
    (dict(max_tokens=0), "max_tokens must be an integer in [1, 2147483647], got 0 (0 only with "
                         "prompt_logprobs)"),
])
def test_bad_asks_are_refused_by_name(request_kwargs, message):
    request = GenerationRequest(text="ab", **request_kwargs)
    with pytest.raises(InvalidRequest, match=message.replace("[", r"\[").replace("(", r"\(")
                       .replace(")", r"\)")):
        request.validate(VOCAB)


def test_an_engine_that_cannot_score_refuses_the_ask_by_name():
    async def main():
        decoder = Decoder(FakeEngine(), TextCodec(FakeTokenizer()), sampler=threaded())
        with pytest.raises(InvalidRequest, match="prompt_logprobs cannot be given here"):
            decoder.submit(seeded(1))
    asyncio.run(main())


def test_the_generate_tensors_carry_the_ask_and_the_scores():
    decoded = decode_generate({"text_input": np.array([[b"ab"]], object),
                               "prompt_logprobs": np.array([[2]], np.int32),
                               "max_tokens": np.array([[0]], np.int32)})
    assert decoded.request.prompt_logprobs == 2 and decoded.request.max_tokens == 0
    assert decode_generate({"text_input": np.array([[b"ab"]], object)}
                           ).request.prompt_logprobs is None
    scores = PromptScores(np.array([1, 2, 3], np.int32), np.array([-0.5, -np.inf], np.float32),
                          np.array([1, 7], np.int32), np.array([[2, 1], [4, 3]], np.int32),
                          np.array([[-0.1, -2.0], [-0.2, -np.inf]], np.float32))
    engine = ScoringEngine()
    (events,) = run(engine, seeded(2, max_tokens=0))
    event = events[0]
    event.prompt_scores = scores
    outputs = encode_event(event, full=False)
    assert outputs["output_ids"].tolist() == []
    assert outputs[PROMPT_OUTPUTS[0]].tolist() == [1, 2, 3]
    assert outputs[PROMPT_OUTPUTS[1]].tolist() == [-0.5, LOGPROB_FLOOR]
    assert outputs[PROMPT_OUTPUTS[2]].tolist() == [1, 7]
    assert outputs[PROMPT_OUTPUTS[3]].tolist() == [[2, 1], [4, 3]]
    assert outputs[PROMPT_OUTPUTS[4]].tolist() == [[np.float32(-0.1), -2.0],
                                                    [np.float32(-0.2), LOGPROB_FLOOR]]
    merged = merge_events([event, events[1]])
    assert merged.prompt_scores is scores and merged.finish_reason == "length"
    assert PROMPT_OUTPUTS[0] not in encode_event(events[1])
    no_top = PromptScores(scores.prompt_ids, scores.token_logprobs, scores.token_ranks,
                          np.zeros((2, 0), np.int32), np.zeros((2, 0), np.float32))
    event.prompt_scores = no_top
    assert set(PROMPT_OUTPUTS) & set(encode_event(event)) == set(PROMPT_OUTPUTS[:3])
