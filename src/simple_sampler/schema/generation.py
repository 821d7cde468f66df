"""The generation models' tensors: the ensemble's (TensorRT-LLM's ensemble
names, vLLM's beyond them), the llm model's, TensorRT-LLM's tensorrt_llm
model's dialect over it, and preprocessing's."""
from __future__ import annotations

import dataclasses

from ..params import BIAS_ALLOWED
from ..sampling import MAX_TOP_LOGPROBS
from ..settings import MAX_GENERATIONS, LlmSettings
from .tensors import PROMPT_OUTPUTS, TOP_OUTPUTS, Model, Tensor, sampling_tensors, scalar


#: The generation models' top_p: TensorRT-LLM's ensemble hands its top_p to its
#: tensorrt_llm model's runtime_top_p, which reads 0 as no top-p
#: (``generate_io.top_p_zero_is_off``).
TOP_P_ALLOWED = ("[0, 1]; 1 disables it, and 0 too, as TensorRT-LLM reads it: with top_k 0 or "
                 "-1 (or none) that is greedy (top_k 1); vLLM's top_p (in sampling_parameters or "
                 "a request parameter) stays in (0, 1]")
#: Generation inputs beyond TensorRT-LLM's, named as vLLM's fields are
NUM_TOP_LOGPROBS = scalar(
    "num_top_logprobs", "INT32", 0,
    f"[0, {MAX_TOP_LOGPROBS}], with return_log_probs true: per token also the n most likely "
    f"tokens and their logprobs (top_logprobs_ids, top_logprobs)")
PROMPT_LOGPROBS = scalar(
    "prompt_logprobs", "INT32", "none",
    f"[0, {MAX_TOP_LOGPROBS}]: the prompt is scored first; its first response carries each "
    f"prompt token's logprob and the n most likely at its place ({', '.join(PROMPT_OUTPUTS)}); "
    f"max_tokens may then be 0 (vLLM's name)")
IGNORE_EOS = scalar("ignore_eos", "BOOL", False,
                     "true: the end ids end nothing (generated as any token; still banned "
                     "until min_length, as vLLM's; vLLM's name)")
