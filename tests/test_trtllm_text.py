"""TensorRT-LLM's preprocessing and postprocessing interfaces
(triton.trtllm_text), without a server: its tensors, in its shapes, made
from the server's tokenizer, and read back as the tensorrt_llm model reads
them (generate_io)."""
import re

import numpy as np
import pytest

from simple_sampler.schema import InvalidRequest, TRTLLM_PREPROCESSING_OUTPUTS
from simple_sampler.serving.text import TextCodec
from simple_sampler.triton.generate_io import decode_generate
from simple_sampler.triton.trtllm_text import (postprocess, preprocess, skip_special_tokens,
                                               speaks_trtllm)

from fakes import END_ID, VOCAB, FakeTokenizer


class PaddedTokenizer(FakeTokenizer):
    """The fake's one-character tokens, with a pad token (id 27, ' ')
    and a length, as a Hugging Face tokenizer has."""

    pad_token_id = 27

    def __len__(self):
        return VOCAB


class UnpaddedTokenizer(PaddedTokenizer):
    pad_token_id = None


def column(*values, dtype=np.int32):
    return np.array([[v] for v in values], dtype)


def queries(*texts):
    return column(*(t.encode() for t in texts), dtype=object)


def test_a_query_becomes_the_tensorrt_llm_models_inputs_in_its_shapes():
    """Prompts a row each, padded with the pad id (the end id where the
    tokenizer has none), their lengths, a one-id decoder placeholder, the
    output length handed back; every output of its interface, no other."""
    codec = TextCodec(PaddedTokenizer())
    out = preprocess(codec, {"QUERY": queries("abc", "d"),
                             "REQUEST_OUTPUT_LEN": column(8, 4)})
    assert set(out) == {t.name for t in TRTLLM_PREPROCESSING_OUTPUTS}
    assert out["INPUT_ID"].tolist() == [[1, 2, 3], [4, 27, 27]]
    assert out["REQUEST_INPUT_LEN"].tolist() == [[3], [1]]
    assert out["DECODER_INPUT_ID"].tolist() == [[27], [27]]
    assert out["REQUEST_DECODER_INPUT_LEN"].tolist() == [[1], [1]]
    assert out["REQUEST_OUTPUT_LEN"].tolist() == [[8], [4]]
    assert out["OUT_END_ID"].tolist() == [[END_ID], [END_ID]]
    assert out["OUT_PAD_ID"].tolist() == [[27], [27]]
    assert out["STOP_WORDS_IDS"].shape == out["BAD_WORDS_IDS"].shape == (2, 2, 0)
    assert out["EMBEDDING_BIAS"].shape == (2, 0)
    assert all(array.dtype == np.int32 for name, array in out.items() if name != "EMBEDDING_BIAS")
    given = preprocess(TextCodec(UnpaddedTokenizer()), {
        "QUERY": queries("ab", "c"), "REQUEST_OUTPUT_LEN": column(1, 1),
        "END_ID": column(5, 6), "PAD_ID": column(7, 9)})
    assert given["INPUT_ID"].tolist() == [[1, 2], [3, END_ID]]  # the tokenizer's: its end id
    assert given["OUT_END_ID"].tolist() == [[5], [6]] and given["OUT_PAD_ID"].tolist() == [[7], [9]]
    assert given["DECODER_INPUT_ID"].tolist() == [[7], [9]]


def test_its_word_lists_are_read_back_as_the_same_words_by_the_tensorrt_llm_model():
    """STOP_WORDS_IDS / BAD_WORDS_IDS ([B, 2, N], each row padded to the
    longest) give the tensorrt_llm model (generate_io) each row's words as
    the tokenizer encodes them alone; empty strings name none."""
    codec = TextCodec(PaddedTokenizer())
    out = preprocess(codec, {
        "QUERY": queries("a", "b"), "REQUEST_OUTPUT_LEN": column(4, 4),
        "STOP_WORDS_DICT": np.array([[b"xy", b"", b"z"], [b"", b"", b""]], object),
        "BAD_WORDS_DICT": np.array([[b"q", b"", b""], [b"rst", b"u", b""]], object)})
    assert out["STOP_WORDS_IDS"].tolist() == [[[24, 25, 26], [2, 3, -1]], [[0, 0, 0], [-1] * 3]]
    for row, (stops, bans) in enumerate([([(24, 25), (26,)], [(17,)]),
                                         ([], [(18, 19, 20), (21,)])]):
        request = decode_generate({"input_ids": out["INPUT_ID"][row:row + 1],
                                   "stop_words_list": out["STOP_WORDS_IDS"][row:row + 1],
                                   "bad_words_list": out["BAD_WORDS_IDS"][row:row + 1]}).request
        assert request.stop_words_list == stops and request.bad_words_list == bans


def test_its_embedding_bias_sums_each_words_weight_on_its_tokens():
    codec = TextCodec(PaddedTokenizer())
    out = preprocess(codec, {
        "QUERY": queries("a"), "REQUEST_OUTPUT_LEN": column(4),
        "EMBEDDING_BIAS_WORDS": np.array([[b"ab", b"b"]], object),
        "EMBEDDING_BIAS_WEIGHTS": np.array([[1.5, -2.0]], np.float32)})
    bias = out["EMBEDDING_BIAS"]
    assert bias.shape == (1, VOCAB) and bias.dtype == np.float32
    assert {i: float(v) for i, v in enumerate(bias[0]) if v} == {1: 1.5, 2: -0.5}


