"""OpenAI requests to generation requests of the ``llm`` model (its
responses back to OpenAI's objects: ``answers``). No server here: this is
the front door's logic, tested without one.

Requests: the prompt is tokenized here, chat turns through the model's own
chat template (``TextCodec.encode_chat``, the path preprocessing uses), and
sent to ``llm`` as ``input_ids``: calling ``llm`` directly is what lets a
client that leaves stop its generation (docs/SERVING.md, "Cancellation").
Each sampling field goes to the input ``schema`` names for its
``SamplingParams`` field and is checked by ``params.RULES``, the rules the
decode loop applies, so the front door and the server cannot disagree on a
range; integer fields are also held to their tensor's data type (an INT32
``max_tokens`` of 4294967297 is a 400, not a wrapped 1).
"""
from __future__ import annotations

import dataclasses
import json
import time
import uuid
from dataclasses import dataclass, field

import numpy as np

from ..params import BIAS_ALLOWED, RULES, as_float32, bias_allowed
from ..sampling import MAX_TOP_LOGPROBS
from ..schema import (ANSWERS_ONCE, GENERATE_INPUTS, IGNORE_EOS, INPUT_IDS, NUM_TOP_LOGPROBS,
                      PROMPT_LOGPROBS, InvalidRequest)
from ..settings import MAX_GENERATIONS
from ..triton.vllm_params import SAMPLING_PARAMETERS
from ..serving.structured import Guide
from .chat import chat_prompt
from .envelope import check_inert, echoed
from .response_format import request_guide
from .tools import ToolUse, tool_use
from .protocol import (ChatCompletionRequest, CompletionRequest, RequestError,
                       Sampling)

#: SamplingParams field -> the generate input carrying it (seed: ``seed``).
PARAM_INPUTS = {t.param: t.name for t in GENERATE_INPUTS if t.param}
_INPUT_DTYPES = {t.name: t.numpy for t in (*GENERATE_INPUTS, INPUT_IDS)}
#: the generate input carrying OpenAI's top_logprobs (chat) and logprobs (completions)
NUM_TOP = NUM_TOP_LOGPROBS.name
#: the highest temperature the door takes: OpenAI's, and vLLM 0.32's
#: (vllm/sampling_params.py, ``SamplingParams._verify_args``)
MAX_TEMPERATURE = 2.0


@dataclass
class Served:
    """What the front door serves: the model's id, its text codec, context and
    vocabulary (token ids a request names must lie in [0, vocab_size)), and
    whether the llm model streams (decoupled: LlmSettings.decoupled_mode)."""

    model_id: str
    codec: object  # serving.text.TextCodec
    max_context: int
    vocab_size: int
    streams: bool = True
    #: the parser of tool calls in free text, for tool_choice auto (frontend/tools.py)
    tool_parser: str = "none"
    #: request field -> value where a request leaves it out: the model's
    #: generation config's (frontend/generation_defaults.py)
    sampling_defaults: dict = field(default_factory=dict)
    #: the llm model's stream_interval, which a request's may only raise
    stream_interval: int = 1