#: Guide types of structured outputs (serving/structured.py; TensorRT-LLM's
#: names, and vLLM's choice) -> what guided_decoding_guide holds
GUIDE_TYPES = {
    "json": "nothing (empty): any JSON object",
    "json_schema": "a JSON schema (a JSON object, as text)",
    "regex": "a regular expression (Rust regex syntax)",
    "choice": "a JSON list of strings, one of which is the whole output",
    "ebnf_grammar": "an EBNF (GBNF) or Lark grammar",
}
#: Structured outputs (serving/structured.py), TensorRT-LLM's inputs
#: (get_guided_decoding_params_from_request, its tensorrt_llm model's model.py)
GUIDED_DECODING_INPUTS = (
    scalar("guided_decoding_guide_type", "BYTES", "none (unguided)",
           f"{', '.join(GUIDE_TYPES)}: the output is held to what guided_decoding_guide "
           f"says; the grammar ends it at the model's end ids, so not with ignore_eos or an "
           f"end_id not among them (-1 included)"),
    scalar("guided_decoding_guide", "BYTES", "none",
           "with guided_decoding_guide_type: " + "; ".join(
               f"{kind}: {what}" for kind, what in GUIDE_TYPES.items())),
)
#: Inputs of TensorRT-LLM's ensemble (NVIDIA/TensorRT-LLM,
#: triton_backend/all_models/inflight_batcher_llm/ensemble/config.pbtxt) that its
#: own clients send (inflight_batcher_llm/client/end_to_end_grpc_client.py sends
#: beam_width always), taken here at the one value that means what this server
#: does, or taken for what they do there with one beam: nothing.
TRTLLM_INPUTS = (
    scalar("min_tokens", "INT32", 0,
            "min_length's alias (TensorRT-LLM's name now, and vLLM's); the two must agree; "
            "at most max_tokens (vLLM's rule); as min_length, vLLM's stop string ending "
            "within it ends nothing (the stop_words input's words, as TensorRT-LLM's, do)"),
    scalar("beam_width", "INT32", 1, "1 (or 0, which TensorRT-LLM reads as 1) only: sampling "
            "(beam search is not implemented here)"),
    scalar("num_return_sequences", "INT32", 1,
            f"0 (read as 1, as TensorRT-LLM does) to {MAX_GENERATIONS}: sequences per prompt, "
            "each its own generation, answered with its sequence_index when above 1; with a "
            "seed, sequence j draws with seed + j (as vLLM seeds its n)"),
    scalar("length_penalty", "FP32", "none (no effect)",
            "finite: beam search's length penalty, which with one beam changes nothing (as in "
            "TensorRT-LLM)"),
    scalar("pad_id", "INT32", "none (no effect)", "a token id: TensorRT-LLM passes it to its "
            "executor, to no visible effect with one beam; none here"),
    *(scalar(f"return_{name}", "BOOL", False, f"false only: {what} are not returned here")
      for name, what in (("context_logits", "the prompt's logits"),
                         ("generation_logits", "the generated tokens' logits"),
                         ("perf_metrics", "TensorRT-LLM's KV-cache and timing metrics"))),
    Tensor("embedding_bias_words", "BYTES", (-1,), default="none",
           allowed="strings, with embedding_bias_weights: each word's tokens, as the tokenizer "
                   "encodes the word alone (its special tokens included, as TensorRT-LLM's "
                   "preprocessing encodes it), get the word's weight added to their logits"),
    Tensor("embedding_bias_weights", "FP32", (-1,), default="none",
           allowed=f"{BIAS_ALLOWED}, one per embedding_bias_words entry; summed where "
                   f"tokens repeat, and with logit_bias"),
    *GUIDED_DECODING_INPUTS,
)
#: Triton's vLLM backend's additional outputs (its docs/additional_outputs.md):
#: the input that asks for one -> the output then in every response.
VLLM_EXTRA_OUTPUTS = {"return_finish_reason": "finish_reason",
                      "return_cumulative_logprob": "cumulative_logprob",
                      "return_logprobs": "logprobs",
                      "return_num_input_tokens": "num_input_tokens",
                      "return_num_output_tokens": "num_output_tokens"}
_EVERY_RESPONSE = "true: in every response (Triton's vLLM backend's input), "
VLLM_EXTRA_INPUTS = (
    scalar("return_finish_reason", "BOOL", False,
            _EVERY_RESPONSE + "finish_reason, \"None\" before the last"),
    scalar("return_cumulative_logprob", "BOOL", False,
            _EVERY_RESPONSE + "cumulative_logprob, the sum of the logprobs of the tokens so far "
            "(computed as return_log_probs computes them)"),
    scalar("return_logprobs", "BOOL", False,
            "false only: that backend's JSON logprobs (with each token's rank) are not made "
            "here; ask return_log_probs and num_top_logprobs"),
    scalar("return_num_input_tokens", "BOOL", False, _EVERY_RESPONSE + "num_input_tokens"),
    scalar("return_num_output_tokens", "BOOL", False,
            _EVERY_RESPONSE + "num_output_tokens, the tokens of that response (that backend's "
            "count, where the last response otherwise counts them all)"),
)


