"""vLLM's request extras at the OpenAI door, without a server: /tokenize
and /detokenize, the chat template's controls, add_special_tokens,
truncate_prompt_tokens (the door's fakes: test_frontend's recorder in place
of the llm model)."""
import copy
import json

import pytest
from fastapi.testclient import TestClient
from tokenizers.processors import TemplateProcessing

from simple_sampler.client import Chunk
from simple_sampler.frontend import tokens
from simple_sampler.frontend.app import build_app
from simple_sampler.frontend.translate import Served
from simple_sampler.serving.text import TextCodec
from fakes import on_loop_recorder
from test_frontend import CONTEXT, MODEL, Recorder, chat, completion, post

TURNS = [{"role": "user", "content": "Capital of France?"},
         {"role": "assistant", "content": "The capital"}]


@pytest.fixture(scope="module")
def bos_codec(codec):
    """SmolLM2's tokenizer made to add a BOS (<|endoftext|>, id 0), as
    Llama's does (SmolLM2's adds nothing), and a template that reads a
    variable of its own: what add_special_tokens and chat_template_kwargs
    change."""
    tokenizer = copy.deepcopy(codec.tokenizer)
    tokenizer.backend_tokenizer.post_processor = TemplateProcessing(
        single="<|endoftext|> $A", special_tokens=[("<|endoftext|>", 0)])
    tokenizer.chat_template = ("{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
                               "{% if add_generation_prompt %}assistant:{% endif %}"
                               "{% if shout %}!{% endif %}{% for tag in tags or [] %}#{{ tag }}"
                               "{% endfor %}")
    return TextCodec(tokenizer)


@pytest.fixture
def recorder():
    return Recorder()


def door(codec, recorder=None) -> TestClient:
    generate = (recorder or Recorder()).generate
    return TestClient(build_app(Served(MODEL, codec, CONTEXT, len(codec.tokenizer)), generate))


@pytest.fixture
def client(codec, recorder):
    return door(codec, recorder)


def test_tokenize_gives_the_ids_a_completion_sends(client, recorder, codec):
    """vLLM's TokenizeResponse: count, max_model_len, tokens, token_strs
    (null unless asked; the tokenizer's pieces when asked)."""
    answer = post(client, "/tokenize", {"model": MODEL, "prompt": "The capital of France is"})
    assert answer.status_code == 200, answer.text
    assert post(client, "/v1/completions", completion()).status_code == 200
    ids = recorder.plans[0].prompt_ids
    assert answer.json() == {"count": len(ids), "max_model_len": CONTEXT, "tokens": ids,
                             "token_strs": None}
    pieces = post(client, "/tokenize", {"prompt": "The capital", "return_token_strs": True}).json()
    assert pieces["token_strs"] == ["The", "Ġcapital"]  # model optional, as vLLM's
    assert post(client, "/tokenize", {"prompt": ""}).json()["tokens"] == []


def test_tokenize_of_messages_gives_the_ids_a_chat_request_sends(client, recorder):
    for fields in ({}, {"add_generation_prompt": False},
                   {"add_generation_prompt": False, "continue_final_message": True}):
        body = {"messages": TURNS, **fields}
        answer = post(client, "/tokenize", body).json()
        assert post(client, "/v1/chat/completions", chat(**body)).status_code == 200
        assert answer["tokens"] == recorder.plans[-1].prompt_ids
        assert answer["count"] == len(answer["tokens"])
    opened, closed, continued = [plan.prompt_ids for plan in recorder.plans]
    # the assistant's turn opened after "The capital<|im_end|>\n", or none, or
    # the last turn left open: "The capital" is continued
    assert opened[:len(closed)] == closed and len(opened) > len(closed)
    assert closed[:len(continued)] == continued and len(closed) == len(continued) + 2


