"""The decode loop: scheduling, finishing and cancellation with a fake engine
and tokenizer; seed invariance and the answer with the real SmolLM2; each
with steps launched ahead and not."""
import asyncio
import json
import threading
import time

import numpy as np
import pytest

from simple_sampler import SamplingParams
from simple_sampler.schema import InvalidRequest
from simple_sampler.serving.decoder import Decoder
from simple_sampler.serving.samplers import (SamplesNow, SummarizesOnDataPlane, kernel_sample,
                                             threaded)
from simple_sampler.serving.generation import GenerationRequest
from simple_sampler.models import load_model
from simple_sampler.serving.static_decode import StaticEngine
from simple_sampler.serving.torch_engine import TorchEngine
from simple_sampler.serving.text import TextCodec

from fakes import END_ID, LETTERS, VOCAB, FakeEngine, FakeTokenizer, next_letter, tiny

GREEDY = SamplingParams(temperature=0.0)


@pytest.fixture(autouse=True, params=["off", "on"])
def launch_ahead(request, monkeypatch):
    """Every test with each step launched after its step before has made
    its events (off) and before (on: ``Decoder.launches_ahead``), where the
    test's own decoder does not choose."""
    init = Decoder.__init__

    def with_launch_ahead(self, *args, **kwargs):
        kwargs.setdefault("launch_ahead", request.param)
        init(self, *args, **kwargs)
    monkeypatch.setattr(Decoder, "__init__", with_launch_ahead)
    return request.param


async def collect(handle):
    return [event async for event in handle]


def generate(engine, requests, codec=None, cancel_after=None, **decoder_args):
    """Run `requests` through a decoder together; return (events per request, decoder)."""
    async def main():
        decoder = Decoder(engine, codec or TextCodec(FakeTokenizer()), **decoder_args)
        await decoder.start()
        handles = [decoder.submit(r) for r in requests]
        results = await asyncio.gather(*(collect(h) for h in handles))
        await decoder.close()
        return results, decoder
    return asyncio.run(main())


def text_of(events):
    return "".join(e.text for e in events)


def test_requests_beyond_max_batch_wait_and_all_finish_once():
    engine = FakeEngine(max_batch_size=2)
    requests = [GenerationRequest(text=c, max_tokens=4, sampling=GREEDY) for c in "abcde"]
    results, decoder = generate(engine, requests, mode="simple", sampler=threaded())
    assert engine.most_active == 2 and sorted(engine.released) == list(range(5))
    for prompt, events in zip("abcde", results):
        assert [e.final for e in events] == [False, False, False, True]
        assert events[-1].finish_reason == "length" and events[-1].num_output_tokens == 4
        start = LETTERS.index(prompt) + 1
        assert text_of(events) == LETTERS[start:start + 4]
    assert decoder.stats.tokens == 20 and decoder.num_active == decoder.num_queued == 0


def test_a_request_that_bans_every_token_is_refused_and_the_others_are_served():
    """A request banning every token at its first step would fail the sampler
    call of each step it joins, and with it the other requests' rows: it is
    refused at submission, naming what bans them. Banned by a -inf bias on
    each; on all but the end id, which min_tokens holds back; on all but a
    letter, which a bad word bans."""
    def bias(*allowed):
        return {t: -np.inf for t in range(VOCAB) if t not in allowed}
    banning = [SamplingParams(logit_bias=bias()),
               SamplingParams(logit_bias=bias(END_ID), min_tokens=2),
               SamplingParams(logit_bias=bias(1))]
    allowed = SamplingParams(temperature=0.0, logit_bias=bias(END_ID, 1), min_tokens=2)

    async def main():
        decoder = Decoder(FakeEngine(max_batch_size=4), TextCodec(FakeTokenizer()), "simple",
                          threaded())
        await decoder.start()
        served = [decoder.submit(GenerationRequest(text=c, max_tokens=3, sampling=GREEDY))
                  for c in "ab"]
        refusals = []
        for params, bad_words in zip(banning, ([], [], ["a"])):
            with pytest.raises(InvalidRequest) as refused:
                decoder.submit(GenerationRequest(text="c", max_tokens=3, sampling=params,
                                                 bad_words=bad_words))
            refusals.append(str(refused.value))
        # one token left (the letter a, the end id held back): served
        alone = decoder.submit(GenerationRequest(text="c", max_tokens=3, sampling=allowed))
        results = await asyncio.gather(*(collect(h) for h in (*served, alone)))
        await decoder.close()
        return refusals, results
    refusals, results = asyncio.run(main())
    assert all("ban all 28 tokens at the first step" in r for r in refusals), refusals
    assert [text_of(events) for events in results] == ["bcd", "cde", "aa"]
    assert all(events[-1].error is None for events in results)


def test_a_listener_gets_every_event_in_the_loops_pass_the_same_as_a_reader():
    """RequestHandle.listen: each event is handed over as the loop makes it
    (an event made before listen() first), the same events iterating gives."""
    requests = [GenerationRequest(text=c, max_tokens=5, sampling=GREEDY) for c in "abc"]
    read, _ = generate(FakeEngine(max_batch_size=2), requests, mode="simple", sampler=threaded())

    async def main():
        decoder = Decoder(FakeEngine(max_batch_size=2), TextCodec(FakeTokenizer()), "simple",
                          threaded())
        await decoder.start()
        heard = [[] for _ in requests]
        finished = [asyncio.get_running_loop().create_future() for _ in requests]
        handles = [decoder.submit(r) for r in requests]
        # an event made before listening (a request ended while still queued)
        decoder.submit(GenerationRequest(text="d", max_tokens=5)).cancel()
        late = decoder.submit(GenerationRequest(text="e", max_tokens=5))
        late.cancel()
        cancelled = []
        late.listen(cancelled.append)
        for events, done, handle in zip(heard, finished, handles):
            def hear(event, events=events, done=done):
                events.append(event)
                if event.final:
                    done.set_result(None)
            handle.listen(hear)
        await asyncio.gather(*finished)
        await decoder.close()
        return heard, cancelled

    heard, cancelled = asyncio.run(main())

    def seen(results):  # cum_log_prob is NaN (not asked), which equals nothing
        return [[(e.text, e.token_ids, e.num_output_tokens, e.finish_reason) for e in events]
                for events in results]

    assert seen(heard) == seen(read) and len(heard[0]) == 5
    assert [e.finish_reason for e in cancelled] == ["cancelled"]