#: What a client may send the ensemble (and preprocessing, which takes them
#: all to refuse a request without text_input: its config.pbtxt says why).
GENERATE_INPUTS = (
    # Optional in config.pbtxt only so that its absence reaches preprocessing,
    # which answers it with INVALID_ARG (Triton's ensemble checks nothing).
    scalar("text_input", "BYTES", "required", "non-empty UTF-8"),
    scalar("max_tokens", "INT32", 16,
            f"[1, 2147483647] (0 with prompt_logprobs); past the room the prompt leaves in "
            f"the context (max_context, {LlmSettings.max_context}) shortened to it, as "
            f"TensorRT-LLM shortens it"),
    scalar("stream", "BOOL", False, "false: one response at the end; true (responses as "
            "tokens come) refused by a server of decoupled_mode false"),
    scalar("stream_interval", "INT32", "the server's stream_interval (LlmSettings, 1)",
            ">= 1: a stream sends its first token at once, then a response every k tokens "
            "with all of them, and always the last (TensorRT-LLM's name)"),
    *sampling_tensors("top_k", "top_p", "a finite value >= 0; < 1e-5 is greedy (1e-5 samples)",
               TOP_P_ALLOWED),
    scalar("random_seed", "UINT64", "a fresh random seed", "[0, 2^64)", param="seed"),
    scalar("seed", "UINT64", "a fresh random seed", "random_seed's alias; the two must agree",
            param="seed"),
    Tensor("stop_words", "BYTES", (-1,), default="none",
           allowed="strings (empty ones name no word), as TensorRT-LLM reads them: each "
                   "encoded alone, the generation ends once its tokens end with a word's, the "
                   "word kept; vLLM's stop (its parameter) is matched in the text instead, cut "
                   "before it (after it with include_stop_str_in_output)"),
    scalar("include_stop_str_in_output", "BOOL", False,
            "true: the text keeps the stop word, or the stop or end id's text, that ended "
            "it (vLLM's name)"),
    scalar("skip_special_tokens", "BOOL", True,
            "false: special tokens' text (a chat's end of turn) is kept in the text (vLLM's name)"),
    Tensor("bad_words", "BYTES", (-1,), default="none",
           allowed="strings (empty ones name no word), never generated, each encoded alone "
                   "(TensorRT-LLM's; vLLM's bad_words parameter also bans each after a space)"),
    Tensor("logit_bias_ids", "INT32", (-1,), default="none",
           allowed="token ids in [0, V), each at most once"),
    Tensor("logit_bias_values", "FP32", (-1,), default="none",
           allowed=f"{BIAS_ALLOWED}, one per logit_bias_ids entry: added to its logit"),
    Tensor("stop_token_ids", "INT32", (-1,), default="none",
           allowed="token ids in [0, V): each ends the generation as end_id does (even with "
                   "ignore_eos) and is banned until min_length (vLLM's name)"),
    Tensor("allowed_token_ids", "INT32", (-1,), default="none",
           allowed="token ids in [0, V): only these are generated (the end ids too: without "
                   "one, only max_tokens or a stop ends it; vLLM's name)"),
    scalar("end_id", "INT32", "the model's end ids (its tokenizer's and its "
            "generation_config.json's); with request_output_len, -1",
            "a token id: the one end id; -1: none (TensorRT-LLM's: no end ends it, and "
            "min_length bans none)"),
    IGNORE_EOS,
    scalar("min_length", "INT32", param="min_tokens",
            allowed=">= 0: the end ids and stop_token_ids are banned until reached, and "
                    "vLLM's stop string ending within those tokens ends nothing (vLLM's "
                    "min_tokens); the stop_words input's words end it there too (TensorRT-LLM's)"),
    scalar("return_log_probs", "BOOL", False, "per-token logprobs and their sum"),
    NUM_TOP_LOGPROBS,
    PROMPT_LOGPROBS,
    scalar("exclude_input_in_output", "BOOL",
            "the server's exclude_input_in_output (LlmSettings, false)",
            "false: a non-streamed answer starts with the prompt (TensorRT-LLM's "
            "behaviour); streams never repeat it"),
    scalar("apply_chat_template", "BOOL", False,
            "true: text_input is sent as one user turn through the model's template"),
    scalar("sampling_parameters", "BYTES", "none",
            "a JSON object of vLLM's sampling parameters by SamplingParams' names (Triton's vLLM "
            "backend's input): each counts as the input that carries it (vLLM's sampling parameters, "
            "below)"),
    *VLLM_EXTRA_INPUTS,
    *TRTLLM_INPUTS,
)
GENERATE_OUTPUTS = (
    Tensor("text_output", "BYTES", (-1,), optional=False),
    Tensor("output_ids", "INT32", (-1,), optional=False),
    # [beams, tokens], one beam: TensorRT-LLM's ensemble's dims
    Tensor("output_log_probs", "FP32", (-1, -1), optional=False),
    Tensor("cum_log_probs", "FP32", optional=False),
    Tensor(TOP_OUTPUTS[0], "INT32", (-1, -1), optional=False),
    Tensor(TOP_OUTPUTS[1], "FP32", (-1, -1), optional=False),
    Tensor(PROMPT_OUTPUTS[0], "INT32", (-1,), optional=False),
    Tensor(PROMPT_OUTPUTS[1], "FP32", (-1,), optional=False),
    Tensor(PROMPT_OUTPUTS[2], "INT32", (-1,), optional=False),
    Tensor(PROMPT_OUTPUTS[3], "INT32", (-1, -1), optional=False),
    Tensor(PROMPT_OUTPUTS[4], "FP32", (-1, -1), optional=False),
    Tensor("num_input_tokens", "INT32", optional=False),
    Tensor("num_output_tokens", "INT32", optional=False),
    Tensor("finish_reason", "BYTES", optional=False),
    Tensor("stop_reason", "BYTES", optional=False),
    Tensor("cumulative_logprob", "FP32", optional=False),
    # TensorRT-LLM's, in every response of a request of several prompts (its
    # client's --batch-inputs) and of a prompt's several sequences (its -n),
    # and not of one, as its model sends them (`0 if None` in that client)
    Tensor("batch_index", "INT32", optional=False),
    Tensor("sequence_index", "INT32", optional=False),
)
#: The prompt as token ids: preprocessing's output, llm's alternative to text_input.
INPUT_IDS = Tensor("input_ids", "INT32", (-1,), default="text_input's tokens",
                   allowed="token ids; replaces text_input")
