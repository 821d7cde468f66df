"""The generate codec's logit_bias inputs and its outputs when logprobs are
not asked (no server)."""
import numpy as np
import pytest

from simple_sampler.schema import InvalidRequest
from simple_sampler.serving.generation import GenerationEvent
from simple_sampler.triton.byte_tensors import install_byte_serializer
from simple_sampler.triton.generate_io import decode_generate
from simple_sampler.triton.trtllm_text import add_embedding_bias
from simple_sampler.triton.generate_outputs import encode_event


def test_logit_bias_inputs_become_the_sampling_params_bias():
    decoded = decode_generate({"text_input": np.array([[b"hi"]], object),
                               "logit_bias_ids": np.array([[5, 9]], np.int32),
                               "logit_bias_values": np.array([[-np.inf, 1.5]], np.float32)})
    assert decoded.request.sampling.logit_bias == {5: -np.inf, 9: 1.5}
    assert decode_generate({"text_input": np.array([[b"hi"]], object)}).request.sampling \
        .logit_bias == {}


@pytest.mark.parametrize("inputs, message", [
    ({"logit_bias_ids": np.array([[5]], np.int32)}, "given together"),
    ({"logit_bias_ids": np.array([[5, 6]], np.int32),
      "logit_bias_values": np.array([[1.0]], np.float32)}, "one value per logit_bias_ids"),
    ({"logit_bias_ids": np.array([[5, 5]], np.int32),
      "logit_bias_values": np.array([[1.0, 2.0]], np.float32)}, "at most once"),
])
def test_bad_logit_bias_inputs_are_refused_by_name(inputs, message):
    with pytest.raises(InvalidRequest, match=message):
        decode_generate({"text_input": np.array([[b"hi"]], object), **inputs})


def test_empty_stop_and_bad_words_name_no_word_as_in_tensorrt_llm():
    """TensorRT-LLM's README sends `"stop_words": "", "bad_words": ""`; its
    preprocessing skips a word of no ids. The others are kept in order."""
    decoded = decode_generate({"text_input": np.array([[b"hi"]], object),
                               "stop_words": np.array([[b""]], object),
                               "bad_words": np.array([[b"", b"x y", b""]], object)})
    assert decoded.request.stop_words == [] and decoded.request.bad_words == ["x y"]


def test_bad_words_sent_as_vllms_parameter_are_encoded_as_vllm_encodes_them():
    """The bad_words input is TensorRT-LLM's (each word encoded alone); sent
    in sampling_parameters or as a request parameter it is vLLM's, which
    also bans each word after a space (TextCodec.words_ids)."""
    text = {"text_input": np.array([[b"hi"]], object)}
    as_input = decode_generate({**text, "bad_words": np.array([[b"Paris"]], object)}).request
    in_json = decode_generate({**text, "sampling_parameters": np.array(
        [[b'{"bad_words": ["Paris"]}']], object)}).request
    as_parameter = decode_generate(text, {"bad_words": ["Paris"]}).request
    assert as_input.bad_words == in_json.bad_words == as_parameter.bad_words == ["Paris"]
    assert not as_input.bad_words_spaced and in_json.bad_words_spaced and as_parameter.bad_words_spaced


def word_list(*words):
    """TensorRT-LLM's [1, 2, N] word list of `words` (its preprocessing's
    _to_word_list_format): ids back to back, then each word's end offset."""
    ids = [t for word in words for t in word]
    ends = np.cumsum([len(word) for word in words]).tolist()
    width = max(len(ids), 1)
    return np.array([[ids + [0] * (width - len(ids)), ends + [-1] * (width - len(ends))]],
                    np.int32)


def test_word_lists_in_ids_are_read_as_tensorrt_llms_backend_reads_them():
    """stop_words_list / bad_words_list ([1, 2, N]): the words between
    consecutive offsets, up to the first -1; [1, 2, 0] and a list of no
    words (its preprocessing's for empty strings) name none."""
    text = {"text_input": np.array([[b"hi"]], object)}
    request = decode_generate({**text, "stop_words_list": word_list((5, 6), (7,)),
                               "bad_words_list": word_list((9,))}).request
    assert request.stop_words_list == [(5, 6), (7,)] and request.bad_words_list == [(9,)]
    for none in (np.zeros((1, 2, 0), np.int32), word_list()):
        assert decode_generate({**text, "stop_words_list": none}).request.stop_words_list == []