def test_a_listener_with_a_sink_gets_a_steps_tokens_at_once_then_the_final_event():
    """Decoder.on_step: the tokens that end no request come once per step,
    every row of the step in one call; the final event still comes to the
    listener; together they are what a reader iterates."""
    requests = [GenerationRequest(text=c, max_tokens=5, sampling=GREEDY) for c in "abc"]
    read, _ = generate(FakeEngine(max_batch_size=2), requests, mode="simple", sampler=threaded())
    stepped, finals, calls = listen_with_sink(requests, interval=1)
    for index, events in enumerate(read):
        assert stepped[index] == [(e.text, e.token_ids) for e in events[:-1]]
        assert (finals[index].text, finals[index].token_ids, finals[index].finish_reason) == \
            (events[-1].text, events[-1].token_ids, "length")
    assert max(calls) == 2 and sum(calls) == 3 * 4  # both rows of a step in one call


@pytest.mark.parametrize("interval", [2, 3, 0])
def test_a_sink_gets_its_tokens_interval_at_a_time_and_the_rest_with_the_final_event(interval):
    """listen(sink, interval): a request's tokens come to on_step, its first
    alone and then `interval` at a time (0: none), the text of those ids
    (detokenized when handed out), and the final event holds every token
    not handed out yet; all together are what a reader iterates, stop
    strings and end ids too."""
    requests = [GenerationRequest(text=c, max_tokens=7, sampling=GREEDY) for c in "abc"]
    requests.append(GenerationRequest(text="a", max_tokens=7, sampling=GREEDY, stop_words=["ef"]))
    requests.append(GenerationRequest(prompt_ids=[4], end_id=7, max_tokens=7,  # d; g ends it
                                      sampling=GREEDY))
    # rows that take the per-row pass every step: logprobs, two stop ids (h or the end id)
    requests.append(GenerationRequest(text="b", max_tokens=7, sampling=GREEDY,
                                      return_log_probs=True))
    requests.append(GenerationRequest(prompt_ids=[4], max_tokens=7,
                                      sampling=SamplingParams(temperature=0.0,
                                                              stop_token_ids=[8])))
    read, _ = generate(FakeEngine(max_batch_size=2), requests, mode="simple", sampler=threaded())
    stepped, finals, _ = listen_with_sink(requests, interval)
    for index, events in enumerate(read):
        chunks = stepped[index]
        assert [len(ids) for _, ids in chunks] == [1] + [interval] * (len(chunks) - 1) \
            if interval else not chunks
        final = finals[index]
        assert "".join(text for text, _ in chunks) + final.text == "".join(e.text for e in events)
        assert [t for _, ids in chunks for t in ids] + final.token_ids == \
            [t for e in events for t in e.token_ids]
        assert (final.finish_reason, final.num_output_tokens) == \
            (events[-1].finish_reason, events[-1].num_output_tokens)
    assert finals[3].finish_reason == "stop" and "ef" not in finals[3].text
    assert finals[6].finish_reason == "stop" and finals[6].token_ids[-1] == 8


@pytest.mark.parametrize("interval", [2, 0])
def test_a_sink_taken_after_some_events_continues_the_same_text(interval):
    """Tokens made before listen(sink) came as events (pushed through the
    detokenizer one by one); the ones after come to on_step: together, the
    text and ids a reader gets, none pushed twice."""
    request = GenerationRequest(text="a", max_tokens=9, sampling=GREEDY)
    [read], _ = generate(FakeEngine(max_batch_size=2), [request], mode="simple",
                         sampler=threaded())

    async def main():
        decoder = Decoder(FakeEngine(max_batch_size=2), TextCodec(FakeTokenizer()), "simple",
                          threaded())
        chunks, events = [], []
        decoder.on_step = lambda handles, texts, ids: chunks.extend(
            (text, row[0].tolist()) for text, row in zip(texts, ids))
        await decoder.start()
        handle = decoder.submit(request)
        while len(handle.pending) < 3:  # three tokens made as events, not read yet
            await asyncio.sleep(0.001)
        final = asyncio.get_running_loop().create_future()
        handle.listen(lambda e: final.set_result(e) if e.final else events.append(e),
                      sink=0, interval=interval)
        last = await final
        await decoder.close()
        return events, chunks, last

    events, chunks, last = asyncio.run(main())
    assert len(events) >= 3 and bool(chunks) == bool(interval)
    assert "".join(e.text for e in events) + "".join(t for t, _ in chunks) + last.text == \
        "".join(e.text for e in read)
    assert [t for e in events for t in e.token_ids] + [t for _, ids in chunks for t in ids] \
        + last.token_ids == [t for e in read for t in e.token_ids]


def listen_with_sink(requests, interval, engine=None, codec=None):
    """Each request listened to with a sink (its index) and `interval`:
    what on_step handed over per request ((text, ids) per call), the final
    events, and how many requests each on_step call held."""
    async def main():
        decoder = Decoder(engine or FakeEngine(max_batch_size=2),
                          codec or TextCodec(FakeTokenizer()), "simple", threaded())
        stepped = {index: [] for index in range(len(requests))}
        calls = []

        def on_step(handles, texts, ids):
            calls.append(len(handles))
            for handle, text, row in zip(handles, texts, ids):
                assert row.dtype == np.int32 and row.shape[0] == 1
                stepped[handle.sink].append((text, row[0].tolist()))

        decoder.on_step = on_step
        await decoder.start()
        finals = [asyncio.get_running_loop().create_future() for _ in requests]
        for index, request in enumerate(requests):
            decoder.submit(request).listen(finals[index].set_result, sink=index,
                                           interval=interval)
        finals = await asyncio.gather(*finals)
        await decoder.close()
        return stepped, finals, calls

    return asyncio.run(main())


