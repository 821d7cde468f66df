"""TensorRT-LLM's preprocessing and postprocessing interfaces
(``schema.text_steps``), for its clients that call those models by name
around its tensorrt_llm model (tensorrtllm_backend,
tools/inflight_batcher_llm/end_to_end_test.py): text to that model's token
inputs, and its output ids back to text, with the server's tokenizer; and
those token inputs read back (word lists, a dense bias, the decoder
placeholder) with its ensemble's bias words, for ``generate_io``.

They do what its models do (all_models/inflight_batcher_llm/preprocessing
and postprocessing, 1/model.py) where this server reads the result the same
way: prompts encoded as the ensemble encodes text_input, so the manual
chain's text is the ensemble's; words encoded alone without special tokens
into its [B, 2, N] word lists; bias words with them, into a vocabulary-long
bias. Unlike there, a request that leaves out half of a pair
(EMBEDDING_BIAS_WORDS without weights) or mixes in the ensemble's inputs is
refused, not read in part.

Every input has the batch dimension ([B, 1], word lists [B, N]); every
function raises InvalidRequest naming the input.
"""
from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Callable, Mapping, Sequence

import numpy as np

from ..params import BIAS_ALLOWED, bias_allowed
from ..schema import ENSEMBLE, TRTLLM_PREPROCESSING_INPUTS, InvalidRequest

if TYPE_CHECKING:  # light to import: the postprocessing model loads its tokenizer when asked
    from ..serving.generation import GenerationRequest

#: A preprocessing request that sends one of these speaks TensorRT-LLM's interface
TRTLLM_NAMES = frozenset(t.name for t in TRTLLM_PREPROCESSING_INPUTS)
_ENSEMBLE_NAMES = frozenset(ENSEMBLE.input_names)
#: What TensorRT-LLM's postprocessing model reads as true and as false in its
#: skip_special_tokens parameter (anything else: it warns, and reads true)
_TRUE, _FALSE = ("true", "1", "t", "y", "yes"), ("false", "0", "f", "n", "no")


def speaks_trtllm(inputs: Mapping[str, object]) -> bool:
    """Whether a preprocessing request uses TensorRT-LLM's interface (any of
    its inputs given); refused when it also gives the ensemble's."""
    theirs = sorted(TRTLLM_NAMES.intersection(inputs))
    if not theirs:  # the ensemble's step: nothing more to look at
        return False
    ours = sorted(_ENSEMBLE_NAMES.intersection(inputs))
    if ours:
        raise InvalidRequest(f"give TensorRT-LLM's preprocessing inputs ({theirs[0]}, ...) or "
                             f"the ensemble's ({ours[0]}, ...), not both")
    return True


def _rows(name: str, array, batch: int, dtype=None) -> np.ndarray:
    """An input as [B, N], checked to have the request's B rows."""
    rows = np.asarray(array, dtype)
    if rows.ndim != 2 or rows.shape[0] != batch:
        raise InvalidRequest(f"{name} must have shape [{batch}, N] (one row per QUERY row), "
                             f"got {list(rows.shape)}")
    return rows


def utf8_text(name: str, value) -> str:
    """A BYTES tensor's element as text; InvalidRequest naming `name` when
    it is not UTF-8."""
    if isinstance(value, (bytes, np.bytes_)):
        try:
            return bytes(value).decode("utf-8")
        except UnicodeDecodeError as error:
            raise InvalidRequest(f"{name} must be UTF-8 text: {error}") from None
    return str(value)


def _ids_column(name: str, inputs: Mapping[str, object], batch: int, default: int) -> np.ndarray:
    """END_ID or PAD_ID as a [B, 1] column, the tokenizer's where not given."""
    if name not in inputs:
        return np.full((batch, 1), default, np.int32)
    column = _rows(name, inputs[name], batch, np.int32)
    if column.shape[1] != 1:
        raise InvalidRequest(f"{name} must hold one id per row, got shape {list(column.shape)}")
    return column


def word_lists(codec, name: str, inputs: Mapping[str, object], batch: int) -> np.ndarray:
    """Each row's words in input `name` (empty ones skipped) as TensorRT-
    LLM's word list, [B, 2, N]: the ids back to back (0 padded), then each
    word's end offset (-1 padded); [B, 2, 0] for none (its
    ``_to_word_list_format``)."""
    if name not in inputs:
        return np.zeros((batch, 2, 0), np.int32)
    lists = []
    for row in _rows(name, inputs[name], batch, object):
        words = [word for word in (utf8_text(name, w) for w in row) if word]
        # a word of no ids is skipped, as there
        ids = [word for word in codec.words_ids(words, name) if word]
        lists.append(([t for word in ids for t in word], np.cumsum([len(w) for w in ids])))
    width = max(1, *(len(flat) for flat, _ in lists))
    return np.array([[np.pad(np.asarray(flat, np.int32), (0, width - len(flat))),
                      np.pad(np.asarray(ends, np.int32), (0, width - len(ends)),
                             constant_values=-1)] for flat, ends in lists], np.int32)