@pytest.mark.parametrize("lists, message", [
    (np.array([[5, 6]], np.int32), r"stop_words_list must have shape \[1, 2, N\]"),
    (np.array([[[5, 6], [-1, 2]]], np.int32), "must end with -1s only"),
    (np.array([[[5, 6], [2, 1]]], np.int32), r"must strictly increase within \[1, 2\]"),
    (np.array([[[5, 6], [3, -1]]], np.int32), r"must strictly increase within \[1, 2\]"),
    # a word of no ids, which convertWordList refuses (repeated) or keeps (first 0: an empty
    # stop word, which ends a generation at once there)
    (np.array([[[5, 6], [1, 1]]], np.int32), "must strictly increase"),
    (np.array([[[5, 6], [0, 2]]], np.int32), "must strictly increase"),
])
def test_a_malformed_word_list_is_refused_by_name(lists, message):
    with pytest.raises(InvalidRequest, match=message):
        decode_generate({"text_input": np.array([[b"hi"]], object), "stop_words_list": lists})


def test_a_dense_embedding_bias_adds_its_nonzero_entries_to_the_logit_bias():
    """embedding_bias ([1, V'], TensorRT-LLM's preprocessing's EMBEDDING_BIAS):
    empty is none; its nonzero entries are summed with logit_bias; longer
    than the vocabulary, or not a bias value, it is refused."""
    text = {"text_input": np.array([[b"hi"]], object)}
    assert decode_generate({**text, "embedding_bias": np.zeros((1, 0), np.float32)}) \
        .embedding_bias is None
    decoded = decode_generate({**text, "embedding_bias": np.array([[0, 2, 0, -1]], np.float32),
                               "logit_bias_ids": np.array([[1, 3]], np.int32),
                               "logit_bias_values": np.array([[0.5, 1.0]], np.float32)})
    request = add_embedding_bias(decoded.request, decoded.embedding_bias, vocab_size=4)
    assert request.sampling.logit_bias == {1: 2.5, 3: 0.0}
    with pytest.raises(InvalidRequest, match=r"must be 0 past the vocabulary \(V = 3\), got "
                                             r"-1.0 at id 3"):
        add_embedding_bias(decoded.request, decoded.embedding_bias, vocab_size=3)
    # zeros past V (a tokenizer that counts more ids than the model): taken
    padded = decode_generate({**text, "embedding_bias": np.array([[0, 2, 0, 0]], np.float32)})
    assert add_embedding_bias(padded.request, padded.embedding_bias, vocab_size=3) \
        .sampling.logit_bias == {1: 2.0}
    # each in range alone, out of it summed: named as both
    big = decode_generate({**text, "embedding_bias": np.array([[0, 1e6]], np.float32),
                           "logit_bias_ids": np.array([[1]], np.int32),
                           "logit_bias_values": np.array([[1e6]], np.float32)})
    with pytest.raises(InvalidRequest, match="embedding_bias plus logit_bias must stay in"):
        add_embedding_bias(big.request, big.embedding_bias, vocab_size=4)
    with pytest.raises(InvalidRequest, match="embedding_bias must be in"):
        decode_generate({**text, "embedding_bias": np.array([[np.nan]], np.float32)})


def test_a_decoder_prompt_is_refused_and_preprocessings_placeholder_taken():
    """decoder_input_ids is read by TensorRT-LLM for encoder-decoder models
    only; its preprocessing sends one pad id for a decoder-only model."""
    text = {"text_input": np.array([[b"hi"]], object)}
    assert decode_generate({**text, "decoder_input_ids": np.array([[2]], np.int32)}).request \
        .text == "hi"
    with pytest.raises(InvalidRequest, match="decoder_input_ids is an encoder-decoder model's"):
        decode_generate({**text, "decoder_input_ids": np.array([[2, 3]], np.int32)})
    assert decode_generate({**text, "decoder_input_lengths": np.array([[1]], np.int32)}) \
        .request.text == "hi"
    with pytest.raises(InvalidRequest, match="decoder_input_lengths must be 1"):
        decode_generate({**text, "decoder_input_lengths": np.array([[2]], np.int32)})