def test_end_id_stops_unless_ignored_or_before_min_tokens():
    engine = FakeEngine(script=lambda ids: END_ID if len(ids) >= 3 else next_letter(ids))
    requests = [GenerationRequest(text="a", max_tokens=6, sampling=GREEDY),
                GenerationRequest(text="a", max_tokens=6, sampling=GREEDY, ignore_end=True),
                GenerationRequest(text="a", max_tokens=6,
                                  sampling=SamplingParams(temperature=0.0, min_tokens=4))]
    (ended, ignored, banned), _ = generate(engine, requests, mode="inline_kernels")
    assert text_of(ended) == "bc" and ended[-1].finish_reason == "stop"
    assert ended[-1].token_ids == [END_ID] and ended[-1].num_output_tokens == 3
    assert ended[-1].stop_reason is None  # vLLM's: an end id is no stop reason
    assert ignored[-1].finish_reason == "length" and len(ignored) == 6
    assert ignored[-1].stop_reason is None
    # min_tokens bans the end id: the runner-up letter comes instead, then the end.
    assert [e.token_ids[0] for e in banned][-1] == END_ID and len(banned) == 5
    assert text_of(banned) == "bcaa"  # "a" follows the end id in the fake


def test_end_id_minus_one_is_none_neither_ending_nor_banned():
    """TensorRT-LLM's end_id -1: no end id, so min_tokens bans none (ignore_eos
    would still ban the model's until then, as vLLM)."""
    engine = FakeEngine(script=lambda ids: END_ID if len(ids) >= 3 else next_letter(ids))
    request = GenerationRequest(text="a", max_tokens=6, end_id=-1,
                                sampling=SamplingParams(temperature=0.0, min_tokens=4))
    (events,), _ = generate(engine, [request], mode="inline_kernels")
    ids = [t for e in events for t in e.token_ids]
    assert ids[2:] == [END_ID] * 4 and events[-1].finish_reason == "length"
    with pytest.raises(InvalidRequest, match=r"or -1 \(none\), got -2"):
        GenerationRequest(text="a", end_id=-2).validate(VOCAB)


def test_a_max_tokens_past_the_context_is_shortened_to_the_room_the_prompt_leaves():
    """As TensorRT-LLM's LlmRequest::validate and vLLM's engine: a prompt of
    10 tokens in a context of 64 asking 60 (or any INT32) tokens gets 54,
    ending by length; one asking fewer gets what it asked for."""
    requests = [GenerationRequest(text="abcdefghij", max_tokens=n, ignore_end=True,
                                  sampling=SamplingParams(temperature=0.0))
                for n in (60, 2**31 - 1, 54, 20)]
    results, _ = generate(FakeEngine(max_context=64), requests, mode="inline_kernels")
    for events, asked in zip(results, (60, 2**31 - 1, 54, 20)):
        assert sum(len(e.token_ids) for e in events) == min(asked, 54)
        assert events[-1].finish_reason == "length"


def test_stop_token_ids_stop_as_the_end_id_does_even_with_ignore_eos():
    """vLLM's stop_token_ids: "d" (id 4) ends the generation as the end id
    does, its id sent and counted, its text left out (as vLLM V1's
    detokenizer leaves a stop-terminated token out), and is its stop_reason;
    with ignore_eos only the end id ends nothing; before min_tokens the stop
    ids are banned, the runner-up comes. An end id among the stop ids is no
    stop reason, unless ignore_eos (vLLM's check_stop)."""
    engine = FakeEngine()  # a -> b -> c -> d ...
    stop_d = dict(stop_token_ids=[4], temperature=0.0)
    requests = [GenerationRequest(text="a", max_tokens=8, sampling=SamplingParams(**stop_d)),
                GenerationRequest(text="a", max_tokens=8, sampling=SamplingParams(**stop_d),
                                  ignore_end=True),
                GenerationRequest(text="a", max_tokens=8,
                                  sampling=SamplingParams(min_tokens=4, **stop_d)),
                GenerationRequest(text="a", max_tokens=8, end_id=4,
                                  sampling=SamplingParams(**stop_d)),
                GenerationRequest(text="a", max_tokens=8, end_id=4, ignore_end=True,
                                  sampling=SamplingParams(**stop_d))]
    (stopped, ignoring, late, ending, ignored), _ = generate(engine, requests,
                                                             mode="inline_kernels")
    assert text_of(stopped) == "bc" and stopped[-1].finish_reason == "stop"
    assert stopped[-1].token_ids == [4] and stopped[-1].num_output_tokens == 3
    assert stopped[-1].stop_reason == 4 == ignoring[-1].stop_reason
    assert ending[-1].token_ids == [4] and ending[-1].stop_reason is None
    assert ignored[-1].token_ids == [4] and ignored[-1].stop_reason == 4
    assert text_of(ignoring) == "bc" and ignoring[-1].token_ids == [4]
    # "d" banned at the 3rd token: the runner-up "e" (the letter after "d"); the
    # 4th may be "d", which then ends it
    assert text_of(late)[:3] == "bce" and late[-1].num_output_tokens >= 4


@pytest.mark.parametrize("others", [[], [20, 21, 22, 23]])
def test_every_end_id_of_the_model_stops_unless_a_request_names_its_own(others):
    """The codec's end ids (the tokenizer's and generation_config.json's: a
    space here, id 27) each end a generation; a request's end_id replaces
    them all. With more stop ids than a row holds in numpy (`others`:
    stop_token_ids besides), each token is looked up instead."""
    engine = FakeEngine(script=lambda ids: 27 if len(ids) >= 3 else next_letter(ids))
    codec = TextCodec(FakeTokenizer(), end_ids=[27])
    assert codec.end_ids == (END_ID, 27)
    params = SamplingParams(temperature=0.0, stop_token_ids=others)
    requests = [GenerationRequest(text="a", max_tokens=6, sampling=params),
                GenerationRequest(text="a", max_tokens=6, sampling=params, end_id=END_ID)]
    (ended, own), _ = generate(engine, requests, mode="inline_kernels", codec=codec)
    assert text_of(ended) == "bc" and ended[-1].finish_reason == "stop"
    assert ended[-1].token_ids == [27]
    # vLLM makes generation_config's other end ids stop ids: they are the reason
    assert ended[-1].stop_reason == 27
    assert own[-1].finish_reason == "length" and len(own) == 6
    # listened to with a sink, the rows are quiet (their end found in numpy)
    # unless they have more stop ids than a row holds
    stepped, (ended, own), _ = listen_with_sink(requests, 1, engine, codec)
    assert [ids for _, ids in stepped[0]] == [[2], [3]] and ended.token_ids == [27]
    assert ended.finish_reason == "stop" and own.finish_reason == "length"


