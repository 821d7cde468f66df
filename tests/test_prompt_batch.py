"""A request of several prompts (Triton's batch dimension above 1, as
TensorRT-LLM's client's --batch-inputs sends them) or sequences
(num_return_sequences, its -n): one generation per prompt and sequence, each
answered with its batch_index and sequence_index through the request's one
sender, the final flag with the last to end."""
import asyncio
import dataclasses
import time
from types import SimpleNamespace

import numpy as np
import pytest

from simple_sampler.schema import InvalidRequest
from simple_sampler.serving.text import TextCodec
from simple_sampler.settings import LlmSettings
from simple_sampler.triton import llm_delivery
from simple_sampler.triton.llm_delivery import SharedSends, Unavailable
from simple_sampler.triton.llm_service import LlmService
from simple_sampler.triton.generate_io import decode_generate
from simple_sampler.triton.prompt_batch import PAD_ID, encode_prompts, generations, split_prompts
from fakes import Client, FakeEngine, FakeTokenizer, inputs


def stacked(*requests):
    """One request holding the prompts of `requests`, each input [B, ...]."""
    return {name: np.concatenate([request[name] for request in requests])
            for name in requests[0]}


def prompt(text, seed, max_tokens, stream):
    return {**inputs(text, max_tokens, stream), "random_seed": np.array([[seed]], np.uint64),
            "temperature": np.array([[4.0]], np.float32),  # the second letter is drawn too
            "top_p": np.array([[1.0]], np.float32),  # sampled (no top_p or top_k: greedy)
            "min_length": np.array([[max_tokens]], np.int32),  # no early end
            "exclude_input_in_output": np.array([[True]])}


def test_one_prompt_is_the_request_as_it_came():
    one = inputs("abc")
    [split] = split_prompts({**one, "stop_words": None})
    assert split.keys() == one.keys() and all(split[k] is one[k] for k in one)
    [unbatched] = split_prompts({"input_ids": np.array([5, 6, 7], np.int32),
                                 "input_lengths": np.array([2], np.int32)})
    assert unbatched["input_ids"].tolist() == [5, 6] and "input_lengths" not in unbatched


def test_each_prompt_gets_its_row_of_every_input_and_its_ids_cut_to_its_length():
    ids = np.array([[5, 6, 7], [8, PAD_ID, PAD_ID]], np.int32)
    rows = split_prompts({"input_ids": ids, "input_lengths": np.array([[3], [1]], np.int32),
                          "max_tokens": np.array([[4], [9]], np.int32),
                          "stop_words": np.array([[b"x", b"y"], [b"z", b""]], object)})
    assert [row["input_ids"].tolist() for row in rows] == [[[5, 6, 7]], [[8]]]
    assert [row["max_tokens"].tolist() for row in rows] == [[[4]], [[9]]]
    assert [row["stop_words"].tolist() for row in rows] == [[[b"x", b"y"]], [[b"z", b""]]]
    assert all("input_lengths" not in row for row in rows)


@pytest.mark.parametrize("request_inputs, message", [
    ({"text_input": np.array([[b"a"], [b"b"]], object), "max_tokens": np.array([[4]], np.int32)},
     r"max_tokens has shape \[1, 1\]: a request of 2 prompts gives every input a first "
     r"dimension of 2"),
    ({"text_input": np.array([[b"a"], [b"b"]], object), "max_tokens": np.array([4], np.int32)},
     r"max_tokens has shape \[1\]: a request of 2 prompts"),
    ({"text_input": np.array([[b"a"]], object), "input_lengths": np.array([[1]], np.int32)},
     "input_lengths is the length of each row of input_ids, which were not given"),
    ({"input_ids": np.array([[5, 6], [7, 8]], np.int32), "input_lengths": np.array([[1]], np.int32)},
     r"input_lengths must hold one length per prompt \(2\), got 1"),
    ({"input_ids": np.array([[5, 6], [7, 8]], np.int32),
      "input_lengths": np.array([[2], [3]], np.int32)},
     r"input_lengths 3 \(batch_index 1\) must be an integer from 1 to input_ids' length, 2"),
    ({"input_ids": np.array([[5, 6]], np.int32), "input_lengths": np.array([[0]], np.int32)},
     r"input_lengths 0 \(batch_index 0\) must be"),
])
def test_a_batch_whose_inputs_disagree_is_refused_naming_the_input(request_inputs, message):
    with pytest.raises(InvalidRequest, match=message):
        split_prompts(request_inputs)