@dataclass
class Plan:
    """One OpenAI request as a generation of the ``llm`` model."""

    chat: bool
    prompt_ids: list[int]
    params: dict            # generate input -> value (client.request_arrays' params)
    stream: bool
    include_usage: bool
    logprobs: bool
    #: vLLM's continuous_usage_stats: every stream chunk carries the usage so far
    continuous_usage: bool = False
    #: completions' echo: the prompt's text, which the answer starts with
    #: (and, with logprobs, the prompt's tokens its logprobs); None: no echo
    echo: str | None = None
    #: vLLM's prompt_logprobs n, returned with the answer; None: not asked
    prompt_logprobs: int | None = None
    #: a later one of n choices of its prompt: the usage counts the prompt once
    repeats_prompt: bool = False
    #: vLLM's return_token_ids: the prompt's and the answer's ids beside the text
    return_token_ids: bool = False
    #: vLLM's return_tokens_as_token_ids: logprobs name tokens "token_id:N"
    tokens_as_ids: bool = False
    #: chat's forced tool calls (``tools.ToolUse``): the answer is its calls
    tools: ToolUse | None = None
    #: a streamed answer's responses so far, where its calls come at its end;
    #: how many of them went out with their logprobs; (``auto``) how much of
    #: its text went out as content
    held: list = field(default_factory=list)
    reported: int = 0
    sent: int = 0
    #: a stream's prompt_token_ids and prompt_text went out (where asked)
    prompt_ids_sent: bool = False
    #: completions' logprobs: the text_offset of the next token reported;
    #: the last ids sampled (answers.token_text's context)
    text_offset: int = 0
    recent_ids: list = field(default_factory=list)
    #: chat's return_prompt_text: the chat template's text; None: not asked
    prompt_text: str | None = None
    id: str = field(default_factory=lambda: uuid.uuid4().hex)
    created: int = field(default_factory=lambda: int(time.time()))

    @property
    def special(self) -> bool:
        """vLLM's skip_special_tokens false: special tokens' text kept, in
        the answer's text (the decode loop's) and in its logprobs' token
        strings (``answers``)."""
        return self.params.get("skip_special_tokens", True) is False

    @property
    def asks_the_model(self) -> bool:
        """False for completions' echo with max_tokens 0 and no logprobs:
        the prompt is the whole answer."""
        return self.params["max_tokens"] > 0 or PROMPT_LOGPROBS.name in self.params


def checked_integer(name: str, value: int, input_name: str, low: int, high: int,
                    param: str | None = None) -> int:
    """value in [low, high] and in the range of the input's integer dtype
    (`name` the value's place, `param` its field: `name` unless given)."""
    info = np.iinfo(_INPUT_DTYPES[input_name])
    low, high = max(low, int(info.min)), min(high, int(info.max))
    if not low <= value <= high:
        raise RequestError(f"{name} must be an integer in [{low}, {high}], got {value}",
                           param or name)
    return value


def _sampling_params(request: Sampling, served: Served) -> dict:
    """The sampling fields given (or the model's defaults for those left
    out), checked by params.RULES, as generate inputs."""
    params = {}
    for name, rule, allowed in ((p.name, p.rule, p.allowed) for p in RULES):
        value = getattr(request, name)
        if value is None:
            value = served.sampling_defaults.get(name)
        if value is None:
            continue
        if not rule(np.float64(value)):
            raise RequestError(f"{name} must be {allowed}, got {value!r}", name)
        if name == "temperature" and value > MAX_TEMPERATURE:
            raise RequestError(f"temperature must be in [0, {MAX_TEMPERATURE:g}] (OpenAI's and vLLM's "
                               f"range; Triton's generate takes any), got {value!r}", name)
        dtype = np.dtype(_INPUT_DTYPES[PARAM_INPUTS[name]])
        if dtype == np.float32 and not rule(np.float64(as_float32(value))):
            raise RequestError(f"{name} must be {allowed} as float32 carries it: {value!r} "
                               f"reads as {as_float32(value)!r}", name)
        info = np.iinfo(dtype) if dtype.kind in "iu" and isinstance(value, int) else None
        if info is not None and value > info.max:
            raise RequestError(f"{name} must be {allowed} and at most {info.max}, got {value}",
                               name)
        params[PARAM_INPUTS[name]] = value
    if request.seed is not None:
        if not -2**63 <= request.seed < 2**64:
            raise RequestError(f"seed must be an integer in [{-2**63}, {2**64 - 1}], got "
                               f"{request.seed}", "seed")
        # -1 is no seed, as vLLM reads it (vllm/sampling_params.py,
        # SamplingParams.__post_init__); another negative seed as
        # torch.manual_seed reads vLLM's int64: modulo 2^64
        if request.seed != -1:
            params[PARAM_INPUTS["seed"]] = request.seed % 2**64
    if request.ignore_eos:
        params[IGNORE_EOS.name] = True
    if request.include_stop_str_in_output:
        params["include_stop_str_in_output"] = True
    if not request.skip_special_tokens:  # vLLM's default, the input's, is true
        params["skip_special_tokens"] = False
    if request.min_tokens is not None:
        params[PARAM_INPUTS["min_tokens"]] = checked_integer(
            "min_tokens", request.min_tokens, PARAM_INPUTS["min_tokens"], 0, 2**63)
    # vLLM's stop, matched in the text (the stop_words input: as tokens), and its
    # bad words, banned after a space too (the bad_words input: each word alone)
    vllm = {}
    if request.stop is not None:
        stop = [request.stop] if isinstance(request.stop, str) else request.stop
        if not all(stop):
            raise RequestError("stop must be a non-empty string or a list of them", "stop")
        if stop:
            vllm["stop"] = stop
    if request.bad_words:
        try:  # the llm model encodes them again: its refusals, named here
            served.codec.words_ids(request.bad_words, spaced=True)
        except InvalidRequest as error:
            raise RequestError(str(error), "bad_words") from None
        vllm["bad_words"] = request.bad_words
    if vllm:
        params[SAMPLING_PARAMETERS] = json.dumps(vllm)
    if request.logit_bias:
        params["logit_bias_ids"], params["logit_bias_values"] = _logit_bias(request.logit_bias,
                                                                           served.vocab_size)
    if request.stop_token_ids:
        params["stop_token_ids"] = [
            checked_integer("stop_token_ids", token, INPUT_IDS.name, 0, served.vocab_size - 1)
            for token in request.stop_token_ids]
    if request.allowed_token_ids is not None:
        if not request.allowed_token_ids:
            raise RequestError("allowed_token_ids must not be empty", "allowed_token_ids")
        params["allowed_token_ids"] = [
            checked_integer("allowed_token_ids", token, INPUT_IDS.name, 0, served.vocab_size - 1)
            for token in request.allowed_token_ids]
    if guide := request_guide(request):
        params["guided_decoding_guide_type"] = guide.type
        if guide.text:
            params["guided_decoding_guide"] = guide.text
    return params