def test_end_ids_are_banned_before_min_tokens_even_with_ignore_eos(caplog):
    """As vLLM bans every stop and end id before min_tokens (its
    _all_stop_token_ids), ignore_eos or not; an end id the engine cannot
    generate (past its V) is dropped with a warning; a tokenizer without an
    end id of its own takes generation_config's."""
    engine = FakeEngine(script=lambda ids: END_ID if len(ids) >= 3 else next_letter(ids))
    request = GenerationRequest(text="a", max_tokens=6, ignore_end=True,
                                sampling=SamplingParams(temperature=0.0, min_tokens=4))
    with caplog.at_level("WARNING"):
        (late,), decoder = generate(engine, [request], mode="inline_kernels",
                                    codec=TextCodec(FakeTokenizer(), end_ids=[VOCAB + 5]))
    assert decoder.end_ids == [END_ID] and f"[{VOCAB + 5}]" in caplog.text
    ids = [t for e in late for t in e.token_ids]
    assert END_ID not in ids[:4] and late[-1].finish_reason == "length" and len(ids) == 6

    class NoEnd(FakeTokenizer):
        eos_token_id = None

    assert TextCodec(NoEnd(), end_ids=[27]).end_ids == (27,) and TextCodec(NoEnd()).end_ids == ()


def test_generation_end_ids_reads_generation_config(tmp_path):
    from simple_sampler.serving.text import generation_end_ids

    assert generation_end_ids(tmp_path) == []
    for eos, expected in ((128009, [128009]), ([128001, 128008, 128009], [128001, 128008, 128009]),
                          (None, []), (True, [])):
        (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": eos}))
        assert generation_end_ids(tmp_path) == expected


def test_stop_word_ends_generation_and_is_never_emitted():
    results, _ = generate(FakeEngine(), [GenerationRequest(
        text="a", max_tokens=10, sampling=GREEDY, stop_words=["xyz", "def"])],
        mode="simple", sampler=threaded())
    events = results[0]
    assert text_of(events) == "bc" and events[-1].finish_reason == "stop"
    assert all("d" not in e.text for e in events) and events[-1].num_output_tokens == 5
    assert events[-1].stop_reason == "def" and all(e.stop_reason is None for e in events[:-1])


def test_a_stop_word_within_min_tokens_ends_nothing_as_in_vllm():
    """vLLM checks stop strings only once a generation has min_tokens tokens
    (its detokenizer's ``update``): "c" (token 2) does not stop a request of
    min_tokens 2, "cd" (ending at token 3) does."""
    short = SamplingParams(temperature=0.0, min_tokens=2)
    (unstopped, spanning, plain), _ = generate(FakeEngine(), [
        GenerationRequest(text="a", max_tokens=5, sampling=short, stop_words=["c"]),
        GenerationRequest(text="a", max_tokens=5, sampling=short, stop_words=["cd"]),
        GenerationRequest(text="a", max_tokens=5, sampling=GREEDY, stop_words=["c"])],
        mode="simple", sampler=threaded())
    assert text_of(unstopped) == "bcdef" and unstopped[-1].finish_reason == "length"
    assert text_of(spanning) == "b" and spanning[-1].finish_reason == "stop"
    assert spanning[-1].num_output_tokens == 3
    assert text_of(plain) == "b" and plain[-1].num_output_tokens == 2


def test_a_stop_kept_when_asked_ends_the_text():
    """include_stop: the stop word ends the text, and a stop id's text is
    kept (vLLM's include_stop_str_in_output); an end id, special, has none."""
    stop_d = SamplingParams(temperature=0.0, stop_token_ids=[4])
    engine = FakeEngine(script=lambda ids: END_ID if len(ids) >= 3 else next_letter(ids))
    (worded, stopped), _ = generate(FakeEngine(), [
        GenerationRequest(text="a", max_tokens=10, sampling=GREEDY, stop_words=["xyz", "cd"],
                          include_stop=True),
        GenerationRequest(text="a", max_tokens=10, sampling=stop_d, include_stop=True)],
        mode="simple", sampler=threaded())
    assert text_of(worded) == "bcd" and worded[-1].num_output_tokens == 3
    assert text_of(stopped) == "bcd" and stopped[-1].token_ids == [4]
    (ended,), _ = generate(engine, [GenerationRequest(text="a", max_tokens=6, sampling=GREEDY,
                                                      include_stop=True)], mode="simple",
                           sampler=threaded())
    assert text_of(ended) == "bc" and ended[-1].token_ids == [END_ID]


def test_special_tokens_text_is_kept_when_not_skipped():
    """skip_special false (vLLM's skip_special_tokens): a special token's
    text stays in the answer (the end id generated as any token with
    ignore_end; the end id that ended it with include_stop); by default it
    is left out."""
    script = lambda ids: END_ID if len(ids) == 3 else next_letter(ids)  # noqa: E731
    asked = dict(text="a", max_tokens=5, sampling=GREEDY, ignore_end=True)
    (skipped, kept), _ = generate(FakeEngine(script=script), [
        GenerationRequest(**asked), GenerationRequest(**asked, skip_special=False)],
        mode="simple", sampler=threaded())
    assert text_of(skipped) == "bcab" and text_of(kept) == "bc\0ab"
    assert kept[-1].num_output_tokens == 5
    (ended,), _ = generate(FakeEngine(script=script), [GenerationRequest(
        text="a", max_tokens=6, sampling=GREEDY, include_stop=True, skip_special=False)],
        mode="simple", sampler=threaded())
    assert text_of(ended) == "bc\0" and ended[-1].token_ids == [END_ID]
    (plain_end,), _ = generate(FakeEngine(script=script), [GenerationRequest(
        text="a", max_tokens=6, sampling=GREEDY, skip_special=False)],
        mode="simple", sampler=threaded())  # the end id that ends it: its text left out still
    assert text_of(plain_end) == "bc" and plain_end[-1].token_ids == [END_ID]


@pytest.mark.parametrize("bad_words", [["c"], ["bc"]])
def test_bad_words_are_not_generated(bad_words):
    results, _ = generate(FakeEngine(), [GenerationRequest(
        text="a", max_tokens=3, sampling=GREEDY, bad_words=bad_words)], mode="inline")
    assert text_of(results[0]) == "bde"


def test_stop_and_bad_words_given_as_ids_end_and_ban_as_words_do():
    """stop_words_list and bad_words_list (TensorRT-LLM's tensorrt_llm
    inputs, token ids): a stop word ends the generation once the ids end
    with it, kept in the text and named by its text; a bad word's last id is
    banned after its others. Letters are ids a=1, b=2, ..."""
    (stopped, banned), _ = generate(FakeEngine(), [
        GenerationRequest(text="a", max_tokens=10, sampling=GREEDY,
                          stop_words_list=[(9, 9), (3, 4)]),
        GenerationRequest(text="a", max_tokens=3, sampling=GREEDY, bad_words_list=[(2, 3)])],
        mode="simple", sampler=threaded())
    assert text_of(stopped) == "bcd" and stopped[-1].finish_reason == "stop"
    assert stopped[-1].stop_reason == "cd" and stopped[-1].num_output_tokens == 3
    assert text_of(banned) == "bde"


def test_cancel_frees_the_slot_and_ends_with_one_final_event():
    engine = FakeEngine(max_batch_size=1, delay=0.005)

    async def main():
        decoder = Decoder(engine, TextCodec(FakeTokenizer()), sampler=threaded())
        await decoder.start()
        running = decoder.submit(GenerationRequest(text="a", max_tokens=40, sampling=GREEDY))
        waiting = decoder.submit(GenerationRequest(text="a", max_tokens=3, sampling=GREEDY))
        never = decoder.submit(GenerationRequest(text="a", max_tokens=3, sampling=GREEDY))
        never.cancel()  # still queued: cancelled at once
        events = []
        async for event in running:
            events.append(event)
            if len(events) == 2:
                running.cancel()
        rest = await collect(waiting)
        await decoder.close()
        return events, rest, await collect(never)

    events, rest, never = asyncio.run(main())
    assert events[-1].finish_reason == "cancelled" and sum(e.final for e in events) == 1
    assert len(events) <= 4  # stopped at the next step, not after 40 tokens
    assert rest[-1].finish_reason == "length" and text_of(rest) == "bcd"
    assert [e.finish_reason for e in never] == ["cancelled"]
    assert engine.released == [0, 1]  # the queued request never took a slot


def test_a_failing_sampler_errors_its_rows_and_the_decoder_keeps_serving():
    calls = []

    async def flaky(logits, batch):
        calls.append(len(batch))
        if len(calls) == 1:
            raise RuntimeError("decision plane unavailable")
        return kernel_sample(logits, batch)

    async def main():
        decoder = Decoder(FakeEngine(), TextCodec(FakeTokenizer()), sampler=flaky)
        await decoder.start()
        failed = await collect(decoder.submit(GenerationRequest(text="a", sampling=GREEDY)))
        served = await collect(decoder.submit(GenerationRequest(text="a", max_tokens=2,
                                                                sampling=GREEDY)))
        await decoder.close()
        return failed, served

    failed, served = asyncio.run(main())
    assert len(failed) == 1 and "decision plane unavailable" in failed[0].error
    assert text_of(served) == "bc" and served[-1].finish_reason == "length"


class PoisonedEngine(FakeEngine):
    """FakeEngine whose rows for the prompts in `poisoned` turn NaN at their
    third step (a model whose output broke for those sequences alone)."""

    def __init__(self, poisoned: str, **kwargs):
        super().__init__(**kwargs)
        self.poisoned = {FakeTokenizer.alphabet.index(c) for c in poisoned}

    def step(self, seq_ids):
        logits = super().step(seq_ids)
        for row, seq_id in enumerate(seq_ids):
            ids = self.ids[seq_id]
            if ids[0] in self.poisoned and len(ids) == 3:
                logits[row, 7] = float("nan")
        return logits


def hot_first_stand_in():
    """A sampler with both halves whose synchronous path samples in full,
    as the hot-first sampler's does (its refusal raised in the data-plane
    thread); awaited, the kernels."""
    class SyncKernels:
        def summarize(self, logits, batch):
            return len(batch)

        def sample_now(self, logits, batch, summary):
            return kernel_sample(logits, batch)

        async def __call__(self, logits, batch, summary=None):
            return kernel_sample(logits, batch)
    return SyncKernels()


def remote_stand_in():
    """The kernels as the sampler pool raises a remote sampler's refusal
    (INVALID_ARG): a SamplerCallError marked not retryable."""
    from simple_sampler.triton.sampler_targets import SamplerCallError

    async def sampler(logits, batch):
        try:
            return kernel_sample(logits, batch)
        except ValueError as error:
            raise SamplerCallError(f"localhost:8001: {error}", retryable=False) from None
    return sampler


def hot_first(engine):
    """The llm model's hot-first sampler in-process, over the sampler
    model's own code (``bench.serve_sim.measuring.hot_first_sampler``)."""
    from simple_sampler.bench.serve_sim.measuring import hot_first_sampler
    from simple_sampler.shvs.hot_vocab import HotVocab

    return hot_first_sampler(engine, HotVocab(np.arange(0, VOCAB, 3), VOCAB), instances=2)


@pytest.mark.parametrize("mode, sampler", [("simple", "threaded"), ("simple", "sync"),
                                           ("simple", "remote"), ("simple", "hot-first"),
                                           ("inline_kernels", None)])
def test_rows_the_sampler_refuses_end_their_requests_alone(mode, sampler):
    """A row the sampler cannot sample (NaN logits from the model) ends its
    own request with the sampler's error; the step's other rows are sampled
    around it, and every other request draws exactly the tokens it draws
    without the broken ones (seeded, T = 1: each row's draw is its own)."""
    prompts = "abxcydef"
    requests = [GenerationRequest(text=c, max_tokens=6, ignore_end=True,
                                  sampling=SamplingParams(temperature=1.0, seed=row))
                for row, c in enumerate(prompts)]
    runs = {}
    for poisoned in ("", "xy"):
        engine = PoisonedEngine(poisoned, max_batch_size=8)
        built = {"threaded": threaded, "sync": hot_first_stand_in, "remote": remote_stand_in,
                 "hot-first": lambda: hot_first(engine), None: lambda: None}[sampler]()
        runs[poisoned], decoder = generate(engine, requests, mode=mode, sampler=built)
        assert decoder.num_active == decoder.num_queued == 0
        if sampler == "hot-first":  # each row sampled counts once, the search's too
            assert built.stats["rows"] == sum(len(text_of(run)) for run in runs[poisoned])
    for c, clean, broken in zip(prompts, runs[""], runs["xy"]):
        assert clean[-1].error is None and len(text_of(clean)) == 6
        if c in "xy":
            assert "logits must not contain NaN; found at column 7" in broken[-1].error
            assert text_of(broken) == text_of(clean)[:2]  # the two steps before
        else:
            assert broken[-1].error is None and text_of(broken) == text_of(clean)


def test_only_a_refusal_naming_a_row_is_searched_for_its_rows():
    """What the decode loop samples around (``samplers.refuses_rows``): a
    ValueError or a remote refusal (INVALID_ARG: not retryable) naming a
    row; not the sampler's own failures, nor a refusal every half would
    meet too (it names no row)."""
    from simple_sampler.serving.samplers import refuses_rows
    from simple_sampler.triton.sampler_targets import SamplerCallError

    nan = "row 3: logits must not contain NaN; found at column 7"
    assert refuses_rows(ValueError(nan))
    assert refuses_rows(SamplerCallError(f"localhost:8001: {nan}", retryable=False))
    assert not refuses_rows(SamplerCallError(f"localhost:8001: {nan}"))  # a dead instance
    assert not refuses_rows(RuntimeError(nan)) and not refuses_rows(MemoryError(nan))
    assert not refuses_rows(ValueError("operands could not be broadcast together"))
    assert not refuses_rows(SamplerCallError(
        "h:8001: inference request batch-size must be <= 8 for 'simple_sampler'", retryable=False))


def test_an_error_of_the_samplers_own_while_looking_for_refused_rows_fails_the_step():
    """Sampling around refused rows stops at an error that refuses no rows
    (the decision plane down): the step's requests end with it, and the
    decoder goes on serving."""
    calls = []

    async def refuses_then_fails(logits, batch):
        calls.append(len(batch))
        if len(calls) == 1:
            raise ValueError("row 1: logits must not contain NaN; found at column 7")
        if len(calls) == 2:
            raise RuntimeError("decision plane unavailable")
        return kernel_sample(logits, batch)

    async def main():
        decoder = Decoder(FakeEngine(), TextCodec(FakeTokenizer()), sampler=refuses_then_fails)
        await decoder.start()
        failed = await asyncio.gather(*(collect(decoder.submit(GenerationRequest(
            text=c, sampling=GREEDY))) for c in "ab"))
        served = await collect(decoder.submit(GenerationRequest(text="a", max_tokens=2,
                                                                sampling=GREEDY)))
        await decoder.close()
        return failed, served

    failed, served = asyncio.run(main())
    assert calls[:2] == [2, 1]
    assert all(len(events) == 1 and "decision plane unavailable" in events[0].error
               for events in failed)
    assert text_of(served) == "bc" and served[-1].error is None


@pytest.mark.parametrize("micro_batches", [1, 2])
def test_a_samplers_data_plane_half_runs_in_the_data_plane_thread_and_reaches_it(micro_batches):
    """A sampler with ``summarize`` (the hot-first summary's place) has it
    run in the data-plane thread behind the forward, on the step's rows and
    batch, and gets its result as the third argument; tokens are as ever.
    With two lanes on an engine that does not model its device time it is
    left to the sampler (it would hold the other lane's forward)."""
    import threading

    class Split:
        def __init__(self):
            self.summarized, self.received = [], []

        def summarize(self, logits, batch):
            self.summarized.append(threading.current_thread().name)
            return ("summary of", len(batch), tuple(logits.shape))

        async def __call__(self, logits, batch, summary=None):
            self.received.append(summary)
            return kernel_sample(logits, batch)

    sampler = Split()
    (events,), _ = generate(FakeEngine(), [GenerationRequest(text="a", max_tokens=3,
                                                             sampling=GREEDY)],
                            sampler=sampler, micro_batches=micro_batches)
    assert text_of(events) == "bcd"
    if micro_batches == 2:
        assert sampler.summarized == [] and sampler.received == [None] * 3
        return
    assert len(sampler.summarized) == 3
    assert all(name.startswith("data-plane") for name in sampler.summarized)
    assert sampler.received == [("summary of", 1, (1, VOCAB))] * 3


def test_the_hot_first_sampler_declares_both_halves_and_a_plain_sampler_neither():
    """The decoder finds a sampler's halves by these protocols: the served
    hot-first sampler must match both, the kernels' async stand-in none."""
    from simple_sampler.triton.hot_first_sampler import HotFirstSampler

    assert issubclass(HotFirstSampler, SummarizesOnDataPlane)
    assert issubclass(HotFirstSampler, SamplesNow)
    plain = threaded()
    assert not isinstance(plain, SummarizesOnDataPlane) and not isinstance(plain, SamplesNow)


@pytest.mark.parametrize("micro_batches", [1, 2])
def test_a_samplers_synchronous_path_answers_in_the_data_plane_thread_with_one_lane(
        micro_batches):
    """With one lane, a sampler's ``sample_now`` answers in the data-plane
    thread right after its data-plane half; where it gives way (None) the
    event loop awaits the sampler. With two lanes it is never used (it
    would hold the other lane's forward)."""
    import threading

    class Sync:
        def __init__(self):
            self.now, self.awaited = [], 0

        def summarize(self, logits, batch):
            return len(batch)

        def sample_now(self, logits, batch, summary):
            self.now.append(threading.current_thread().name)
            if len(self.now) % 2:  # gives way after a while: still sampling time
                time.sleep(0.02)
                return None
            return kernel_sample(logits, batch)

        async def __call__(self, logits, batch, summary=None):
            self.awaited += 1
            return kernel_sample(logits, batch)

    sampler = Sync()
    (events,), decoder = generate(FakeEngine(), [GenerationRequest(text="a", max_tokens=4,
                                                                   sampling=GREEDY)],
                                  sampler=sampler, micro_batches=micro_batches)
    assert text_of(events) == "bcde"
    if micro_batches == 1:
        assert len(sampler.now) == 4 and sampler.awaited == 2
        assert all(name.startswith("data-plane") for name in sampler.now)
        # the two that gave way count as sampling, exposed (nothing overlapped them)
        assert decoder.stats.sampler_s >= 0.04 and decoder.stats.sampling_exposed_s >= 0.04
    else:
        assert sampler.now == [] and sampler.awaited == 4


@pytest.mark.parametrize("request_args, message", [
    (dict(text=""), "text_input must be a non-empty string"),
    (dict(text=None), "exactly one of text_input and prompt_ids"),
    (dict(prompt_ids=[1, 99]),
     r"input_ids \(prompt_ids\) must be a non-empty list of token ids in \[0, 28\)"),
    (dict(text="a", max_tokens=0), r"max_tokens must be an integer in \[1, 2147483647\], got 0"),
    (dict(text="a", max_tokens=2**31), r"max_tokens must be an integer in \[1, 2147483647\]"),
    (dict(text="a" * 64, max_tokens=1),
     r"the prompt \(64 tokens\) leaves no room in the context \(64 tokens\)"),
    (dict(text="a", sampling=SamplingParams(temperature=-1)), "temperature must be"),
    (dict(text="a", sampling=SamplingParams(top_p=1.5)), r"top_p must be in \(0, 1\]"),
    (dict(text="a", stop_words="end"), "stop_words must be a list of non-empty strings"),
    (dict(text="a", stop_words=[3]), "stop_words must be a list of non-empty strings"),
    (dict(text="a", bad_words=[""]), "bad_words must be a list of non-empty strings"),
    (dict(text="a", end_id=28), r"end_id must be a token id in \[0, 28\)"),
    (dict(text="a", stop_words_list=[(3, 28)]),
     r"stop_words_list must hold words of token ids in \[0, 28\)"),
    (dict(text="a", bad_words_list=[()]), r"bad_words_list must hold words of token ids"),
    # named as the generate input the client sent, not the sampling field
    (dict(text="a", sampling=SamplingParams(min_tokens=-1)), r"^min_length must be >= 0"),
    (dict(text="a", sampling=SamplingParams(logit_bias={28: 1.0})),
     r"^logit_bias_ids must be token ids in \[0, 28\), got 28"),
    (dict(text="a", sampling=SamplingParams(logit_bias={3: 2e6})),
     r"^logit_bias_values must be in \[-1e6, 1e6\] or -inf"),
    (dict(text="a", sampling=SamplingParams(seed=-1)), r"^random_seed must be in \[0, 2\*\*64\)"),
])
def test_bad_requests_are_rejected_with_the_field_and_range(request_args, message):
    async def main():
        decoder = Decoder(FakeEngine(), TextCodec(FakeTokenizer()), sampler=threaded())
        await decoder.start()
        with pytest.raises(ValueError, match=message):
            decoder.submit(GenerationRequest(**request_args))
        served = await collect(decoder.submit(GenerationRequest(text="a", max_tokens=1)))
        await decoder.close()
        return served
    assert asyncio.run(main())[-1].finish_reason == "length"


def test_a_forward_waiting_for_a_busy_decode_loop_is_counted():
    """Two lanes: while one lane's sampler holds the loop thread (a blocking
    sleep), the other lane's short forward ends and its rows wait for the
    loop: ``forward_wait_s``. A sampler that awaits instead leaves the loop
    free, and the wait is the thread hand-offs alone."""
    def sampler(blocking):
        async def sample(logits, batch):
            if blocking:
                time.sleep(0.03)
            else:
                await asyncio.sleep(0.03)
            return kernel_sample(logits, batch)
        return sample

    waits = {}
    for blocking in (True, False):
        engine = FakeEngine(max_batch_size=8, delay=0.005)
        requests = [GenerationRequest(text=c, max_tokens=8, sampling=GREEDY) for c in "abcdefgh"]
        results, decoder = generate(engine, requests, sampler=sampler(blocking), micro_batches=2)
        assert all(r[-1].finish_reason == "length" for r in results)
        waits[blocking] = decoder.stats.forward_wait_s / decoder.stats.steps
    assert waits[True] > 0.01  # of the 25 ms the other lane's sampler still held the loop
    # a difference, not a ratio: a loaded machine adds the same hand-off delay to both
    assert waits[False] >= 0 and waits[True] - waits[False] > 0.008, waits


def test_two_micro_batches_hide_sampling_behind_the_data_plane():
    async def slow_sampler(logits, batch):
        await asyncio.sleep(0.02)
        return kernel_sample(logits, batch)

    shares = {}
    for lanes in (1, 2):
        engine = FakeEngine(max_batch_size=8, delay=0.02)
        requests = [GenerationRequest(text=c, max_tokens=8, sampling=GREEDY) for c in "abcdefgh"]
        results, decoder = generate(engine, requests, sampler=slow_sampler, micro_batches=lanes)
        assert all(r[-1].finish_reason == "length" for r in results)
        stats = decoder.stats
        assert stats.sampler_s >= 0.02 * stats.steps and stats.data_plane_s >= 0.02 * stats.steps
        # the loop's own work excludes the forward and sampler waits
        assert 0 < stats.loop_s < 0.01 * stats.steps
        assert stats.loop_s == pytest.approx(sum(r.loop_s for r in stats.records))
        shares[lanes] = stats.sampling_share
        if lanes == 2:  # each micro-batch holds half of the sequences
            assert {len(rows) for rows in engine.steps} == {4}
    # one lane: about half the step samples (0.397 seen at load 5.5); two: hidden
    assert shares[1] > 0.3 and shares[2] < min(0.2, shares[1] / 2), shares


def test_lanes_are_rebalanced_when_requests_finish():
    engine = FakeEngine(max_batch_size=4)
    # Admission alternates lanes: the two short requests leave lane 1 empty.
    requests = [GenerationRequest(text="a", max_tokens=n, sampling=GREEDY) for n in (8, 1, 8, 1)]
    results, _ = generate(engine, requests, sampler=threaded(), micro_batches=2)
    assert [len(events) for events in results] == [8, 1, 8, 1]
    assert [len(rows) for rows in engine.steps[-4:]] == [1, 1, 1, 1]


def test_two_lanes_on_the_static_engine_keep_to_their_windows_of_slots():
    """engine.SplitsSlots: the decoder splits the static engine's slots
    between its two lanes; every decode step stays in one lane's window (so
    it computes that window only), both windows are used, and the greedy
    tokens are one lane's."""
    model = tiny("llama", vocab_size=VOCAB)
    requests = [GenerationRequest(text=text, max_tokens=6, sampling=GREEDY)
                for text in ("ab", "cde", "f", "ghij", "kl", "mno")]

    def run(micro_batches):
        engine = StaticEngine(model, max_batch_size=8, max_context=32)
        steps = []
        step = engine.step
        engine.step = lambda ids: steps.append(
            [engine.sequences[i].slot for i in ids]) or step(ids)
        results, decoder = generate(engine, requests, sampler=threaded(),
                                    micro_batches=micro_batches)
        return [[i for e in events for i in e.token_ids] for events in results], engine, steps

    one_lane, _, _ = run(1)
    two_lanes, engine, steps = run(2)
    assert engine.windows == [range(0, 4), range(4, 8)]
    windows = [{w.start for w in engine.windows if all(s in w for s in slots)} for slots in steps]
    assert all(len(found) == 1 for found in windows), steps
    assert set().union(*windows) == {0, 4}
    assert two_lanes == one_lane and all(one_lane)


# With the real model.

@pytest.fixture(scope="module")
def smollm2():
    model, tokenizer = load_model()
    return model, TextCodec(tokenizer)


PROMPTS = ["Tell me a story about a dragon.", "What is 2 + 2?", "Name a color.",
           "Write a haiku about rain.", "Why is the sky blue?", "List three fruits.",
           "What is the capital of Italy?", "Describe a cat."]


def seeded_texts(smollm2, concurrency, micro_batches, mode="simple", prompts=PROMPTS):
    model, codec = smollm2
    requests = [GenerationRequest(text=p, chat=True, max_tokens=8, sampling=SamplingParams(
        temperature=0.9, top_p=0.95, top_k=50, seed=100 + i)) for i, p in enumerate(prompts)]
    engine = TorchEngine(model, max_batch_size=concurrency, max_context=96)
    results, _ = generate(engine, requests, codec, mode=mode, micro_batches=micro_batches,
                          sampler=threaded())
    return [text_of(events) for events in results]


@pytest.mark.slow
def test_seeded_text_is_the_same_at_any_concurrency_and_split(smollm2):
    alone = seeded_texts(smollm2, concurrency=1, micro_batches=1)
    assert len(set(alone)) == len(PROMPTS)
    assert seeded_texts(smollm2, concurrency=8, micro_batches=2) == alone
    assert seeded_texts(smollm2, concurrency=8, micro_batches=1) == alone
    assert seeded_texts(smollm2, concurrency=8, micro_batches=1, mode="inline_kernels") == alone


def test_seeded_inline_text_is_the_same_at_any_concurrency(smollm2):
    prompts = PROMPTS[:3]
    assert (seeded_texts(smollm2, concurrency=1, micro_batches=1, mode="inline", prompts=prompts)
            == seeded_texts(smollm2, concurrency=3, micro_batches=1, mode="inline",
                            prompts=prompts))


@pytest.mark.parametrize("mode", ["simple", "inline"])
def test_greedy_chat_answer_names_paris(smollm2, mode):
    model, codec = smollm2
    request = GenerationRequest(text="What is the capital of France?", chat=True, max_tokens=30,
                                sampling=GREEDY, return_log_probs=True)
    results, _ = generate(TorchEngine(model, max_batch_size=2, max_context=128), [request],
                          codec, mode=mode, sampler=threaded())
    events = results[0]
    assert "Paris" in text_of(events) and events[-1].finish_reason == "stop"
    assert events[-1].token_ids == [codec.end_id]
    assert abs(events[-1].cum_log_prob - sum(e.logprobs[0] for e in events)) < 1e-3


class CountingEngine(FakeEngine):
    """FakeEngine that counts the steps begun, for a listener to wait on."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.begun = 0
        self.changed = threading.Condition()

    def step(self, seq_ids):
        with self.changed:
            self.begun += 1
            self.changed.notify_all()
        return super().step(seq_ids)

    def wait_for(self, steps: int, timeout: float) -> bool:
        with self.changed:
            return self.changed.wait_for(lambda: self.begun >= steps, timeout)


@pytest.mark.parametrize("stop_words", [[], ["zz"]])
def test_a_step_is_launched_before_the_step_before_it_makes_its_events(launch_ahead,
                                                                      stop_words):
    """launch_ahead on: the k-th token's event is made while step k + 1 runs
    (its listener finds that step begun, waiting as long as it must); off,
    or with stop strings (which only the event's text can find), it is made
    before that step begins (the listener waits in vain)."""
    ahead = launch_ahead == "on" and not stop_words
    timeout = 10.0 if ahead else 0.3
    engine = CountingEngine(max_batch_size=2)
    found = []

    async def main():
        decoder = Decoder(engine, TextCodec(FakeTokenizer()), "simple", threaded())
        await decoder.start()
        done = asyncio.get_running_loop().create_future()

        def hear(event):
            if event.final:
                done.set_result(event)
            else:  # step 1 (the prompt's) made token 1: step k + 1 is the next
                found.append(engine.wait_for(event.num_output_tokens + 1, timeout))
        decoder.submit(GenerationRequest(text="a", max_tokens=4, sampling=GREEDY,
                                         stop_words=stop_words)).listen(hear)
        final = await done
        await decoder.close()
        return final

    final = asyncio.run(main())
    assert final.num_output_tokens == 4 and final.finish_reason == "length"
    assert found == [ahead] * 3


def test_a_failing_event_pass_errors_its_rows_and_the_decoder_keeps_serving():
    """A step's event pass that raises (here a listener) ends that step's
    requests with the error; with the next step launched ahead, its rows
    leave their slots only after it (the engine is never changed under a
    running forward), and the decoder serves the next request."""
    engine = FakeEngine(max_batch_size=2)

    async def main():
        decoder = Decoder(engine, TextCodec(FakeTokenizer()), "simple", threaded())
        await decoder.start()
        finals = [asyncio.get_running_loop().create_future() for _ in range(2)]

        def listener(done, fail_at):
            def hear(event):
                if event.final:
                    done.set_result(event)
                elif event.num_output_tokens == fail_at:
                    raise RuntimeError("listener broke")
            return hear
        for done, fail_at in zip(finals, (2, None)):
            decoder.submit(GenerationRequest(text="a", max_tokens=6, sampling=GREEDY)).listen(
                listener(done, fail_at))
        ended = await asyncio.gather(*finals)
        served = await collect(decoder.submit(GenerationRequest(text="b", max_tokens=3,
                                                                sampling=GREEDY)))
        await decoder.close()
        return ended, served

    ended, served = asyncio.run(main())
    assert all("listener broke" in event.error for event in ended)
    assert text_of(served) == "cde" and served[-1].finish_reason == "length"
    assert sorted(engine.released) == [0, 1, 2] and not engine.ids