def test_preprocessing_pads_each_prompts_ids_to_the_longest_and_gives_their_lengths():
    codec = TextCodec(FakeTokenizer())
    ids, lengths = encode_prompts(codec, {"text_input": np.array([[b"abc"], [b"d"]], object)})
    assert lengths.tolist() == [3, 1] and ids.dtype == np.int32
    assert ids.tolist() == [codec.encode("abc", False), codec.encode("d", False) + [PAD_ID] * 2]
    with pytest.raises(InvalidRequest, match="batch_index 1: text_input must be a non-empty"):
        encode_prompts(codec, {"text_input": np.array([[b"abc"], [b""]], object)})
    with pytest.raises(InvalidRequest, match="^text_input must be a non-empty"):  # one: no index
        encode_prompts(codec, {"text_input": np.array([[b""]], object)})
    with pytest.raises(InvalidRequest, match="batch_index 0: .*temprature"):
        encode_prompts(codec, {"text_input": np.array([[b"abc"], [b"d"]], object),
                               "sampling_parameters": np.array([[b'{"temprature": 1}'],
                                                                [b"{}"]], object)})


def test_only_the_last_prompt_to_end_sends_the_final_flag():
    client = Client()
    shared = SharedSends(client.send, [{"batch_index": np.array([index], np.int32)}
                                       for index in range(3)])
    first, second, third = (shared.of(index) for index in range(3))
    second({"text_output": "a"}, None, False)
    second({"text_output": "b"}, None, True)
    assert first(None, None, True) is None  # a cancelled prompt's flag alone: nothing to send
    third(None, ValueError("failed"), True)  # the last to end: its error names it
    # sent again after a failed final response: only by the prompt that carried it
    assert first(None, None, True) is None and second(None, None, True) is None
    third(None, None, True)
    assert [(outputs and outputs["batch_index"].tolist(), type(error), final)
            for outputs, error, final in client.responses] == [
        ([1], type(None), False), ([1], type(None), False), (None, ValueError, True),
        (None, type(None), True)]
    assert str(client.responses[2][1]) == "batch_index 2: failed"


class Generation(SimpleNamespace):
    __hash__ = object.__hash__  # a Delivery's: by identity
    request = llm_delivery.Delivery.request  # its request's key, as a Delivery has it


@dataclasses.dataclass
class Asker:
    """An is_cancelled that cannot be hashed (a dataclass with eq)."""

    answers: list

    def __call__(self):
        self.answers.append(time.monotonic())
        return len(self.answers) == 3


def test_a_requests_generations_are_asked_about_cancellation_once_per_poll(monkeypatch):
    """Every generation of one request shares its is_cancelled: one question
    to Triton per poll, and a yes stops them all, and no other request."""
    monkeypatch.setattr(llm_delivery, "CANCEL_POLL_S", 0.01)
    asked, other = Asker([]), Asker([-1.0, -1.0, -1.0])  # the other never says yes

    async def watch():
        deliveries = llm_delivery.Deliveries(asyncio.get_running_loop(), None, None, None,
                                             send_threads=1)
        batches = [[Generation(delivering=True, is_cancelled=ask, stopped=False)
                    for _ in range(40)] for ask in (asked, other)]
        for delivery in batches[0] + batches[1]:
            delivery.stop = lambda delivery=delivery: setattr(delivery, "stopped", True)
            deliveries.live[delivery] = None
        task = asyncio.create_task(deliveries.watch_cancellations())
        while len(asked.answers) < 3:
            await asyncio.sleep(0.01)
        task.cancel()
        return batches

    cancelled, going_on = asyncio.run(watch())
    assert len(asked.answers) == 3 and len(other.answers) in (5, 6)
    assert all(delivery.stopped for delivery in cancelled)
    assert not any(delivery.stopped for delivery in going_on)