@pytest.mark.parametrize("extra, message", [
    ({"text_input": np.array([[b"hi"]], object)}, "not both"),
    ({"apply_chat_template": np.array([[True]])}, "apply_chat_template applies to text_input"),
])
def test_input_ids_with_text_or_a_template_flag_are_refused_not_dropped(extra, message):
    with pytest.raises(InvalidRequest, match=message):
        decode_generate({"input_ids": np.array([[5, 6]], np.int32), **extra})
    request = decode_generate({"input_ids": np.array([[5, 6]], np.int32),
                               "apply_chat_template": np.array([[False]])}).request
    assert request.prompt_ids == [5, 6] and request.text is None


def test_input_ids_without_the_batch_dimension_are_the_prompt():
    """A preprocessing model of max_batch_size 0 (Triton's vLLM backend's
    shapes) gives input_ids [L]."""
    assert decode_generate({"input_ids": np.array([5, 6], np.int32)}).request.prompt_ids == [5, 6]
    with pytest.raises(InvalidRequest, match=r"input_ids must have shape \[1, L\], got \[1, 1, 2\]"):
        decode_generate({"input_ids": np.array([[[5, 6]]], np.int32)})


def test_stop_token_ids_become_the_sampling_params_stop_ids():
    prompt = {"input_ids": np.array([[1, 2]], np.int32)}
    decoded = decode_generate({**prompt, "stop_token_ids": np.array([[7, 3]], np.int32)})
    assert list(decoded.request.sampling.stop_token_ids) == [7, 3]
    assert list(decode_generate(prompt).request.sampling.stop_token_ids) == []


def test_ignore_eos_lets_the_end_id_end_nothing():
    """vLLM's ignore_eos: the request's end id is then a token like any other
    (GenerationRequest.ignore_end); absent, it ends the generation."""
    prompt = {"input_ids": np.array([[1, 2]], np.int32)}
    assert decode_generate({**prompt, "ignore_eos": np.array([[True]])}).request.ignore_end
    assert not decode_generate(prompt).request.ignore_end


def test_skip_special_tokens_is_true_unless_sent_false():
    """vLLM's skip_special_tokens: the one flag whose absence means true."""
    prompt = {"input_ids": np.array([[1, 2]], np.int32)}
    assert decode_generate(prompt).request.skip_special
    assert not decode_generate({**prompt, "skip_special_tokens": np.array([[False]])}
                               ).request.skip_special
    assert decode_generate({**prompt, "skip_special_tokens": np.array([[True]])}).request.skip_special


def test_request_parameters_are_refused_by_name_but_tritons_own():
    prompt = {"input_ids": np.array([[1, 2]], np.int32)}
    with pytest.raises(InvalidRequest, match="unknown field temprature"):
        decode_generate(prompt, '{"temprature": 0.5, "triton_x": 1}')
    # none, Triton's own, an HTTP header Triton forwards (--http-header-forward-pattern)
    for parameters in (None, "", "{}", '{"triton_enable_empty_final_response": true}',
                       '{"x-request-id": "abc"}'):
        decode_generate(prompt, parameters)
    with pytest.raises(InvalidRequest, match="beam_width is an input of this model, not a vLLM sampling parameter"):
        decode_generate(prompt, {"beam_width": 2})


def test_output_log_probs_are_zero_per_token_when_not_asked():
    """Never an empty tensor: perf_analyzer 2.50's JSON export wrote garbage
    for one; cum_log_probs is 0 alike."""
    outputs = encode_event(GenerationEvent(0, " Paris", [3, 4], [], 5, 2, float("nan")))
    assert outputs["output_log_probs"].tolist() == [[0.0, 0.0]]  # [beams, tokens]
    assert outputs["cum_log_probs"].tolist() == [0.0]
    asked = encode_event(GenerationEvent(0, " Paris", [3], [-0.5], 5, 1, -0.5))
    assert asked["output_log_probs"].tolist() == [[-0.5]]


