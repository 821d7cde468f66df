"""The schema's building blocks: a model's tensor (:class:`Tensor`), a model
(:class:`Model`), the client's-mistake error every codec raises
(:class:`InvalidRequest`), and the phrases answers share."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

from ..params import RULES, SamplingParams

#: Triton data type (as its protocols name it) -> numpy dtype.
NUMPY = {"BOOL": np.bool_, "INT8": np.int8, "UINT8": np.uint8, "INT32": np.int32,
         "INT64": np.int64, "UINT64": np.uint64, "FP16": np.float16, "FP32": np.float32, "BYTES": np.object_}
_ALLOWED = {param.name: param.allowed for param in RULES}
#: A parameter's Triton type by its numpy kind (the wire carries 32 bits).
_TRITON_DTYPE = {"i": "INT32", "f": "FP32"}
_PARAM_DEFAULTS = {f.name: f.default for f in dataclasses.fields(SamplingParams)}


#: How the generation models' UNAVAILABLE messages (a shutdown) start: a gRPC
#: stream carries an error's text without its status, so the OpenAI front
#: door tells a shutdown by it.
SHUTTING_DOWN = "the server is shutting down"
#: Why a server of LlmSettings.decoupled_mode false refuses a stream, and a
#: request of several generations (each has responses of its own).
ANSWERS_ONCE = ("this server's llm model is not decoupled (decoupled_mode false) and answers "
                "each request once")
#: How a sampler's refusal of a request made for another hot set begins
#: (``triton.sampler_serve.check_hot_set``): the decode loop tells it at start.
HOT_SET_REFUSAL = "hot_vocab_fingerprint: "
#: The top logprobs outputs, the generation models' ([tokens, n]) and the
#: sampler's ([B, n]): token ids, then their logprobs, most likely first.
TOP_OUTPUTS = ("top_logprobs_ids", "top_logprobs")
#: The prompt's scores (``prompt_logprobs``): its ids [T], each token's
#: logprob after the first and its rank there [T - 1], the n most likely at
#: each place [T - 1, n] (ids, then logprobs).
PROMPT_OUTPUTS = ("prompt_ids", "prompt_log_probs", "prompt_token_ranks",
                  "prompt_top_logprobs_ids", "prompt_top_logprobs")


class InvalidRequest(ValueError):
    """A request refused as the client's mistake (INVALID_ARG, HTTP 400); the
    message names the input and the allowed range. The one type every
    client mistake is raised as (subclasses allowed: the front door's
    ``frontend.protocol.RequestError``), by the codecs (``triton/generate_io``,
    ``triton/sampler_decode``), the request's checks (``serving/generation``,
    ``serving/text``) and the front door; what the models and the front door
    answer 400 for, anything else being ours (5xx)."""


@dataclass(frozen=True)
class Tensor:
    """One input or output of a model.

    dtype: Triton's name (BYTES is config.pbtxt's TYPE_STRING); dtypes: all
    the model can be configured for (the first is the default). param: the
    ``SamplingParams`` field it carries, whose default and allowed range are
    then the tensor's unless given. default / allowed: what absence means
    and which values are accepted, as text for people (the codecs apply
    them).
    """

    name: str
    dtype: str
    dims: tuple[int, ...] = (1,)
    optional: bool = True
    param: str = ""
    default: object = None
    allowed: str = ""
    dtypes: tuple[str, ...] = ()

    def __post_init__(self):
        if self.param:
            if self.default is None:
                object.__setattr__(self, "default", _PARAM_DEFAULTS[self.param])
            if not self.allowed:
                object.__setattr__(self, "allowed", _ALLOWED.get(self.param, ""))
        if not self.dtypes:
            object.__setattr__(self, "dtypes", (self.dtype,))

    @property
    def config_type(self) -> str:
        """The data_type config.pbtxt writes."""
        return "TYPE_STRING" if self.dtype == "BYTES" else f"TYPE_{self.dtype}"

    @property
    def numpy(self):
        return NUMPY[self.dtype]

    @property
    def scalar(self) -> bool:
        """One value per row (a [B, 1] tensor)."""
        return self.dims == (1,)


@dataclass(frozen=True)
class Model:
    name: str
    inputs: tuple[Tensor, ...]
    outputs: tuple[Tensor, ...]

    def input(self, name: str) -> Tensor:
        return next(t for t in self.inputs if t.name == name)

    def output(self, name: str) -> Tensor:
        return next(t for t in self.outputs if t.name == name)

    @property
    def input_names(self) -> tuple[str, ...]:
        return tuple(t.name for t in self.inputs)

    @property
    def output_names(self) -> tuple[str, ...]:
        return tuple(t.name for t in self.outputs)


def scalar(name, dtype, default=None, allowed="", param=""):
    """A [B, 1] tensor: one value per row."""
    return Tensor(name, dtype, param=param, default=default, allowed=allowed)


def sampling_tensors(top_k: str, top_p: str, temperature_allowed: str = "",
                     top_p_allowed: str = ""):
    """The SamplingParams both interfaces carry (one tensor per ``params.RULES``
    entry), top_k and top_p named as TensorRT-LLM names them there."""
    names = {"top_k": top_k, "top_p": top_p}
    allowed = {"temperature": temperature_allowed, "top_p": top_p_allowed}
    return tuple(scalar(names.get(p.name, p.name), _TRITON_DTYPE[np.dtype(p.dtype).kind],
                         param=p.name, allowed=allowed.get(p.name, "")) for p in RULES)