def serve_one(request, **settings):
    """The responses to `request`, and the service's decoder once it answered."""
    service = LlmService(LlmSettings(sampling_mode="inline_kernels", **settings),
                         engine=FakeEngine(max_batch_size=2, max_context=128),
                         codec=TextCodec(FakeTokenizer()))
    client, in_flight_when_done = Client(), []
    try:
        service.submit(request, client.send, on_done=lambda: in_flight_when_done.append(
            service.decoder.num_in_flight)).result(60)
        # once, and with nothing left (the llm model's in-flight gauge, which
        # serve's stop waits to read 0, is read then)
        assert in_flight_when_done == [0] and service.decoder.num_active == 0
    finally:
        service.close()
    return client.responses


def tokens(responses):
    return [t for outputs, _, _ in responses for t in outputs["output_ids"].tolist()]


@pytest.mark.parametrize("stream", [False, True])
def test_each_prompt_is_generated_as_if_sent_alone_and_answered_with_its_batch_index(stream):
    # three prompts on a data plane of two slots: the third waits for one
    prompts = [prompt("ab", 7, 9, stream), prompt("c", 8, 5, stream), prompt("de", 9, 7, stream)]
    responses = serve_one(stacked(*prompts))
    assert all(error is None for _, error, _ in responses)
    assert [final for _, _, final in responses] == [False] * (len(responses) - 1) + [True]
    by_index = {index: [r for r in responses if r[0]["batch_index"].tolist() == [index]]
                for index in range(3)}
    assert sum(map(len, by_index.values())) == len(responses)
    for index, alone in enumerate(prompts):
        expected = serve_one(alone)
        assert all("batch_index" not in outputs for outputs, _, _ in expected)
        assert len(by_index[index]) == len(expected) == ([9, 5, 7][index] if stream else 1)
        assert tokens(by_index[index]) == tokens(expected) and len(set(tokens(expected))) > 1
        last = by_index[index][-1][0]
        assert last["finish_reason"].tolist() == [b"length"]


def test_a_refused_prompt_refuses_the_request_naming_its_batch_index():
    prompts = [prompt("ab", 7, 9, True), prompt("c", 8, 5, True), prompt("de", 9, 7, True)]
    bad = stacked(*prompts)
    bad["temperature"] = np.array([[1.0], [1.0], [-1.0]], np.float32)  # the decoder's range
    [(outputs, error, final)] = serve_one(bad)  # and the two before it never start
    assert outputs is None and final and str(error).startswith("batch_index 2: temperature")
    bad = stacked(*prompts)
    bad["text_input"] = np.array([[b"ab"], [b""], [b"de"]], object)
    [(outputs, error, final)] = serve_one(bad)
    assert final and str(error) == "batch_index 1: text_input must be a non-empty string"


def test_a_prompts_sequences_are_seeded_one_apart_and_named_by_their_indices():
    decoded = [decode_generate({**inputs("ab"), "random_seed": np.array([[2**64 - 1]], np.uint64),
                                "num_return_sequences": np.array([[3]], np.int32)}),
               decode_generate(inputs("c"))]
    runs = generations(decoded)
    assert [run.prompt for run in runs] == [0, 0, 0, 1]
    assert [run.decoded.request.sampling.seed for run in runs] == [2**64 - 1, 0, 1, None]
    assert [{name: value.tolist() for name, value in run.outputs.items()} for run in runs] == [
        {"batch_index": [0], "sequence_index": [0]}, {"batch_index": [0], "sequence_index": [1]},
        {"batch_index": [0], "sequence_index": [2]}, {"batch_index": [1]}]
    assert generations(decoded[1:])[0].outputs == {}  # one generation: nothing names it
    many = decode_generate({**inputs("ab"), "num_return_sequences": np.array([[200]], np.int32)})
    with pytest.raises(InvalidRequest, match="ask for 400 generations; a request may ask for "
                                             "at most 256"):
        generations([many, many])


@pytest.mark.parametrize("stream", [False, True])
def test_each_sequence_is_the_prompt_sent_alone_with_its_seed(stream):
    two = {name: np.concatenate([value, value]) for name, value in {
        **prompt("ab", 7, 6, stream), "num_return_sequences": np.array([[3]], np.int32)}.items()}
    two["text_input"] = np.array([[b"ab"], [b"de"]], object)
    responses = serve_one(two)
    assert [final for _, _, final in responses] == [False] * (len(responses) - 1) + [True]
    for index, text in enumerate(("ab", "de")):
        texts = set()
        for sequence in range(3):
            mine = [r for r in responses if r[0]["batch_index"].tolist() == [index]
                    and r[0]["sequence_index"].tolist() == [sequence]]
            alone = serve_one(prompt(text, 7 + sequence, 6, stream))
            assert len(mine) == len(alone) == (6 if stream else 1)
            assert tokens(mine) == tokens(alone)
            texts.add(tuple(tokens(mine)))
        assert len(texts) > 1  # not one draw three times