def python_backend_utils():
    """python_backend's own triton_python_backend_utils (numpy and the
    standard library only), from the Triton install the servers run."""
    import importlib.util

    from simple_sampler.launch.install import find_triton

    path = find_triton().python_backend / "triton_python_backend_utils.py"
    spec = importlib.util.spec_from_file_location("python_backend_utils_under_test", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("array", [
    np.array([["é, Paris"]], object), np.array([[b"\x00tail\x00"]], object),
    np.array([[""]], object), np.array([b"x"], object), np.array([[" t151000"]], object)[0:1],
    np.array([["a", "bc"]], object), np.array([[b"a"], [b"\xff"]], object),
    np.array([[7]], object), np.array([b"abc"], np.bytes_), np.zeros((1, 0), object)])
def test_the_one_element_byte_serializer_gives_python_backends_bytes(array):
    pb_utils = python_backend_utils()
    general = pb_utils.serialize_byte_tensor
    expected = general(array)
    install_byte_serializer(pb_utils)
    install_byte_serializer(pb_utils)  # once
    assert pb_utils.serialize_byte_tensor.general is general
    assert pb_utils.serialize_byte_tensor(array) == expected


def test_the_vllm_backends_return_inputs_ask_for_its_outputs_in_every_response():
    """Triton's vLLM backend's additional outputs, as its
    ci/L0_additional_outputs_vllm test reads them: finish_reason "None" until
    the last response, num_output_tokens per response, num_input_tokens and
    cumulative_logprob in each; nothing extra when not asked."""
    prompt = {"input_ids": np.array([[1, 2, 3]], np.int32)}
    asked = {f"return_{name}": np.array([[True]]) for name in
             ("finish_reason", "cumulative_logprob", "num_input_tokens", "num_output_tokens")}
    decoded = decode_generate({**prompt, **asked})
    assert decoded.extra_outputs == {"finish_reason", "cumulative_logprob",
                                     "num_input_tokens", "num_output_tokens"}
    # the running sum is of logprobs the sampler then computes
    assert decoded.request.return_log_probs
    # ... but not the client's: its responses before the last carry none, and a
    # request it refuses stays refused
    assert not decoded.logprobs
    with pytest.raises(InvalidRequest, match="num_top_logprobs needs return_log_probs true"):
        decode_generate({**prompt, **asked, "num_top_logprobs": np.array([[2]], np.int32)})
    plain = decode_generate({**prompt, **{name: np.array([[False]]) for name in asked}})
    assert plain.extra_outputs == set() and not plain.request.return_log_probs

    # a stream's third response, of two tokens: num_output_tokens counts these two
    first = GenerationEvent(0, " Par", [3, 4], [-0.5, -0.25], 3, 4, -0.75)
    last = GenerationEvent(0, "is", [5], [-1.0], 3, 5, -1.75, finish_reason="length")
    early = encode_event(first, full=False, logprobs=False, extra=decoded.extra_outputs)
    assert "output_log_probs" not in early
    assert early["finish_reason"].tolist() == [b"None"]
    assert early["num_output_tokens"].tolist() == [2] and early["num_input_tokens"].tolist() == [3]
    assert early["cumulative_logprob"].tolist() == [-0.75]
    final = encode_event(last, full=True, extra=decoded.extra_outputs)
    assert final["finish_reason"].tolist() == [b"length"]
    # this response's tokens, where the last response otherwise counts them all
    assert final["num_output_tokens"].tolist() == [1]
    assert final["cumulative_logprob"].tolist() == [-1.75]
    assert encode_event(last, full=True)["num_output_tokens"].tolist() == [5]
    assert not {"finish_reason", "cumulative_logprob"} & set(encode_event(first, full=False))


def test_the_vllm_backends_json_logprobs_are_refused_by_name():
    prompt = {"input_ids": np.array([[1, 2, 3]], np.int32)}
    with pytest.raises(InvalidRequest, match="return_logprobs must be false.*return_log_probs"):
        decode_generate({**prompt, "return_logprobs": np.array([[True]])})
    assert decode_generate({**prompt, "return_logprobs": np.array([[False]])}).extra_outputs \
        == set()


@pytest.mark.parametrize("name, value, message", [
    ("beam_width", np.array([[2]], np.int32), "beam_width must be 1: beam search"),
    ("num_return_sequences", np.array([[257]], np.int32),
     r"num_return_sequences must be an integer in \[0, 256\], got 257"),
    ("num_return_sequences", np.array([[-1]], np.int32), "num_return_sequences must be"),
    ("return_context_logits", np.array([[True]]), "return_context_logits must be false"),
    ("return_generation_logits", np.array([[True]]), "return_generation_logits must be false"),
    ("return_perf_metrics", np.array([[True]]), "return_perf_metrics must be false"),
    ("length_penalty", np.array([[np.nan]], np.float32), "length_penalty must be finite"),
])
def test_tensorrt_llms_inputs_are_taken_at_what_this_server_does(name, value, message):
    """TensorRT-LLM's end_to_end_grpc_client.py sends beam_width 1 with every
    request: taken; beam search or logits are refused by name, as are more
    sequences than a request may ask for; pad_id and length_penalty, which
    with one beam change nothing there, are taken."""
    prompt = {"input_ids": np.array([[1, 2, 3]], np.int32)}
    with pytest.raises(InvalidRequest, match=message):
        decode_generate({**prompt, name: value})
    taken = decode_generate({**prompt, "beam_width": np.array([[0]], np.int32),  # 0 is 1 there
                             "num_return_sequences": np.array([[1]], np.int32),
                             "return_context_logits": np.array([[False]]),
                             "pad_id": np.array([[0]], np.int32),
                             "length_penalty": np.array([[0.5]], np.float32)})
    assert taken.request == decode_generate(prompt).request and taken.sequences == 1


def test_min_tokens_is_min_lengths_other_name():
    """TensorRT-LLM's ensemble calls it min_tokens now (and vLLM does)."""
    prompt = {"input_ids": np.array([[1, 2, 3]], np.int32)}
    minimum = lambda value: np.array([[value]], np.int32)
    assert decode_generate({**prompt, "min_tokens": minimum(4)}).request.sampling.min_tokens == 4
    both = decode_generate({**prompt, "min_tokens": minimum(4), "min_length": minimum(4)})
    assert both.request.sampling.min_tokens == 4 and both.sent_as == {"min_length": "min_tokens"}
    with pytest.raises(InvalidRequest, match="min_tokens and min_length are the same parameter"):
        decode_generate({**prompt, "min_tokens": minimum(4), "min_length": minimum(5)})
    # vLLM's rule for its name, however it came (over HTTP generate a min_tokens key is this
    # input now); the message names what the client sent
    with pytest.raises(InvalidRequest, match=r"min_tokens \(20\) must be at most max_tokens"):
        decode_generate({**prompt, "min_tokens": minimum(20)})
    decode_generate({**prompt, "min_length": minimum(20)})  # TensorRT-LLM's old name: not held
    with pytest.raises(InvalidRequest, match="min_tokens and sampling_parameters.min_tokens are"):
        decode_generate({**prompt, "min_tokens": minimum(4), "sampling_parameters":
                         np.array([[b'{"min_tokens": 5}']], object)})


def test_tensorrt_llms_core_model_names_are_aliases_and_ask_for_its_answer():
    """Its tensorrt_llm model's names (schema.CORE_ALIASES) are the same
    parameters; request_output_len (required there) marks the request as
    that model's (answered in its outputs), and an input asking for an
    output its answer cannot carry is refused, not dropped."""
    prompt = {"input_ids": np.array([[1, 2, 3]], np.int32)}
    core = decode_generate({**prompt, "request_output_len": np.array([[5]], np.int32),
                            "runtime_top_k": np.array([[7]], np.int32),
                            "runtime_top_p": np.array([[0.5]], np.float32),
                            "streaming": np.array([[True]]),
                            "len_penalty": np.array([[1.0]], np.float32)})
    same = decode_generate({**prompt, "max_tokens": np.array([[5]], np.int32),
                            "top_k": np.array([[7]], np.int32),
                            "top_p": np.array([[0.5]], np.float32), "stream": np.array([[True]]),
                            "end_id": np.array([[-1]], np.int32)})  # that model's no end_id
    assert core.request == same.request and core.stream and core.core and not same.core
    with pytest.raises(InvalidRequest, match="request_output_len and max_tokens are the same "
                                             "parameter; they disagree"):
        decode_generate({**prompt, "request_output_len": np.array([[5]], np.int32),
                         "max_tokens": np.array([[6]], np.int32)})
    with pytest.raises(InvalidRequest, match="num_top_logprobs asks for an output that "
                                             "TensorRT-LLM's tensorrt_llm model's answer"):
        decode_generate({**prompt, "request_output_len": np.array([[5]], np.int32),
                         "return_log_probs": np.array([[True]]),
                         "num_top_logprobs": np.array([[2]], np.int32)})
    with pytest.raises(InvalidRequest, match="return_finish_reason asks for an output"):
        decode_generate({**prompt, "request_output_len": np.array([[5]], np.int32),
                         "return_finish_reason": np.array([[True]])})


def test_a_core_request_takes_tensorrt_llms_defaults_and_names_its_inputs_as_sent():
    """In its tensorrt_llm model's dialect no runtime_top_p is 0 there (its
    defaults: greedy unless a top_k or top_p is given), whatever else
    carries max_tokens; refusals name the core model's inputs."""
    prompt = {"input_ids": np.array([[1, 2, 3]], np.int32),
              "request_output_len": np.array([[4]], np.int32)}
    for given, expected in (({}, (1, 1.0)), ({"runtime_top_k": 50}, (50, 1.0)),
                            ({"runtime_top_p": 0.9}, (0, 0.9))):
        arrays = {name: np.array([[value]], np.int32 if "top_k" in name else np.float32)
                  for name, value in given.items()}
        sampling = decode_generate({**prompt, **arrays}).request.sampling
        assert (sampling.top_k, sampling.top_p) == pytest.approx(expected), given
    # no end_id is -1 there: no token ends the generation (its docs/model_config.md)
    request = decode_generate(prompt).request
    assert (request.end_id, request.ignore_end) == (-1, False)
    request = decode_generate({**prompt, "end_id": np.array([[2]], np.int32)}).request
    assert (request.end_id, request.ignore_end) == (2, False)
    # -1 says so in every dialect; no end_id elsewhere is the model's end ids
    for given in ({"request_output_len": prompt["request_output_len"]}, {}):
        request = decode_generate({"input_ids": prompt["input_ids"], **given,
                                   "end_id": np.array([[-1]], np.int32)}).request
        assert (request.end_id, request.ignore_end) == (-1, False)
    assert not decode_generate({"input_ids": prompt["input_ids"]}).request.ignore_end
    # the dialect whatever else carries max_tokens (here vLLM's parameter, the same value)
    assert decode_generate(prompt, {"max_tokens": 4}).core
    with pytest.raises(InvalidRequest, match=r"^request_output_len must be at least 1, got 0$"):
        decode_generate({**prompt, "request_output_len": np.array([[0]], np.int32)})
    with pytest.raises(InvalidRequest, match="len_penalty must be finite"):
        decode_generate({**prompt, "len_penalty": np.array([[np.inf]], np.float32)})
    with pytest.raises(InvalidRequest, match=r"min_tokens \(5\) must be at most "
                                             r"request_output_len \(4\)"):
        decode_generate({**prompt, "min_tokens": np.array([[5]], np.int32)})


@pytest.mark.parametrize("name", ["top_p", "runtime_top_p"])
def test_top_p_zero_is_no_top_p_and_with_no_top_k_greedy_as_tensorrt_llm_reads_it(name):
    """Its clients send top_p 0 with top_k 1 by default; top_k 0 (or -1, or
    none) with top_p 0 is greedy there (regularizeTopKTopP). vLLM's top_p
    keeps (0, 1]; a value outside [0, 1] is refused naming the input."""
    prompt = {"input_ids": np.array([[1, 2, 3]], np.int32)}
    zero = {name: np.array([[0.0]], np.float32)}
    for top_k, expected in ((None, 1), (0, 1), (-1, 1), (1, 1), (5, 5)):
        given = {} if top_k is None else {"top_k": np.array([[top_k]], np.int32)}
        sampling = decode_generate({**prompt, **zero, **given}).request.sampling
        assert (sampling.top_k, sampling.top_p) == (expected, 1.0), top_k
    for bad in (-0.5, 1.5, float("nan")):
        with pytest.raises(InvalidRequest, match=rf"{name} must be in \[0, 1\] \(0 is no top-p"):
            decode_generate({**prompt, name: np.array([[bad]], np.float32)})
    for vllm in (decode_generate({**prompt, "sampling_parameters": np.array(
            [[b'{"top_p": 0}']], object)}), decode_generate(prompt, {"top_p": 0})):
        with pytest.raises(InvalidRequest, match="top_p must be in"):
            vllm.request.validate(1000)
    # a top_k out of range stays to be refused
    below = decode_generate({**prompt, **zero, "top_k": np.array([[-3]], np.int32)})
    with pytest.raises(InvalidRequest, match="top_k must be >= -1"):
        below.request.validate(1000)


def test_tensorrt_llms_embedding_bias_adds_each_words_weight_to_its_tokens():
    """As its preprocessing model's _get_embedding_bias: every token of each
    word, encoded alone (special tokens included), gets the word's weight,
    once per occurrence; summed over words and with logit_bias."""
    from simple_sampler.triton.trtllm_text import add_word_bias

    words = {"ab": [7, 8, 7], "b": [8], "x": [1, 9]}  # a made-up tokenizer, BOS 1 on "x"
    decoded = decode_generate({
        "input_ids": np.array([[1, 2, 3]], np.int32),
        "embedding_bias_words": np.array([[b"ab", b"b", b"x"]], object),
        "embedding_bias_weights": np.array([[0.5, 2.0, -np.inf]], np.float32),
        "logit_bias_ids": np.array([[8]], np.int32),
        "logit_bias_values": np.array([[-1.0]], np.float32)})
    request = add_word_bias(decoded.request, decoded.word_bias, words.__getitem__)
    assert request.sampling.logit_bias == {7: 1.0, 8: 1.5, 1: -np.inf, 9: -np.inf}


@pytest.mark.parametrize("inputs, message", [
    ({"embedding_bias_words": np.array([[b"a"]], object)}, "given together"),
    ({"embedding_bias_words": np.array([[b"a", b"b"]], object),
      "embedding_bias_weights": np.array([[1.0]], np.float32)}, "one value per"),
    ({"embedding_bias_words": np.array([[b"a"]], object),
      "embedding_bias_weights": np.array([[np.nan]], np.float32)}, r"in \[-1e6, 1e6\] or -inf"),
])
def test_bad_embedding_bias_inputs_are_refused_by_name(inputs, message):
    with pytest.raises(InvalidRequest, match=f"embedding_bias_w.*{message}"):
        decode_generate({"input_ids": np.array([[1, 2]], np.int32), **inputs})


@pytest.mark.parametrize("inputs, parameters, greedy", [
    ({"temperature": [[0.8]]}, None, True),  # TensorRT-LLM's shapes: its defaults
    ({"temperature": [[0.8]]}, {"Streaming": False}, True),  # its client's parameter
    ({"temperature": [[0.8]], "top_k": [[50]]}, None, False),
    ({"temperature": [[0.8]], "top_p": [[1.0]]}, None, False),
    ({"temperature": [[0.8]]}, {"min_tokens": 1}, False),  # vLLM's names: its defaults
    ({"temperature": [[0.8]], "sampling_parameters": [[b"{}"]]}, None, False),
    ({"temperature": [0.8]}, None, False),  # the vLLM backend's shapes
])
def test_no_top_k_and_no_top_p_is_greedy_as_tensorrt_llm_reads_it_unless_vllms(
        inputs, parameters, greedy):
    """TensorRT-LLM's defaults (top_k 0 and top_p 0: greedy) for a request in
    its shapes; vLLM's (the whole distribution) where vLLM's parameters come
    or the tensors have the vLLM backend's shapes."""
    batched = np.ndim(next(iter(inputs.values()))) == 2
    prompt = {"text_input": np.array([[b"hi"]] if batched else [b"hi"], object)}
    arrays = {name: np.array(value, object if name == "sampling_parameters" else
                             np.int32 if name == "top_k" else np.float32)
              for name, value in inputs.items()}
    sampling = decode_generate({**prompt, **arrays}, parameters).request.sampling
    assert (sampling.top_k == 1) is greedy and sampling.temperature == pytest.approx(0.8)