#: Each row's prompt length in input_ids (the rest padding, -1): preprocessing's
#: output for a request of several prompts (triton.prompt_batch).
INPUT_LENGTHS = Tensor("input_lengths", "INT32", default="each row whole",
                       allowed="1 to input_ids' length; with input_ids")

ENSEMBLE = Model("ensemble", GENERATE_INPUTS, GENERATE_OUTPUTS)
#: TensorRT-LLM's tensorrt_llm model's names (its core model: tensorrtllm_backend,
#: all_models/inflight_batcher_llm/tensorrt_llm/config.pbtxt) for inputs the
#: llm model takes by the ensemble's names: alias -> that name. A request that
#: sends request_output_len (required there) speaks that model's dialect and
#: is answered in its outputs (``CORE_OUTPUTS``).
CORE_ALIASES = {"request_output_len": "max_tokens", "runtime_top_k": "top_k",
                "runtime_top_p": "top_p", "streaming": "stream", "len_penalty": "length_penalty"}
#: Defaults that differ in that model's dialect: its own
_CORE_DEFAULTS = {"runtime_top_p": "1.0; 0 in TensorRT-LLM's shapes without vLLM's parameters, "
                                   "and when request_output_len is given (its default: greedy "
                                   "unless runtime_top_k is given)"}
CORE_INPUTS = tuple(
    dataclasses.replace(ENSEMBLE.input(name), name=alias, param="",
                        default=_CORE_DEFAULTS.get(alias, ENSEMBLE.input(name).default),
                        allowed=f"{name}'s alias (TensorRT-LLM's tensorrt_llm model's name); the "
                                f"two must agree" + ("; given, the answer comes in that "
                                                     "model's outputs (sequence_length, "
                                                     "beam_*)" if alias == "request_output_len"
                                                     else ""))
    for alias, name in CORE_ALIASES.items())
_WORD_LIST = ("[2, N], TensorRT-LLM's word list: row 0 the words' token ids back to back (0 "
              "padded), row 1 each word's end offset into them, ascending, -1 padded; [2, 0]: "
              "none (its preprocessing's STOP_WORDS_IDS, BAD_WORDS_IDS)")
