"""The user-facing generation tensors (TensorRT-LLM's ensemble names),
decoded into a ``GenerationRequest`` (the responses' tensors:
``generate_outputs``).

Every input here has batch dimension 1 (one prompt: a request of several is
split first, ``prompt_batch``): scalars are [1, 1], word lists [1, N] (or [1]
and [N] from a model of max_batch_size 0: the vLLM backend's shapes). The
tensors' names, dtypes, defaults and ranges are ``schema.LLM``'s (tabulated
in docs/TENSORS.md). TensorRT-LLM's inputs that its clients send take the
values that mean what this server does (``ONE_VALUE``, ``ALIASES``,
``add_word_bias``).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping

import numpy as np

from ..params import SamplingParams
from ..schema import (CORE_ALIASES, IGNORE_EOS, LLM, NUM_TOP_LOGPROBS, PROMPT_LOGPROBS,
                      VLLM_EXTRA_OUTPUTS, InvalidRequest)
from ..serving.generation import GenerationRequest
from ..serving.structured import Guide
from ..settings import MAX_GENERATIONS
from .trtllm_text import check_decoder_input, dense_bias, utf8_text, word_bias, word_list
from .vllm_params import SAMPLING_PARAMETERS, TRTLLM_PARAMETERS, vllm_inputs

#: input -> SamplingParams field, for the plain numeric parameters (the
#: seed's two inputs are reconciled first).
SAMPLING_INPUTS = {t.name: t.param for t in LLM.inputs if t.param and t.param != "seed"}
FLAG_INPUTS = tuple(t.name for t in LLM.inputs if t.dtype == "BOOL")
INPUT_NAMES = LLM.input_names
#: TensorRT-LLM's end_id for "none": no token ends the generation
NO_END_ID = -1


@dataclass
class DecodedRequest:
    """A generation request plus how its answer is to be delivered."""

    request: GenerationRequest
    stream: bool
    exclude_input_in_output: bool
    #: tokens per streamed response; None: the server's (LlmSettings.stream_interval)
    stream_interval: int | None = None
    #: the inputs vLLM's sampling parameters carried, and where each was sent
    #: (``vllm_params.as_sent`` names them so in a range's refusal)
    sent_as: dict[str, str] = field(default_factory=dict)
    #: the vLLM backend's additional outputs asked for (its return_* inputs),
    #: in every response (``encode_event``'s ``extra``)
    extra_outputs: frozenset[str] = frozenset()
    #: the client's return_log_probs: a stream's responses before its last
    #: carry the logprobs then (``encode_event``'s ``logprobs``)
    logprobs: bool = False
    #: TensorRT-LLM's embedding bias, (word, weight) pairs, for ``add_word_bias``
    #: to add to the request's logit_bias once the words are tokenized
    word_bias: tuple[tuple[str, float], ...] = ()
    #: TensorRT-LLM's num_return_sequences: generations of this prompt
    #: (``prompt_batch.generations``)
    sequences: int = 1
    #: sent in TensorRT-LLM's tensorrt_llm model's dialect (request_output_len
    #: given): answered in that model's outputs (``trtllm_core.core_outputs``)
    core: bool = False
    #: TensorRT-LLM's dense embedding bias ([V'] float64, V' > 0), for
    #: ``add_embedding_bias`` to add once the vocabulary is known
    embedding_bias: np.ndarray | None = None


def _single(name: str, array) -> object:
    """The one value of a [1, 1] (or [1]) input."""
    values = np.asarray(array).reshape(-1)
    if values.size != 1:
        raise InvalidRequest(f"{name} must hold one value per request (shape [1, 1]), "
                         f"got shape {list(np.shape(array))}")
    value = values[0]
    return value.item() if isinstance(value, np.generic) else value


def _words(name: str, array) -> list[str]:
    array = np.asarray(array, dtype=object)
    if array.ndim == 2 and array.shape[0] != 1:
        raise InvalidRequest(f"{name} must be one list of strings per request, got shape "
                         f"{list(array.shape)}")
    # empty strings name no word: skipped, as TensorRT-LLM's preprocessing
    # skips a word that encodes to no ids (tensorrtllm_backend,
    # all_models/inflight_batcher_llm/preprocessing/1/model.py,
    # _to_word_list_format), so its README's `"stop_words": ""` is no stop word
    return [word for word in (utf8_text(name, w) for w in array.reshape(-1)) if word]


def _logit_bias(ids, values) -> dict[int, float]:
    """logit_bias_ids [1, N] and logit_bias_values [1, N] as {token id: bias};
    the ids' range is checked against the vocabulary by the decoder."""
    if ids is None and values is None:
        return {}
    if ids is None or values is None:
        raise InvalidRequest("logit_bias_ids and logit_bias_values must be given together")
    ids, values = np.asarray(ids).reshape(-1), np.asarray(values).reshape(-1)
    if ids.size != values.size:
        raise InvalidRequest(f"logit_bias_values must hold one value per logit_bias_ids entry, got "
                         f"{values.size} for {ids.size}")
    bias = {int(t): float(v) for t, v in zip(ids, values)}
    if len(bias) != ids.size:
        raise InvalidRequest("logit_bias_ids must name each token at most once")
    return bias