def test_continue_final_message_continues_any_role(client, recorder, codec):
    """As transformers and vLLM: the last message is left open whatever its
    role (a user's turn continued: no <|im_end|> after it, nothing opened)."""
    body = chat(continue_final_message=True, add_generation_prompt=False)
    assert post(client, "/v1/chat/completions", body).status_code == 200
    assert post(client, "/tokenize", body).json()["tokens"] == recorder.plans[-1].prompt_ids
    text = codec.decode(recorder.plans[-1].prompt_ids, special=True)
    assert text.endswith("<|im_start|>user\nCapital of France?"), text


def test_add_special_tokens_and_template_variables_reach_the_tokenizer(bos_codec, recorder):
    """Completions add the tokenizer's special tokens by default (as today
    and as vLLM), chat not (the template holds them); each may be asked
    otherwise. chat_template_kwargs are the template's variables."""
    client = door(bos_codec, recorder)
    for body, expected in ((completion(prompt="hi"), [0, 6004]),
                           (completion(prompt="hi", add_special_tokens=False), [6004])):
        assert post(client, "/v1/completions", body).status_code == 200
        assert recorder.plans[-1].prompt_ids == expected
        assert post(client, "/tokenize", body).json()["tokens"] == expected
    plain = bos_codec.tokenize("user: hi\nassistant:", add_special_tokens=False)
    for fields, expected in (({}, plain), ({"add_special_tokens": True}, [0, *plain]),
                             ({"chat_template_kwargs": {"shout": True}},
                              bos_codec.tokenize("user: hi\nassistant:!", False))):
        body = chat(messages=[{"role": "user", "content": "hi"}], **fields)
        assert post(client, "/v1/chat/completions", body).status_code == 200
        assert recorder.plans[-1].prompt_ids == expected, fields
        assert post(client, "/tokenize", body).json()["tokens"] == expected


def test_detokenize_gives_the_text_with_special_tokens(client, codec):
    ids = [1, *codec.encode("Hello world"), 2]
    assert post(client, "/detokenize", {"model": MODEL, "tokens": ids}).json() == {
        "prompt": "<|im_start|>Hello world<|im_end|>"}
    assert post(client, "/detokenize", {"tokens": []}).json() == {"prompt": ""}