def embedding_bias(codec, words, weights, batch: int) -> np.ndarray:
    """Each row's bias words as a vocabulary-long bias, [B, len(tokenizer)]:
    each word's tokens (special tokens included, as its
    ``_get_embedding_bias`` encodes them) get its weight, summed; [B, 0] for
    none."""
    if words is None and weights is None:
        return np.zeros((batch, 0), np.float32)
    if words is None or weights is None:
        raise InvalidRequest("EMBEDDING_BIAS_WORDS and EMBEDDING_BIAS_WEIGHTS must be given "
                             "together")
    words = _rows("EMBEDDING_BIAS_WORDS", words, batch, object)
    weights = _rows("EMBEDDING_BIAS_WEIGHTS", weights, batch, np.float64)
    if weights.shape != words.shape:
        raise InvalidRequest(f"EMBEDDING_BIAS_WEIGHTS must hold one weight per "
                             f"EMBEDDING_BIAS_WORDS entry, got shape {list(weights.shape)} for "
                             f"{list(words.shape)}")
    if not bias_allowed(weights).all():
        raise InvalidRequest(f"EMBEDDING_BIAS_WEIGHTS must be {BIAS_ALLOWED}")
    bias = np.zeros((batch, len(codec.tokenizer)), np.float64)
    for row, (row_words, row_weights) in enumerate(zip(words, weights)):
        for word, weight in zip(row_words, row_weights):
            for token in codec.tokenize(utf8_text("EMBEDDING_BIAS_WORDS", word)):
                bias[row, token] += weight
    return bias.astype(np.float32)


def preprocess(codec, inputs: Mapping[str, object]) -> dict[str, np.ndarray]:
    """TensorRT-LLM's preprocessing: QUERY [B, 1] and its companions (name ->
    array) to the tensorrt_llm model's inputs under that model's output
    names (INPUT_ID [B, L] padded with the tokenizer's pad id,
    REQUEST_INPUT_LEN, STOP_WORDS_IDS, ...)."""
    if "QUERY" not in inputs:
        raise InvalidRequest("QUERY is required (TensorRT-LLM's preprocessing interface)")
    query = np.asarray(inputs["QUERY"], object)
    if query.ndim != 2 or query.shape[1] != 1:
        raise InvalidRequest(f"QUERY must have shape [B, 1], got {list(query.shape)}")
    batch = query.shape[0]
    if "REQUEST_OUTPUT_LEN" not in inputs:
        raise InvalidRequest("REQUEST_OUTPUT_LEN is required with QUERY (TensorRT-LLM's "
                             "preprocessing interface)")
    output_len = _ids_column("REQUEST_OUTPUT_LEN", inputs, batch, 0)
    tokenizer = codec.tokenizer
    end_id = int(tokenizer.eos_token_id)
    pad_id = end_id if tokenizer.pad_token_id is None else int(tokenizer.pad_token_id)
    prompts = []
    for text in (utf8_text("QUERY", q) for q in query[:, 0]):
        if not text:
            raise InvalidRequest("QUERY must be a non-empty string")
        prompts.append(codec.encode(text))
    width = max(map(len, prompts))
    pads = _ids_column("PAD_ID", inputs, batch, pad_id)
    return {
        "INPUT_ID": np.array([ids + [pad_id] * (width - len(ids)) for ids in prompts], np.int32),
        "REQUEST_INPUT_LEN": np.array([[len(ids)] for ids in prompts], np.int32),
        # a decoder-only model's placeholder: its tensorrt_llm model reads none
        "DECODER_INPUT_ID": pads.copy(),
        "REQUEST_DECODER_INPUT_LEN": np.ones((batch, 1), np.int32),
        "BAD_WORDS_IDS": word_lists(codec, "BAD_WORDS_DICT", inputs, batch),
        "STOP_WORDS_IDS": word_lists(codec, "STOP_WORDS_DICT", inputs, batch),
        "EMBEDDING_BIAS": embedding_bias(codec, inputs.get("EMBEDDING_BIAS_WORDS"),
                                         inputs.get("EMBEDDING_BIAS_WEIGHTS"), batch),
        "REQUEST_OUTPUT_LEN": output_len,
        "OUT_END_ID": _ids_column("END_ID", inputs, batch, end_id),
        "OUT_PAD_ID": pads,
    }