def test_unseeded_sequences_draw_apart():
    request = {**prompt("ab", 0, 9, False), "num_return_sequences": np.array([[3]], np.int32)}
    del request["random_seed"]
    responses = serve_one(request)
    assert [r[0]["sequence_index"].tolist() for r in responses] == [[0], [1], [2]]
    assert len({tuple(tokens([r])) for r in responses}) > 1


def test_a_drain_ends_each_generation_with_an_error_naming_it():
    service = LlmService(LlmSettings(sampling_mode="inline_kernels"),
                         engine=FakeEngine(max_batch_size=2, max_context=256, delay=0.01),
                         codec=TextCodec(FakeTokenizer()))
    client = Client()
    try:
        answered = service.submit(stacked(prompt("ab", 1, 200, True), prompt("c", 2, 200, True)),
                                  client.send)
        deadline = time.monotonic() + 10
        while len(client.responses) < 4 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert service.drain(grace_s=0).result(10) == 2
        answered.result(10)
    finally:
        service.close()
    errors = [(error, final) for _, error, final in client.responses if error is not None]
    assert sorted(str(error).split(":")[0] for error, _ in errors) == ["batch_index 0",
                                                                       "batch_index 1"]
    assert all(isinstance(error, Unavailable) for error, _ in errors)  # UNAVAILABLE: retry
    assert [final for _, _, final in client.responses] == \
        [False] * (len(client.responses) - 1) + [True]


def test_not_decoupled_a_request_is_answered_once_with_what_it_gets_decoupled():
    alone = prompt("ab", 7, 9, False)
    [(outputs, error, final)] = serve_one(alone, decoupled_mode=False)
    assert error is None and final and outputs["finish_reason"].tolist() == [b"length"]
    assert tokens([(outputs, error, final)]) == tokens(serve_one(alone))


@pytest.mark.parametrize("change, message", [
    ({"stream": np.array([[True]])}, "stream is true, but this server's llm model is not "
                                      "decoupled"),
    ({"stream": None, "streaming": np.array([[True]]),
      "request_output_len": np.array([[9]], np.int32), "max_tokens": None},
     "streaming is true, but"),  # TensorRT-LLM's tensorrt_llm model's name for it
    ({"num_return_sequences": np.array([[2]], np.int32)}, "the request asks for 2 generations"),
])
def test_not_decoupled_a_request_one_response_cannot_answer_is_refused_naming_why(change,
                                                                                 message):
    request = {**prompt("ab", 7, 9, False), **change}
    request = {name: value for name, value in request.items() if value is not None}
    [(outputs, error, final)] = serve_one(request, decoupled_mode=False)
    assert outputs is None and final and isinstance(error, InvalidRequest)
    assert str(error).startswith(message) and "decoupled_mode" in str(error)
    [(outputs, error, final)] = serve_one(stacked(prompt("ab", 7, 9, False),
                                                  prompt("c", 8, 5, False)),
                                          decoupled_mode=False)
    assert outputs is None and str(error).startswith("the request asks for 2 generations")


def test_the_servers_exclude_input_in_output_holds_where_a_request_does_not_say():
    """TensorRT-LLM's tensorrt_llm model's parameter of that name: a request
    that sends the input still decides."""
    def text(request, **settings):
        [(outputs, error, _)] = serve_one(request, **settings)
        assert error is None
        return outputs["text_output"].reshape(-1)[0].decode()

    plain = {**inputs("ab", 4, False), "temperature": np.array([[0.0]], np.float32)}
    whole = text(plain)
    assert whole.startswith("ab") and text(plain, exclude_input_in_output=True) == whole[2:]
    said = {**plain, "exclude_input_in_output": np.array([[False]])}
    assert text(said, exclude_input_in_output=True) == whole