# (path, body, status, the field the error must name, text its message must hold)
BAD = [
    ("/detokenize", {"tokens": [5, 49152]}, 400, "tokens", "tokens[1] must be an integer in [0, 49151]"),
    ("/detokenize", {"tokens": [-1]}, 400, "tokens", "[0, 49151]"),
    ("/detokenize", {"tokens": "5"}, 400, "tokens", "valid array"),
    ("/detokenize", {"tokens": [5], "model": "other"}, 404, "model", "does not exist"),
    ("/tokenize", {"prompt": "x", "model": "other"}, 404, "model", "does not exist"),
    ("/tokenize", {"prompt": "x", "temprature": 1}, 400, "temprature", "unknown field"),
    ("/tokenize", {"messages": TURNS, "prompt": "x"}, 400, "messages",
     "give one of prompt and messages, not both"),
    ("/tokenize", {"messages": TURNS, "tools": [{}]}, 400, "tools.0.type", "is required"),
    ("/tokenize", {"messages": []}, 400, "messages", "at least one"),
    ("/tokenize", {"messages": TURNS, "continue_final_message": True}, 400,
     "continue_final_message", "cannot both be true"),
    ("/v1/chat/completions", chat(messages=TURNS, continue_final_message=True,
                                  add_generation_prompt=True), 400,
     "continue_final_message", "cannot both be true"),
    ("/v1/chat/completions", chat(chat_template_kwargs={"tokenize": True}), 400,
     "chat_template_kwargs", "may not set tokenize"),
    ("/tokenize", {"messages": TURNS, "chat_template_kwargs": {"chat_template": "x"}}, 400,
     "chat_template_kwargs", "may not set chat_template"),
    # what transformers' renderer passes the template itself (a second
    # messages= was a TypeError, a 500) and the functions it gives it
    ("/v1/chat/completions", chat(chat_template_kwargs={"messages": []}), 400,
     "chat_template_kwargs", "may not set messages"),
    ("/tokenize", {"messages": TURNS, "chat_template_kwargs": {"messages": []}}, 400,
     "chat_template_kwargs", "may not set messages"),
    ("/v1/chat/completions", chat(chat_template_kwargs={"raise_exception": 1}), 400,
     "chat_template_kwargs", "may not set raise_exception"),
    ("/v1/chat/completions", chat(chat_template_kwargs={"strftime_now": "x", "tools": []}), 400,
     "chat_template_kwargs", "may not set strftime_now, tools"),
    ("/v1/chat/completions", chat(chat_template_kwargs={"add_generation_prompt": False}), 400,
     "chat_template_kwargs", "may not set add_generation_prompt"),
    ("/v1/chat/completions", chat(chat_template_kwargs=[1]), 400, "chat_template_kwargs",
     "should be an object"),
    ("/v1/chat/completions", chat(add_generation_prompt=None), 400, "add_generation_prompt",
     "valid boolean"),
    ("/v1/completions", completion(add_special_tokens="no"), 400, "add_special_tokens",
     "valid boolean"),
    ("/v1/completions", completion(skip_special_tokens=None), 400, "skip_special_tokens",
     "valid boolean"),
    ("/v1/completions", completion(spaces_between_special_tokens=False), 400,
     "spaces_between_special_tokens", "must be true"),
    ("/v1/tokenize", {"prompt": "x"}, 404, None, "Not Found"),  # vLLM serves no /v1/tokenize
    # k in [1, context], as vLLM 0.32's TokenizeParams
    ("/v1/completions", completion(truncate_prompt_tokens=0), 400, "truncate_prompt_tokens",
     "truncate_prompt_tokens must be -1 or an integer in [1, 512] (the context), got 0"),
    ("/v1/completions", completion(truncate_prompt_tokens=-2), 400, "truncate_prompt_tokens",
     "must be -1 or an integer in [1, 512]"),
    ("/v1/completions", completion(truncate_prompt_tokens=513, max_tokens=12), 400,
     "truncate_prompt_tokens", "[1, 512] (the context), got 513"),
    ("/v1/chat/completions", chat(truncate_prompt_tokens=513), 400, "truncate_prompt_tokens",
     "[1, 512] (the context), got 513"),
    # a max_tokens past the context is refused as such, not as a truncation's
    ("/v1/completions", completion(truncate_prompt_tokens=5, max_tokens=513), 400, "max_tokens",
     "max_tokens must be an integer in [1, 512]"),
    ("/v1/chat/completions", chat(truncate_prompt_tokens=1.5), 400, "truncate_prompt_tokens",
     "valid integer"),
]


@pytest.mark.parametrize("path,body,status,param,text", BAD)
def test_a_bad_request_names_its_field(client, recorder, path, body, status, param, text):
    response = post(client, path, body)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["param"] == param and text in error["message"], error
    assert recorder.plans == []


def test_a_template_variable_of_the_wrong_type_is_a_400(bos_codec, recorder):
    """A template failing on a variable's value (here iterating an int: a
    TypeError) is the client's: a 400 naming chat_template_kwargs, as vLLM
    answers it, not a 500."""
    client = door(bos_codec, recorder)
    body = chat(messages=[{"role": "user", "content": "hi"}])
    for path in ("/v1/chat/completions", "/tokenize"):
        response = post(client, path, {**body, "chat_template_kwargs": {"tags": 1}})
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["param"] == "chat_template_kwargs", error
        assert "TypeError" in error["message"] and "not iterable" in error["message"], error
    ok = post(client, "/tokenize", {**body, "chat_template_kwargs": {"tags": ["a", "b"]}})
    assert ok.json()["tokens"] == bos_codec.tokenize("user: hi\nassistant:#a#b", False)
    assert recorder.plans == []