#: TensorRT-LLM's tensorrt_llm model's inputs in token ids, which the llm model
#: takes under their own names (its preprocessing model makes them from words)
CORE_TOKEN_INPUTS = (
    Tensor("stop_words_list", "INT32", (2, -1), default="none",
           allowed=f"{_WORD_LIST}: each word ends the generation once the sequence's ids end "
                   f"with it, as the stop_words input's words do"),
    Tensor("bad_words_list", "INT32", (2, -1), default="none",
           allowed=f"{_WORD_LIST}: each word is never generated, as the bad_words input's"),
    Tensor("embedding_bias", "FP32", (-1,), default="none",
           allowed=f"{BIAS_ALLOWED}: entry i added to token i's logit, 0 past V; [0]: none "
                   f"(its preprocessing's EMBEDDING_BIAS, as long as the tokenizer)"),
    Tensor("decoder_input_ids", "INT32", (-1,), default="none",
           allowed="at most one id: an encoder-decoder model's decoder prompt, which "
                   "TensorRT-LLM reads for such models only; every model here is decoder-only, "
                   "so only its preprocessing's placeholder (one pad id) is taken, and not read"),
    scalar("decoder_input_lengths", "INT32", "none",
           "1 only: that placeholder's length (its preprocessing's REQUEST_DECODER_INPUT_LEN, "
           "which its ensemble hands over), not read"),
)
#: TensorRT-LLM's tensorrt_llm model's stop signal (its handle_stop_request):
#: a request that stops the ones in flight with its request id. Its input
#: there is `stop`, which the tensorrt_llm ensemble hands to this one: on the
#: llm model `stop` is vLLM's stop strings (over HTTP generate a body's key
#: that names an input becomes that input).
STOP_SIGNAL = scalar(
    "stop_signal", "BOOL", False,
    "true: this request (it needs a request id) stops every request in flight with its id, "
    "each answered as cancelled with what it has generated, and gets one response without "
    "outputs; its other inputs and parameters are not read (TensorRT-LLM's tensorrt_llm "
    "model's stop signal, its input stop there; its client sends placeholders)")
#: The llm model's answer to a request in TensorRT-LLM's tensorrt_llm model's
#: dialect (``CORE_ALIASES``), in that model's shapes ([beams, ...], one beam
#: here): the tensorrt_llm ensemble gives them under that model's names
#: (``CORE_OUTPUT_NAMES``); they replace every other output but batch_index
#: and sequence_index (``triton.trtllm_core``).
CORE_OUTPUTS = (
    Tensor("sequence_length", "INT32", (-1,), optional=False),
    Tensor("beam_output_ids", "INT32", (-1, -1), optional=False),
    Tensor("beam_output_log_probs", "FP32", (-1, -1), optional=False),
    Tensor("beam_cum_log_probs", "FP32", (-1,), optional=False),
)
#: The tensorrt_llm model's inputs the llm model takes by another name (the
#: others by their own)
CORE_INPUT_NAMES = {"stop": "stop_signal"}
#: The llm model's output -> the tensorrt_llm model's of that name
CORE_OUTPUT_NAMES = {"sequence_length": "sequence_length", "beam_output_ids": "output_ids",
                     "beam_output_log_probs": "output_log_probs",
                     "beam_cum_log_probs": "cum_log_probs",
                     "batch_index": "batch_index", "sequence_index": "sequence_index"}

LLM = Model("llm", (*GENERATE_INPUTS, INPUT_IDS, INPUT_LENGTHS, *CORE_INPUTS,
                    *CORE_TOKEN_INPUTS, STOP_SIGNAL),
            (*GENERATE_OUTPUTS, *CORE_OUTPUTS))
#: TensorRT-LLM's core model's interface: an ensemble over llm of one step
#: (model_repository/tensorrt_llm), for its clients that call that model by
#: name (inflight_batcher_llm_client.py, benchmark_core_model.py): token ids
#: in, token ids out, the inputs of its that mean something here.
TRTLLM_CORE = Model("tensorrt_llm", (
    *(dataclasses.replace(LLM.input(name), optional=False, default="required")
      for name in ("input_ids", "input_lengths", "request_output_len")),
    *(LLM.input(name) for name in (
        "num_return_sequences", "end_id", "pad_id", "beam_width", "temperature",
        "runtime_top_k", "runtime_top_p", "len_penalty", "repetition_penalty", "min_length",
        "presence_penalty", "frequency_penalty", "random_seed", "return_log_probs",
        "return_context_logits", "return_generation_logits", "return_perf_metrics",
        "exclude_input_in_output", "streaming", *(t.name for t in GUIDED_DECODING_INPUTS))),
    *CORE_TOKEN_INPUTS,
    dataclasses.replace(STOP_SIGNAL, name="stop")),
    tuple(dataclasses.replace(LLM.output(name), name=core_name)
          for name, core_name in CORE_OUTPUT_NAMES.items()))