def _logit_bias(bias: dict[str, float], vocab_size: int) -> tuple[list[int], list[float]]:
    """OpenAI's logit_bias (decimal token ids as keys) as the generate
    inputs' ids and values: each id once, each value params.BIAS_ALLOWED."""
    ids: dict[int, str] = {}
    for key, value in bias.items():
        digits = key.strip()
        token = int(digits) if digits.isascii() and digits.isdigit() else None
        if token is None or not 0 <= token < vocab_size:
            raise RequestError(f"logit_bias keys must be token ids in [0, {vocab_size - 1}], "
                               f"got {key!r}", "logit_bias")
        if token in ids:
            raise RequestError(f"logit_bias names token {token} twice ({ids[token]!r} and "
                               f"{key!r})", "logit_bias")
        if not bias_allowed(value):
            raise RequestError(f"logit_bias values must be {BIAS_ALLOWED}, got {value!r} for "
                               f"token {token}", "logit_bias")
        ids[token] = key
    return list(ids), list(bias.values())


def truncation(request: Sampling, served: Served, output: int) -> int | None:
    """vLLM's truncate_prompt_tokens k: how many of the prompt's last tokens
    are sent (a chat's after its template; a text prompt keeps the special
    tokens the tokenizer adds, ``TextCodec.tokenize``), None: all. As vLLM
    0.32 (vllm/renderers/params.py, ``TokenizeParams``): k at most the
    context (a larger k is refused up front); -1 the context less the one
    token held back for the output where any is asked for (`output`: the
    request's max_tokens, completions' 16 when not given, chat's 0; its
    ``max_truncation_tokens``), else the whole context. The output's room is
    then what the kept prompt leaves (``_max_tokens``). vLLM's field takes 0
    too, which it reads as nothing kept: refused here."""
    k = request.truncate_prompt_tokens
    if k is None:
        return None
    if k == -1:
        return served.max_context if output == 0 else served.max_context - 1
    if not 1 <= k <= served.max_context:
        raise RequestError(f"truncate_prompt_tokens must be -1 or an integer in [1, "
                           f"{served.max_context}] (the context), got {k}",
                           "truncate_prompt_tokens")
    return k