def test_tokenize_runs_off_the_event_loop(client, monkeypatch):
    recording, on_loop = on_loop_recorder(tokens.tokenize)
    monkeypatch.setattr(tokens, "tokenize", recording)
    assert post(client, "/tokenize", {"prompt": "x"}).status_code == 200
    assert on_loop == [False]


def test_a_failure_of_ours_in_tokenize_is_a_500(codec, monkeypatch):
    monkeypatch.setattr(tokens, "tokenize", lambda body, served: {}["boom"])
    response = door(codec).post("/tokenize", content=json.dumps({"prompt": "x"}))
    assert response.status_code == 500 and "KeyError" in response.json()["error"]["message"]


def test_truncate_prompt_tokens_sends_the_prompts_last_tokens(client, recorder, codec):
    """vLLM's truncate_prompt_tokens k: the last k tokens of a text prompt,
    of token ids, of a chat's templated prompt; -1 the context less the one
    token held back for the output (chat without max_tokens: the whole
    context), as vLLM 0.32's TokenizeParams: a shorter prompt whole; the
    output's room what the kept prompt leaves. Echo then gives the text of
    the tokens sent."""
    text = codec.encode("The capital of France is")
    cases = [(completion(truncate_prompt_tokens=3), text[-3:], 16),
             (completion(prompt=list(range(1, 11)), truncate_prompt_tokens=4), [7, 8, 9, 10], 16),
             (completion(prompt=[list(range(1, 11))], truncate_prompt_tokens=-1),
              list(range(1, 11)), 16),
             (completion(prompt=[5] * 600, truncate_prompt_tokens=500, max_tokens=12), [5] * 500,
              12),
             (completion(prompt=[5] * 600, truncate_prompt_tokens=500, max_tokens=100), [5] * 500,
              12),
             # -1: the context less one, room for one token of the answer
             (completion(prompt=[5] * 600, truncate_prompt_tokens=-1), [5] * 511, 1),
             (completion(prompt=[5] * 600, truncate_prompt_tokens=-1, max_tokens=100), [5] * 511,
              1)]
    for body, expected, max_tokens in cases:
        assert post(client, "/v1/completions", body).status_code == 200, body
        assert recorder.plans[-1].prompt_ids == expected
        assert recorder.plans[-1].params["max_tokens"] == max_tokens
    templated = codec.encode("Capital of France?", chat=True)
    assert post(client, "/v1/chat/completions", chat(truncate_prompt_tokens=5)).status_code == 200
    assert recorder.plans[-1].prompt_ids == templated[-5:]
    assert recorder.plans[-1].params["max_tokens"] == CONTEXT - 5
    long = chat(messages=[{"role": "user", "content": "hi " * 600}], truncate_prompt_tokens=-1)
    assert post(client, "/v1/chat/completions", {**long, "max_tokens": 30}).status_code == 200
    assert len(recorder.plans[-1].prompt_ids) == CONTEXT - 1
    assert recorder.plans[-1].params["max_tokens"] == 1
    # chat's -1 without max_tokens: the whole context, which leaves no room,
    # a 400, as in vLLM (its chat counts no output tokens unless asked)
    full = post(client, "/v1/chat/completions", long)
    assert full.status_code == 400 and "leaves no room" in full.json()["error"]["message"]
    echoed = post(client, "/v1/completions", completion(echo=True, max_tokens=0,
                                                        truncate_prompt_tokens=2)).json()
    assert echoed["choices"][0]["text"] == codec.decode(text[-2:])
    assert echoed["usage"]["prompt_tokens"] == 2
    whole = post(client, "/v1/completions", completion(echo=True, max_tokens=0,
                                                      truncate_prompt_tokens=-1)).json()
    assert whole["choices"][0]["text"] == completion()["prompt"]