def _add_vllm_inputs(present: dict[str, object], parameters) -> dict[str, str]:
    """Add the inputs vLLM's sampling parameters carry (the
    ``sampling_parameters`` input, taken out, and `parameters`) to
    `present`, refusing one sent as an input too with another value, and
    vLLM's min_tokens above max_tokens; where each was sent."""
    vllm, sent_as = vllm_inputs(present.pop(SAMPLING_PARAMETERS, None), parameters)
    for name in sorted(set(vllm) & set(present)):  # genai-perf's --extra-inputs max_tokens:16
        if not np.array_equal(np.asarray(present[name]).reshape(-1), vllm[name].reshape(-1)):
            raise InvalidRequest(f"{name} is given twice, with different values: as an input "
                                 f"and by the vLLM sampling parameter {sent_as[name]}")
    present.update(vllm)
    return sent_as


def _check_min_tokens(present: Mapping[str, object], sent_as: Mapping[str, str]) -> None:
    """min_length sent by its other name, min_tokens (vLLM's, or TensorRT-LLM's
    input), is held to vLLM's rule (SamplingParams._verify_args): at most
    max_tokens. min_length itself is not (TensorRT-LLM's old name)."""
    if "min_length" in sent_as:
        least, most = _single("min_length", present["min_length"]), (
            _single("max_tokens", present["max_tokens"]) if "max_tokens" in present
            else GenerationRequest.max_tokens)
        if isinstance(least, int) and isinstance(most, int) and least > most:
            raise InvalidRequest(f"{sent_as['min_length']} ({least}) must be at most "
                                 f"{sent_as.get('max_tokens', 'max_tokens')} ({most})")


def _prompt(present: Mapping[str, object], chat: bool) -> tuple[str | None, list[int] | None]:
    """(text, prompt ids) of a request: text_input's, or input_ids' ([1, L],
    [L] from a preprocessing model of max_batch_size 0)."""
    if "input_ids" in present:
        # neither is dropped unsaid: the ids are the prompt as they are
        if "text_input" in present:
            raise InvalidRequest("give one of text_input and input_ids, not both")
        if chat:
            raise InvalidRequest("apply_chat_template applies to text_input; input_ids go to "
                                 "the model as they are")
        ids = np.asarray(present["input_ids"])
        if not (ids.ndim == 2 and ids.shape[0] == 1 or ids.ndim == 1):  # [L]: max_batch_size 0
            raise InvalidRequest(f"input_ids must have shape [1, L], got {list(ids.shape)}")
        text, prompt_ids = None, [int(t) for t in ids.reshape(-1)]
    elif "text_input" in present:
        text = utf8_text("text_input", _single("text_input", present["text_input"]))
        prompt_ids = None
        if not text:
            raise InvalidRequest("text_input must be a non-empty string")
    else:
        raise InvalidRequest("text_input (or input_ids) is required")
    return text, prompt_ids