def postprocess(codec, tokens, lengths, skip_special: bool = True) -> np.ndarray:
    """TensorRT-LLM's postprocessing: TOKENS_BATCH [B, beams, T] and
    SEQUENCE_LENGTH [B, beams] to each sequence's text, UTF-8 bytes
    (special tokens' text left out when `skip_special`), flat over the batch
    and the beams, [B * beams], as its model writes them: its clients read
    ``as_numpy("OUTPUT")[0].decode()`` (as the llm model's text_output)."""
    tokens, lengths = np.asarray(tokens), np.asarray(lengths)
    if tokens.ndim != 3:
        raise InvalidRequest(f"TOKENS_BATCH must have shape [B, beams, T], got "
                             f"{list(tokens.shape)}")
    if lengths.shape != tokens.shape[:2]:
        raise InvalidRequest(f"SEQUENCE_LENGTH must have shape {list(tokens.shape[:2])} (one "
                             f"length per TOKENS_BATCH sequence), got {list(lengths.shape)}")
    if ((lengths < 0) | (lengths > tokens.shape[2])).any():
        raise InvalidRequest(f"SEQUENCE_LENGTH must be in [0, {tokens.shape[2]}] (TOKENS_BATCH's "
                             f"length), got {lengths.tolist()}")
    # The tokenizer would drop an id it does not know without a word (or
    # fail on a negative one): refused. Its bound is the tokenizer's, not the
    # model's padded vocabulary (Qwen2.5: 151,665 of 151,936 rows have text).
    known = len(codec.tokenizer)
    within = np.arange(tokens.shape[2]) < lengths[..., None]
    bad = within & ((tokens < 0) | (tokens >= known))
    if bad.any():
        position = tuple(int(i) for i in np.argwhere(bad)[0])
        raise InvalidRequest(f"TOKENS_BATCH ids must be in [0, {known}) (the tokenizer's), got "
                             f"{int(tokens[position])} at {list(position)}")
    texts = [codec.decode(ids[:length].tolist(), not skip_special).encode("utf-8")
             for ids, length in zip(tokens.reshape(lengths.size, tokens.shape[2]),
                                    lengths.reshape(-1))]
    return np.array(texts, dtype=object)


def skip_special_tokens(value: str | None) -> bool:
    """The postprocessing model's skip_special_tokens parameter, read as
    TensorRT-LLM reads it (true when not set); a value it does not know is
    refused here, where it warns and reads true."""
    if value is None or value.lower() in _TRUE:
        return True
    if value.lower() in _FALSE:
        return False
    raise ValueError(f"postprocessing's skip_special_tokens must be one of "
                     f"{', '.join(_TRUE + _FALSE)}, got {value!r}")


# TensorRT-LLM's tensorrt_llm model's inputs that its preprocessing makes,
# read back (generate_io takes them)

def word_list(name: str, array) -> list[tuple[int, ...]]:
    """TensorRT-LLM's word list, [1, 2, N] (or [2, N]): row 0 the words' ids
    back to back, row 1 each word's end offset, ascending, then -1s; read as
    its backend reads it (tensorrtllm_backend, inflight_batcher_llm/src/
    utils.cc, ``convertWordList``), offsets strictly increasing: a word of
    no ids is refused (an empty stop word there ends a generation at once)."""
    lists = np.asarray(array)
    if lists.ndim == 3 and lists.shape[0] == 1:
        lists = lists[0]
    if lists.ndim != 2 or lists.shape[0] != 2:
        raise InvalidRequest(f"{name} must have shape [1, 2, N] (ids, then end offsets), got "
                             f"{list(np.shape(array))}")
    ids, ends = lists[0].tolist(), lists[1].tolist()
    count = ends.index(-1) if -1 in ends else len(ends)
    if any(end != -1 for end in ends[count:]):
        raise InvalidRequest(f"{name}'s offsets (its second row) must end with -1s only, got "
                             f"{ends}")
    ends = ends[:count]
    if any(not 0 < end <= len(ids) for end in ends) or any(
            later <= end for end, later in zip(ends, ends[1:])):
        raise InvalidRequest(f"{name}'s offsets (its second row) must strictly increase within "
                             f"[1, {len(ids)}] (each word one id or more), got {ends}")
    return [tuple(ids[start:end]) for start, end in zip([0, *ends], ends)]