def test_a_truncated_text_prompt_keeps_the_tokenizers_bos(bos_codec, recorder):
    """As transformers' truncation from the left (vLLM's): the BOS the
    tokenizer adds stays, the text's first tokens go; a chat's template
    holds its own (no BOS added unless add_special_tokens)."""
    client = door(bos_codec, recorder)
    text = bos_codec.tokenize("The capital of France is", add_special_tokens=False)
    for body, expected in ((completion(truncate_prompt_tokens=3), [0, *text[-2:]]),
                           (completion(truncate_prompt_tokens=1), [0]),
                           (completion(truncate_prompt_tokens=6), [0, *text]),
                           (completion(truncate_prompt_tokens=3, add_special_tokens=False),
                            text[-3:]),
                           (completion(prompt=[0, *text], truncate_prompt_tokens=3), text[-3:])):
        assert post(client, "/v1/completions", body).status_code == 200, body
        assert recorder.plans[-1].prompt_ids == expected, body
    templated = bos_codec.tokenize("user: hi\nassistant:", add_special_tokens=False)
    for fields, expected in (({}, templated[-4:]),
                             ({"add_special_tokens": True}, [0, *templated[-3:]])):
        body = chat(messages=[{"role": "user", "content": "hi"}], truncate_prompt_tokens=4,
                    **fields)
        assert post(client, "/v1/chat/completions", body).status_code == 200
        assert recorder.plans[-1].prompt_ids == expected, fields
    echoed = post(client, "/v1/completions", completion(echo=True, max_tokens=0,
                                                        truncate_prompt_tokens=3)).json()
    assert echoed["choices"][0]["text"] == bos_codec.decode(text[-2:])  # the BOS: no text


def test_skip_special_tokens_false_reaches_the_llm_input(client, recorder):
    """vLLM's skip_special_tokens (default true, the llm input's default):
    only false is sent."""
    assert post(client, "/v1/chat/completions", chat(skip_special_tokens=True)).status_code == 200
    assert "skip_special_tokens" not in recorder.plans[-1].params
    assert post(client, "/v1/completions", completion(skip_special_tokens=False)).status_code == 200
    assert recorder.plans[-1].params["skip_special_tokens"] is False


def test_logprob_strings_keep_special_tokens_text_when_not_skipped(codec):
    """skip_special_tokens false keeps a special token's text in the
    logprobs' token strings and bytes too (chat's token, top_logprobs and
    bytes; completions' tokens and top_logprobs dicts); by default it is ""
    there as in the answer's text."""
    paris, dot = codec.encode(" Paris")[0], codec.encode(".")[0]

    def generate(plan):
        async def chunks():
            n = len(plan.prompt_ids)
            yield Chunk(" Paris", [paris, 2], [-0.5, -0.25], -0.75, n, 2, "stop",
                        [[(paris, -0.5), (2, -1.0)], [(2, -0.25), (dot, -2.0)]])
        return chunks()

    client = TestClient(build_app(Served(MODEL, codec, CONTEXT, len(codec.tokenizer)), generate))
    for skip, end in ((True, ""), (False, "<|im_end|>")):
        answer = post(client, "/v1/chat/completions",
                      chat(logprobs=True, top_logprobs=2, skip_special_tokens=skip)).json()
        first, second = answer["choices"][0]["logprobs"]["content"]
        assert [e["token"] for e in first["top_logprobs"]] == [" Paris", end]
        assert second["token"] == end and second["bytes"] == list(end.encode())
        assert [e["token"] for e in second["top_logprobs"]] == [end, "."]
        answer = post(client, "/v1/completions",
                      completion(logprobs=2, skip_special_tokens=skip)).json()
        logprobs = answer["choices"][0]["logprobs"]
        assert logprobs["tokens"] == [" Paris", end]
        assert logprobs["top_logprobs"][1] == {end: -0.25, ".": -2.0}