def decode_generate(inputs: Mapping[str, object], parameters: str | Mapping | None = None,
                    exclude_input: bool = False) -> DecodedRequest:
    """Turn the tensors of one request into a GenerationRequest.

    inputs: name -> numpy array (absent optional inputs missing or None);
    parameters: the request's. vLLM's sampling parameters, in the
    ``sampling_parameters`` input or the parameters, count as the inputs
    that carry them (``vllm_params``). ``input_ids`` (INT32 [1, L], from
    the preprocessing model) replaces ``text_input`` when given. Raises
    InvalidRequest naming the input; ranges are checked by
    ``GenerationRequest.validate`` when the decoder takes it. `exclude_input`:
    exclude_input_in_output where the request does not say (the server's).

    Which defaults: TensorRT-LLM's (no top_k and no top_p is greedy, as its
    sampling reads top_k 0 with top_p 0, ``top_p_zero_is_off``) in its
    shapes (the batch dimension) or its tensorrt_llm model's dialect
    (request_output_len), unless vLLM's sampling parameters come; vLLM's (the
    whole distribution at the temperature) with those, or in the vLLM
    backend's shapes (no batch dimension).
    """
    present = {k: v for k, v in inputs.items() if v is not None}
    vllm_shaped = _vllm_shaped(present)
    sent_as = _add_vllm_inputs(present, parameters)
    vllm_dialect = vllm_shaped or any(place not in TRTLLM_PARAMETERS
                                      for place in sent_as.values())
    unknown = sorted(set(present) - set(INPUT_NAMES))
    if unknown:
        raise InvalidRequest(f"unknown input {unknown[0]}")
    # TensorRT-LLM's tensorrt_llm model's dialect: its required input given
    core = "request_output_len" in present
    _check_other_names(present, sent_as)
    if (core or not vllm_dialect) and "top_p" not in present:
        present["top_p"] = np.zeros((1, 1), np.float32)
    top_p_zero_is_off(present, sent_as)
    _check_min_tokens(present, sent_as)
    check_decoder_input(present)
    flags = {name: bool(_single(name, present[name])) if name in present
             else exclude_input and name == "exclude_input_in_output" for name in FLAG_INPUTS}
    text, prompt_ids = _prompt(present, flags["apply_chat_template"])
    # none given: the model's end ids, but TensorRT-LLM's tensorrt_llm model's
    # default is -1, no end id (docs/model_config.md; its ensemble passes the
    # tokenizer's); the decoder reads -1 as none
    end_id = (int(_single("end_id", present["end_id"])) if "end_id" in present
              else NO_END_ID if core else None)
    top = (_single(NUM_TOP_LOGPROBS.name, present[NUM_TOP_LOGPROBS.name])
           if NUM_TOP_LOGPROBS.name in present else 0)
    if top and not flags["return_log_probs"]:  # as validate, before the flag it may set
        raise InvalidRequest(f"{NUM_TOP_LOGPROBS.name} needs return_log_probs true")
    request = GenerationRequest(
        text=text, prompt_ids=prompt_ids, chat=flags["apply_chat_template"],
        max_tokens=int(_single("max_tokens", present["max_tokens"])) if "max_tokens" in present
        else GenerationRequest.max_tokens,
        sampling=_sampling(present),
        end_id=end_id,
        ignore_end=flags[IGNORE_EOS.name],
        include_stop=flags["include_stop_str_in_output"],
        # the one flag true unless sent (vLLM's default)
        skip_special=bool(_single("skip_special_tokens", present["skip_special_tokens"]))
        if "skip_special_tokens" in present else True,
        **_stop_and_bad_words(present, sent_as),
        # the running sum is of the logprobs this computes
        return_log_probs=flags["return_log_probs"] or flags["return_cumulative_logprob"],
        num_top_logprobs=top,
        prompt_logprobs=(_single(PROMPT_LOGPROBS.name, present[PROMPT_LOGPROBS.name])
                         if PROMPT_LOGPROBS.name in present else None),
        **_masks(present),
    )
    interval = None
    if "stream_interval" in present:
        interval = _single("stream_interval", present["stream_interval"])
        if isinstance(interval, bool) or not isinstance(interval, int) or interval < 1:
            raise InvalidRequest(f"stream_interval must be an integer >= 1, got {interval!r}")
    return DecodedRequest(request, flags["stream"], flags["exclude_input_in_output"], interval,
                          sent_as, _extra_outputs(flags), flags["return_log_probs"],
                          word_bias(present.get("embedding_bias_words"),
                                    present.get("embedding_bias_weights")),
                          _sequences(present), core and _core_outputs_only(present, flags),
                          dense_bias(present["embedding_bias"])
                          if "embedding_bias" in present else None)


def _stop_and_bad_words(present: Mapping[str, object], sent_as: Mapping[str, str]) -> dict:
    """The request's stop and bad words, as text and as token ids (TensorRT-
    LLM's word lists), by their GenerationRequest fields."""
    words = {name: _words(name, present[name]) for name in ("stop_words", "bad_words")
             if name in present}
    words.update((name, word_list(name, present[name]))
                 for name in ("stop_words_list", "bad_words_list") if name in present)
    # the stop_words input is TensorRT-LLM's, vLLM's stop (its parameter) matches text;
    # vLLM's bad_words also ban each word after a space
    return {**words, "stop_words_as_tokens": "stop_words" not in sent_as,
            "bad_words_spaced": "bad_words" in sent_as}