def _max_tokens(request: Sampling, served: Served, prompt_length: int, default: int | None,
                name: str = "max_tokens", prompt_field: str = "messages", low: int = 1,
                prompt_name: str = "the prompt") -> int:
    """The generation's max_tokens (or max_completion_tokens, `name`): at
    most what the context leaves after the prompt (`prompt_name`, for
    errors). As vLLM 0.32: a limit at most the context (vllm/renderers/
    params.py, ``TokenizeParams``: a larger one is refused), shortened to
    the room the prompt leaves where it asks for more
    (vllm/entrypoints/serve/utils/api_utils.py, ``get_max_tokens``; the
    answer ends by length there). A prompt that leaves no room for a token
    (for the prompt alone, `low` 0: one longer than the context) is
    refused."""
    given = getattr(request, name)
    if given is not None:
        checked_integer(name, given, "max_tokens", low, served.max_context)
    room = served.max_context - prompt_length
    if room < min(1 if given is None else given, 1):
        raise RequestError(f"{prompt_name} ({prompt_length} tokens) leaves no room in the "
                           f"context ({served.max_context} tokens)", prompt_field)
    if given is None:
        # chat: what the context leaves (or the model's max_new_tokens, if
        # less); completions: OpenAI's 16, or what the context leaves if less
        # (vLLM's default, ``get_max_tokens``)
        return room if default is None else min(default, room)
    return min(given, room)


def check_model(model: str | None, served: Served) -> None:
    """vLLM's model field is optional (None: the served model); one named
    must be the served one."""
    if model is not None and model != served.model_id:
        raise RequestError(f"the model {model!r} does not exist; this server serves "
                           f"{served.model_id!r}", "model", status=404, code="model_not_found")


def _common(request: Sampling, served: Served) -> None:
    check_model(request.model, served)
    if request.n is not None and not 1 <= request.n <= MAX_GENERATIONS:
        raise RequestError(f"n must be an integer in [1, {MAX_GENERATIONS}], got {request.n}",
                           "n")


def _choices(plans: list[Plan], n: int | None) -> list[Plan]:
    """OpenAI's n: n generations of each plan, choice i * n + j the j-th of
    prompt i, sharing the answer's id. With a seed the j-th draws with seed
    + j, as vLLM seeds its n children (vllm/v1/engine/parallel_sampling.py,
    ``ParentRequest._get_child_sampling_params``): they differ, each
    reproducible."""
    n = n or 1
    if len(plans) * n > MAX_GENERATIONS:
        raise RequestError(f"the prompts ({len(plans)}) times n ({n}) must be at most "
                           f"{MAX_GENERATIONS} generations", "n")
    seed = PARAM_INPUTS["seed"]
    copies = [dataclasses.replace(plan, id=plans[0].id, created=plans[0].created,
                                  params=dict(plan.params), held=[], recent_ids=[])
              for plan in plans for _ in range(n)]
    for index, plan in enumerate(copies):
        plan.repeats_prompt = index % n > 0
        if seed in plan.params:
            plan.params[seed] = (plan.params[seed] + index % n) % 2**64
    return copies


def plan_completion(request: CompletionRequest, served: Served) -> list[Plan]:
    """The generations a /v1/completions request asks for, n per prompt
    (RequestError if bad); they share the answer's id."""
    _common(request, served)
    top = 0 if request.logprobs is None else checked_integer(
        "logprobs", request.logprobs, NUM_TOP, 0, MAX_TOP_LOGPROBS)
    if request.best_of not in (None, 1):
        raise RequestError(f"best_of must be 1 (n sets the choices), got {request.best_of}",
                           "best_of", code="unsupported_parameter")
    prompts = request.prompt
    if not (isinstance(prompts, list) and prompts and isinstance(prompts[0], (str, list))):
        prompts = [prompts]  # one prompt: text or token ids
    if len(prompts) > MAX_GENERATIONS:
        raise RequestError(f"prompt must hold at most {MAX_GENERATIONS} prompts, got "
                           f"{len(prompts)}", "prompt")
    return _choices([_plan_prompt(request, served, prompt, top,
                                  "prompt" if len(prompts) == 1 else f"prompt[{index}]")
                     for index, prompt in enumerate(prompts)], request.n)