@pytest.mark.parametrize("inputs, message", [
    ({"REQUEST_OUTPUT_LEN": column(4)}, "QUERY is required"),
    ({"QUERY": queries("a")}, "REQUEST_OUTPUT_LEN is required with QUERY"),
    ({"QUERY": queries(""), "REQUEST_OUTPUT_LEN": column(4)}, "QUERY must be a non-empty"),
    ({"QUERY": np.array([b"a"], object), "REQUEST_OUTPUT_LEN": column(4)},
     r"QUERY must have shape \[B, 1\], got \[1\]"),
    ({"QUERY": queries("a", "b"), "REQUEST_OUTPUT_LEN": column(4)},
     r"REQUEST_OUTPUT_LEN must have shape \[2, N\]"),
    ({"QUERY": queries("a"), "REQUEST_OUTPUT_LEN": column(4),
      "STOP_WORDS_DICT": np.array([[b"x"], [b"y"]], object)}, r"STOP_WORDS_DICT must have shape \[1"),
    ({"QUERY": queries("a"), "REQUEST_OUTPUT_LEN": column(4),
      "EMBEDDING_BIAS_WORDS": np.array([[b"x"]], object)}, "must be given together"),
    ({"QUERY": queries("a"), "REQUEST_OUTPUT_LEN": column(4),
      "EMBEDDING_BIAS_WORDS": np.array([[b"x", b"y"]], object),
      "EMBEDDING_BIAS_WEIGHTS": np.array([[1.0]], np.float32)}, "one weight per"),
    ({"QUERY": queries("a"), "REQUEST_OUTPUT_LEN": column(4),
      "EMBEDDING_BIAS_WORDS": np.array([[b"x"]], object),
      "EMBEDDING_BIAS_WEIGHTS": np.array([[np.nan]], np.float32)}, "EMBEDDING_BIAS_WEIGHTS must be"),
])
def test_a_bad_preprocessing_request_is_refused_by_name(inputs, message):
    with pytest.raises(InvalidRequest, match=message):
        preprocess(TextCodec(PaddedTokenizer()), inputs)


def test_a_request_speaks_one_interface():
    assert speaks_trtllm({"QUERY": 1, "REQUEST_OUTPUT_LEN": 1})
    assert not speaks_trtllm({"text_input": 1, "max_tokens": 1})
    with pytest.raises(InvalidRequest, match=r"QUERY, \.\.\.\) or the ensemble's \(text_input"):
        speaks_trtllm({"QUERY": 1, "text_input": 1})


def test_postprocessing_decodes_each_sequence_to_its_length():
    codec = TextCodec(PaddedTokenizer())
    tokens = np.array([[[1, 2, 0, 3]], [[4, 5, 6, 7]]], np.int32)
    text = postprocess(codec, tokens, np.array([[4], [2]], np.int32))
    assert text.shape == (2,) and text.tolist() == [b"abc", b"de"]  # flat, as there
    assert postprocess(codec, tokens, np.array([[4], [0]]), skip_special=False).tolist() == \
        [b"ab\0c", b""]
    beams = postprocess(codec, np.array([[[1, 2], [3, 4]]], np.int32), np.array([[1, 2]]))
    assert beams.tolist() == [b"a", b"cd"]
    assert postprocess(codec, np.zeros((1, 1, 0), np.int32), np.array([[0]])).tolist() == [b""]
    with pytest.raises(InvalidRequest, match=r"SEQUENCE_LENGTH must be in \[0, 4\]"):
        postprocess(codec, tokens, np.array([[5], [1]]))
    with pytest.raises(InvalidRequest, match=r"SEQUENCE_LENGTH must have shape \[2, 1\]"):
        postprocess(codec, tokens, np.array([4, 1]))
    with pytest.raises(InvalidRequest, match=r"TOKENS_BATCH must have shape \[B, beams, T\]"):
        postprocess(codec, tokens[0], np.array([[4]]))
    for bad in (-1, VOCAB):
        message = f"TOKENS_BATCH ids must be in [0, {VOCAB}) (the tokenizer's), got {bad} at [1, 0, 1]"
        with pytest.raises(InvalidRequest, match=re.escape(message)):
            postprocess(codec, np.array([[[1, 2, 0, 3]], [[4, bad, 6, 7]]], np.int32), np.array([[4], [2]]))
    # beyond a sequence's length, ids are not read: padding there is any value
    assert postprocess(codec, np.array([[[1, -1, VOCAB]]], np.int32), np.array([[1]])).tolist() == [b"a"]


def test_skip_special_tokens_is_read_as_tensorrt_llm_reads_it_and_a_typo_refused():
    assert skip_special_tokens(None) and skip_special_tokens("Yes") and skip_special_tokens("1")
    assert not skip_special_tokens("false") and not skip_special_tokens("N")
    with pytest.raises(ValueError, match="skip_special_tokens must be one of"):
        skip_special_tokens("ture")