def _masks(present: Mapping[str, object]) -> dict:
    """What masks the request's rows (``structured``), by its
    GenerationRequest fields: its grammar and its allowed_token_ids."""
    allowed = present.get("allowed_token_ids")
    return {"guide": _guide(present), "allowed_token_ids": None if allowed is None
            else [int(t) for t in np.asarray(allowed).reshape(-1)]}


def _guide(present: Mapping[str, object]) -> Guide | None:
    """The request's grammar (TensorRT-LLM's two inputs; vLLM's
    structured_outputs and guided_* parameters come as them: vllm_params),
    or None; its text checked when the decoder compiles it."""
    kind, guide = (utf8_text(name, _single(name, present[name])) if name in present else None
                   for name in ("guided_decoding_guide_type", "guided_decoding_guide"))
    if kind is None:
        if guide:
            raise InvalidRequest("guided_decoding_guide needs guided_decoding_guide_type")
        return None
    return Guide(kind, guide or "")


def _vllm_shaped(present: Mapping[str, object]) -> bool:
    """Whether a request takes vLLM's defaults by its form alone: it sends
    vLLM's JSON (the sampling_parameters input), or its tensors have no
    batch dimension (the vLLM backend's shapes, a server of
    generate_max_batch_size 0). Its vLLM parameters, read next, do too."""
    return SAMPLING_PARAMETERS in present or all(np.ndim(v) < 2 for v in present.values())


def _sampling(present: Mapping[str, object]) -> SamplingParams:
    """The request's sampling parameters (its seed under either name)."""
    sampling = {field: _single(name, present[name])
                for name, field in SAMPLING_INPUTS.items() if name in present}
    seeds = [name for name in ("random_seed", "seed") if name in present]
    if len(seeds) == 2 and _single("seed", present["seed"]) != _single("random_seed",
                                                                        present["random_seed"]):
        raise InvalidRequest("seed and random_seed are the same parameter; they disagree")
    if seeds:
        sampling["seed"] = int(_single(seeds[0], present[seeds[0]]))
    sampling["logit_bias"] = _logit_bias(present.get("logit_bias_ids"),
                                         present.get("logit_bias_values"))
    if "stop_token_ids" in present:
        sampling["stop_token_ids"] = [int(t) for t in np.asarray(present["stop_token_ids"])
                                      .reshape(-1)]
    return SamplingParams(**sampling)


def _core_outputs_only(present: Mapping[str, object], flags: Mapping[str, bool]) -> bool:
    """True, for a request in TensorRT-LLM's tensorrt_llm model's dialect
    (request_output_len given): it is answered in that model's outputs,
    which carry no top logprobs, prompt scores or vLLM backend's additional
    outputs, so an input asking for those is refused, not dropped."""
    asked = [name for name in (NUM_TOP_LOGPROBS.name, PROMPT_LOGPROBS.name) if name in present]
    asked += [name for name in VLLM_EXTRA_OUTPUTS if flags[name]]
    if asked:
        raise InvalidRequest(f"{asked[0]} asks for an output that TensorRT-LLM's tensorrt_llm "
                             f"model's answer (request_output_len given) does not carry; send "
                             f"max_tokens instead of request_output_len for the llm model's "
                             f"outputs")
    # here, not in the decoder's range check, whose hint (0 with prompt_logprobs)
    # this dialect cannot take
    if _single("request_output_len", present["max_tokens"]) == 0:
        raise InvalidRequest("request_output_len must be at least 1, got 0")
    return True


def top_p_zero_is_off(present: dict[str, object], sent_as: Mapping[str, str]) -> None:
    """top_p 0 read as TensorRT-LLM reads it, in place: no top-p, and with
    top_k 0 or -1 (or none) greedy, top_k 1. Its tensorrt_llm model drops a
    runtime_top_p <= 0 (``get_sampling_config_from_request``; its ensemble
    hands it top_p as that) and its sampling kernels take top_k 0 with top_p
    0 as top_k 1 (``regularizeTopKTopP``, tensorrt_llm::kernels; a top_k
    below 0 is clipped to 0 there). Its clients send top_p 0 with top_k 1
    unless told otherwise (inflight_batcher_llm_client.py). vLLM's top_p (in
    sampling_parameters or the request's parameters, as the vLLM backend
    reads them) keeps vLLM's range, (0, 1]: its check refuses 0."""
    place = sent_as.get("top_p")  # none: the top_p input's; else vLLM's or the alias'
    if "top_p" not in present or place not in (None, "runtime_top_p"):
        return
    name = place or "top_p"
    top_p = _single(name, present["top_p"])
    if isinstance(top_p, bool) or not isinstance(top_p, (int, float)) or not 0 <= top_p <= 1:
        raise InvalidRequest(f"{name} must be in [0, 1] (0 is no top-p, as TensorRT-LLM reads "
                             f"it), got {top_p!r}")
    if top_p == 0:
        del present["top_p"]
        if "top_k" not in present or _single("top_k", present["top_k"]) in (0, -1):
            present["top_k"] = np.array([[1]], np.int32)