def dense_bias(array) -> np.ndarray | None:
    """TensorRT-LLM's dense embedding_bias ([1, V'] or [V']); None when empty
    (its preprocessing sends [1, 0] for no bias words)."""
    bias = np.asarray(array, np.float64).reshape(-1)
    if not bias.size:
        return None
    if not bias_allowed(bias).all():
        raise InvalidRequest(f"embedding_bias must be {BIAS_ALLOWED}")
    return bias


def add_embedding_bias(request: GenerationRequest, bias: np.ndarray,
                       vocab_size: int) -> GenerationRequest:
    """`request` with TensorRT-LLM's dense embedding bias added to its
    logit_bias (its nonzero entries, summed with what is there). Entries
    past the vocabulary may be given as zeros (its preprocessing sizes the
    bias by the tokenizer, which may count more ids than the model). Raises
    InvalidRequest for a nonzero one."""
    tokens = np.flatnonzero(bias)
    if tokens.size and tokens[-1] >= vocab_size:
        raise InvalidRequest(f"embedding_bias must be 0 past the vocabulary (V = {vocab_size}), "
                             f"got {bias[tokens[-1]]} at id {tokens[-1]}")
    return _with_bias(request, ((token, float(bias[token])) for token in tokens.tolist()),
                      "embedding_bias")


def check_decoder_input(present: Mapping[str, object]) -> None:
    """decoder_input_ids, read by TensorRT-LLM for encoder-decoder models
    only (utils.cc, ``createRequestsFromInputTensors``): its preprocessing
    sends one pad id as a placeholder (and its length, 1, as
    decoder_input_lengths), taken here and not read; a longer decoder prompt
    asks for a model this server does not serve."""
    if "decoder_input_ids" in present and np.size(present["decoder_input_ids"]) > 1:
        raise InvalidRequest("decoder_input_ids is an encoder-decoder model's decoder prompt; "
                             "every model here is decoder-only: send at most one id (TensorRT-"
                             "LLM's preprocessing's placeholder) or none")
    if "decoder_input_lengths" in present and \
            np.asarray(present["decoder_input_lengths"]).reshape(-1).tolist() != [1]:
        raise InvalidRequest("decoder_input_lengths must be 1 (TensorRT-LLM's preprocessing's "
                             "placeholder's length): every model here is decoder-only")


def word_bias(words, weights) -> tuple[tuple[str, float], ...]:
    """embedding_bias_words [1, N] and embedding_bias_weights [1, N] as
    (word, weight) pairs."""
    if words is None and weights is None:
        return ()
    if words is None or weights is None:
        raise InvalidRequest("embedding_bias_words and embedding_bias_weights must be given "
                             "together")
    words = [utf8_text("embedding_bias_words", w) for w in np.asarray(words, object).reshape(-1)]
    weights = np.asarray(weights, np.float64).reshape(-1)
    if weights.size != len(words):
        raise InvalidRequest(f"embedding_bias_weights must hold one value per "
                             f"embedding_bias_words entry, got {weights.size} for {len(words)}")
    if not bias_allowed(weights).all():
        raise InvalidRequest(f"embedding_bias_weights must be {BIAS_ALLOWED}")
    return tuple(zip(words, weights.tolist()))


def add_word_bias(request: GenerationRequest, pairs: Sequence[tuple[str, float]],
                  tokenize: Callable[[str], list[int]]) -> GenerationRequest:
    """`request` with TensorRT-LLM's embedding bias added to its logit_bias:
    each word's tokens (``tokenize``, the tokenizer's special tokens
    included, as its preprocessing model's ``_get_embedding_bias`` encodes a
    word) get the word's weight, once per occurrence, summed over the words
    and with the logit_bias already there."""
    return _with_bias(request, ((token, weight) for word, weight in pairs
                                for token in tokenize(word)), "embedding_bias_weights")


def _with_bias(request: GenerationRequest, additions, name: str) -> GenerationRequest:
    """`request` with (token, value) `additions` summed into its logit_bias.
    Raises InvalidRequest naming `name` and logit_bias where a sum leaves
    the allowed range (each was in it alone)."""
    bias = dict(request.sampling.logit_bias)
    for token, value in additions:
        bias[token] = bias.get(token, 0.0) + value
    outside = [token for token, value in bias.items() if not bias_allowed(value)]
    if outside:
        raise InvalidRequest(f"{name} plus logit_bias must stay {BIAS_ALLOWED} for each token, "
                             f"got {bias[outside[0]]} for token {outside[0]}")
    return dataclasses.replace(request, sampling=dataclasses.replace(request.sampling,
                                                                     logit_bias=bias))