def _plan_prompt(request: CompletionRequest, served: Served, prompt: str | list[int], top: int,
                 name: str) -> Plan:
    """The generation of one of a completions request's prompts (`name`:
    its place in the request, for errors)."""
    keep = truncation(request, served, 16 if request.max_tokens is None else request.max_tokens)
    if isinstance(prompt, str):
        if not prompt:
            raise RequestError(f"{name} must be a non-empty string", "prompt")
        prompt_ids = served.codec.encode(prompt, add_special_tokens=request.add_special_tokens,
                                         keep=keep, side=request.truncation_side)
    else:
        if not prompt:
            raise RequestError(f"{name} must be a non-empty string or list of token ids",
                               "prompt")
        prompt_ids = [checked_integer(f"{name}[{place}]", t, INPUT_IDS.name, 0, served.vocab_size - 1,
                               "prompt") for place, t in enumerate(prompt)]
        # vLLM's, ids as given: the last k, or the first with truncation_side right
        prompt_ids = prompt_ids if keep is None else \
            prompt_ids[:keep] if request.truncation_side == "right" else prompt_ids[-keep:]
    max_tokens = _max_tokens(request, served, len(prompt_ids), default=16, prompt_field="prompt",
                             low=0 if request.echo or _scores_prompt(request) else 1,
                             prompt_name="the prompt" if name == "prompt" else name)
    plan = _plan(request, served, False, prompt_ids, max_tokens, request.logprobs is not None,
                 top)
    if request.echo:
        # as vLLM: the prompt's text as sent, ids decoded; truncated, the
        # text of the tokens sent, which its logprobs are of (vLLM echoes
        # the whole text)
        whole = isinstance(prompt, str) and (keep is None or len(served.codec.encode(
            prompt, add_special_tokens=request.add_special_tokens)) <= keep)
        plan.echo = prompt if whole else served.codec.decode(prompt_ids)
        if plan.logprobs:
            plan.params[PROMPT_LOGPROBS.name] = max(top, plan.params.get(PROMPT_LOGPROBS.name, 0))
    return plan


def plan_chat(request: ChatCompletionRequest, served: Served) -> list[Plan]:
    """The generations a /v1/chat/completions request asks for, n of them
    (RequestError if bad)."""
    _common(request, served)
    top = 0 if request.top_logprobs is None else checked_integer(
        "top_logprobs", request.top_logprobs, NUM_TOP, 0, MAX_TOP_LOGPROBS)
    if top and not request.logprobs:  # 0 asks for nothing: taken alone, as vLLM takes it
        raise RequestError("top_logprobs needs logprobs true", "top_logprobs")
    if None not in (request.max_tokens, request.max_completion_tokens) and \
            request.max_tokens != request.max_completion_tokens:
        raise RequestError("max_tokens and max_completion_tokens are the same limit; they "
                           "disagree", "max_completion_tokens")
    name = "max_tokens" if request.max_completion_tokens is None else "max_completion_tokens"
    keep = truncation(request, served, getattr(request, name) or 0)
    use, guide = tool_use(request, served.tool_parser)
    prompt_text, prompt_ids = chat_prompt(request, served.codec, keep)
    plan = _plan(request, served, True, prompt_ids,
                 _max_tokens(request, served, len(prompt_ids), served.sampling_defaults.get("max_tokens"), name,
                             low=0 if _scores_prompt(request) else 1),
                 bool(request.logprobs), top)
    if use is not None:
        with_tools(plan, use, guide, request)
    plan.echo = echoed(request, plan.tools is not None)
    plan.prompt_text = prompt_text if request.return_prompt_text else None
    return _choices([plan], request.n)