def _sequences(present: Mapping[str, object]) -> int:
    """num_return_sequences, 0 read as 1 (as TensorRT-LLM's
    get_sampling_config_from_request reads it: ``... or 1``)."""
    if "num_return_sequences" not in present:
        return 1
    count = _single("num_return_sequences", present["num_return_sequences"])
    if isinstance(count, bool) or not isinstance(count, int) or not 0 <= count <= MAX_GENERATIONS:
        raise InvalidRequest(f"num_return_sequences must be an integer in [0, "
                             f"{MAX_GENERATIONS}], got {count!r}")
    return count or 1


def _extra_outputs(flags: Mapping[str, bool]) -> frozenset[str]:
    """The vLLM backend's additional outputs its return_* inputs ask for."""
    return frozenset(output for name, output in VLLM_EXTRA_OUTPUTS.items() if flags[name])


#: Inputs taken at one value only -> (that value, why): any other asks for what
#: this server does not do (``schema.TRTLLM_INPUTS``, return_logprobs).
ONE_VALUE = {
    "beam_width": (1, "beam search is not implemented here"),
    "return_context_logits": (False, "the prompt's logits are not returned here"),
    "return_generation_logits": (False, "the generated tokens' logits are not returned here"),
    "return_perf_metrics": (False, "TensorRT-LLM's KV-cache and timing metrics are not made "
                                   "here"),
    # its JSON gives every token's rank, which the sampler does not count
    "return_logprobs": (False, "the vLLM backend's JSON logprobs output is not made here; ask "
                               "return_log_probs (output_log_probs) and num_top_logprobs "
                               "(top_logprobs_ids, top_logprobs) instead"),
}
#: An input that is another's other name -> that input: the two must agree.
ALIASES = {"min_tokens": "min_length", **CORE_ALIASES}


def _check_other_names(present: dict[str, object], sent_as: dict[str, str]) -> None:
    """Refuse an input at a value this server does not implement
    (``ONE_VALUE``) or a length_penalty that is not a number; take an alias
    as the input it names (a range refusal then names it as sent)."""
    for name, (value, why) in ONE_VALUE.items():
        # a beam width or sequence count of 0 is 1 in TensorRT-LLM
        # (get_sampling_config_from_request: `... or 1`); for a flag, 0 is false
        if name in present and _single(name, present[name]) not in (value, 0):
            raise InvalidRequest(f"{name} must be {str(value).lower()}: {why}")
    for alias, name in ALIASES.items():
        if alias in present:
            value = present.pop(alias)
            if name in present and not np.array_equal(np.asarray(present[name]).reshape(-1),
                                                      np.asarray(value).reshape(-1)):
                raise InvalidRequest(f"{alias} and {sent_as.get(name, name)} are the same "
                                     f"parameter; they disagree")
            present[name] = value
            sent_as.setdefault(name, alias)
    if "length_penalty" in present and not np.isfinite(_single("length_penalty",
                                                              present["length_penalty"])):
        raise InvalidRequest(f"{sent_as.get('length_penalty', 'length_penalty')} must be finite")


def encode_prompt(codec, inputs: Mapping[str, object]) -> list[int]:
    """The preprocessing step: text_input (through the chat template when
    apply_chat_template is true) as token ids. Raises InvalidRequest naming the
    input."""
    if inputs.get("text_input") is None:
        raise InvalidRequest("text_input (or input_ids) is required")
    text = utf8_text("text_input", _single("text_input", inputs["text_input"]))
    if not text:
        raise InvalidRequest("text_input must be a non-empty string")
    chat = inputs.get("apply_chat_template")
    return codec.encode(text, bool(_single("apply_chat_template", chat)) if chat is not None
                        else False)