def with_tools(plan: Plan, use: ToolUse, guide: Guide | None,
               request: ChatCompletionRequest) -> None:
    """`plan` answering in tool calls (``tools.tool_use``): a forced one's
    grammar's inputs set (not with another grammar, nor ignore_eos: vLLM
    refuses a named tool with structured outputs); ``auto``'s none."""
    plan.tools = use
    if guide is None:  # auto: the calls parsed out of the free answer
        if "skip_special_tokens" not in request.model_fields_set:
            # the parser reads the calls' tags, which some tokenizers make
            # special tokens: kept in the text as vLLM's Hermes2ProToolParser.
            # adjust_request (vllm/tool_parsers/hermes_tool_parser.py) keeps
            # them, though not over the client's own skip_special_tokens
            plan.params["skip_special_tokens"] = False
        return
    if "guided_decoding_guide_type" in plan.params:
        raise RequestError("tool_choice (a named function or required) holds the answer to "
                           "its own grammar: it cannot be given with response_format, "
                           "structured_outputs or guided_*", "tool_choice")
    if request.ignore_eos:
        raise RequestError("ignore_eos cannot be given with tool_choice required or a named "
                           "function: its grammar ends the answer", "ignore_eos")
    try:  # the guide is the tools' parameters: named so, not as the tensor it becomes
        guide.check("tools (a tool's parameters)")
    except InvalidRequest as error:
        raise RequestError(str(error), "tools") from None
    plan.params.update(guided_decoding_guide_type=guide.type, guided_decoding_guide=guide.text)


def _scores_prompt(request: Sampling) -> bool:
    """Whether the answer carries vLLM's prompt_logprobs (asked, not
    streamed): then max_tokens may be 0, the prompt's scores alone."""
    return request.prompt_logprobs is not None and not request.stream


def _prompt_logprobs(request: Sampling, plan: Plan) -> None:
    """vLLM's prompt_logprobs n (0 to MAX_TOP_LOGPROBS; vLLM's -1, the
    whole vocabulary, is refused): the prompt's scores, asked of the model
    for the answer. As vLLM, n > 0 is refused with stream, and 0 then
    asks for nothing."""
    n = request.prompt_logprobs
    if n is None:
        return
    if request.stream and n:
        raise RequestError("prompt_logprobs are not available when stream is true",
                           "prompt_logprobs")
    checked_integer("prompt_logprobs", n, PROMPT_LOGPROBS.name, 0, MAX_TOP_LOGPROBS)
    if request.stream:
        return
    plan.prompt_logprobs = n
    plan.params[PROMPT_LOGPROBS.name] = max(n, plan.params.get(PROMPT_LOGPROBS.name, 0))


def _plan(request: Sampling, served: Served, chat: bool, prompt_ids: list[int],
          max_tokens: int, logprobs: bool, top: int) -> Plan:
    params = _sampling_params(request, served)
    # OpenAI's default, said: the llm model reads a request without top_k
    # and top_p as greedy, as TensorRT-LLM does (generate_io.decode_generate)
    params.setdefault(PARAM_INPUTS["top_p"], 1.0)
    if "min_length" in params and params["min_length"] > max_tokens:
        raise RequestError(f"min_tokens ({params['min_length']}) must be at most the maximum "
                           f"number of tokens ({max_tokens})", "min_tokens")
    params.update(max_tokens=max_tokens, return_log_probs=logprobs)
    if top:
        params[NUM_TOP] = top
    if request.stream and not served.streams:
        raise RequestError(f"stream is not available: {ANSWERS_ONCE}; send stream false",
                           "stream")
    options = request.stream_options
    if options is not None and not request.stream:
        raise RequestError("stream_options is only allowed with stream true", "stream_options")
    include_usage = options is not None and bool(options.include_usage)
    plan = Plan(chat, prompt_ids, params, bool(request.stream), include_usage, logprobs,
                continuous_usage=include_usage and bool(options.continuous_usage_stats),
                return_token_ids=bool(request.return_token_ids),
                tokens_as_ids=bool(request.return_tokens_as_token_ids))
    check_inert(request)
    if request.request_id is not None:
        plan.id = request.request_id
    if request.stream_interval is not None:  # vLLM's: raised to the server's; a stream's only
        interval = checked_integer("stream_interval", request.stream_interval, "stream_interval",
                                   1, 2**31)
        if request.stream:
            params["stream_interval"] = max(interval, served.stream_interval)
    _prompt_logprobs(request, plan)
    return plan
