"""A request's grammar (``serving.structured.Guide``) from what OpenAI and
vLLM clients send: OpenAI's ``response_format`` (``json_object``, or
``json_schema`` with its ``schema``), vLLM's ``structured_outputs`` object,
and vLLM's older ``guided_json``, ``guided_regex``, ``guided_choice`` and
``guided_grammar`` fields. At most one of them; each becomes the llm
model's ``guided_decoding_guide_type`` and ``guided_decoding_guide``
inputs, compiled (and a bad grammar refused) where the decode loop runs."""
from __future__ import annotations

import json

from ..schema import InvalidRequest
from ..serving.structured import VLLM_BACKENDS, Guide
from .protocol import RequestError, Sampling

#: vLLM's older fields, each one grammar field of ``structured_outputs``
GUIDED_FIELDS = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
                 "guided_grammar": "grammar"}
#: OpenAI's json_schema object's fields; ``strict`` true asks what every
#: guided request gets here (the output fits the schema)
JSON_SCHEMA_FIELDS = frozenset({"name", "schema", "strict", "description"})


def request_guide(request: Sampling) -> Guide | None:
    """The request's guide, or None; RequestError naming the field."""
    guides = {}
    response_format = request.response_format
    if response_format is not None and response_format.get("type") != "text":
        guides["response_format"] = _response_format(response_format)
    if request.structured_outputs is not None:
        guides["structured_outputs"] = _of_vllm(request.structured_outputs,
                                                "structured_outputs")
    guided = {name: getattr(request, name) for name in GUIDED_FIELDS
              if getattr(request, name) is not None}
    if len(guided) > 1:
        raise RequestError(f"give one of {', '.join(guided)}", sorted(guided)[1])
    if request.guided_whitespace_pattern is not None:
        raise RequestError("guided_whitespace_pattern is not supported by this server",
                           "guided_whitespace_pattern")
    backend = request.guided_decoding_backend
    if backend is not None and (backend not in VLLM_BACKENDS or not guided):
        raise RequestError(f"guided_decoding_backend must be one of {', '.join(VLLM_BACKENDS)} "
                           f"(grammars are llguidance's here), with a guided_* field",
                           "guided_decoding_backend")
    for name, value in guided.items():
        guides[name] = _of_vllm({GUIDED_FIELDS[name]: value}, name)
    if len(guides) > 1:
        first, second = list(guides)[:2]
        raise RequestError(f"{first} and {second} each ask for a grammar: give one", second)
    if guides and request.ignore_eos:
        raise RequestError("ignore_eos cannot be given with a grammar: it ends the answer at "
                           "the end of sequence", "ignore_eos")
    for field, guide in guides.items():
        try:  # here: a refusal from the llm model would come back a 500
            guide.check(field)  # named as the client sent it
        except InvalidRequest as error:
            raise RequestError(str(error), field) from None
        return guide
    return None


def _response_format(response_format: dict) -> Guide:
    """OpenAI's ``response_format`` (not ``text``) as a guide."""
    kind = response_format.get("type")
    if kind not in ("json_object", "json_schema"):
        raise RequestError(f"response_format.type must be text, json_object or json_schema, "
                           f"got {kind!r}", "response_format")
    if unknown := sorted(set(response_format) - {"type", "json_schema"}):
        raise RequestError(f"response_format.{unknown[0]} is not a field of it",
                           f"response_format.{unknown[0]}")
    if kind == "json_object":
        if "json_schema" in response_format:
            raise RequestError("response_format.json_schema goes with type json_schema",
                               "response_format.json_schema")
        return Guide("json")
    spec = response_format.get("json_schema")
    if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict):
        raise RequestError("response_format.json_schema must be an object whose schema is a "
                           "JSON schema (an object)", "response_format.json_schema")
    if unknown := sorted(set(spec) - JSON_SCHEMA_FIELDS):
        raise RequestError(f"response_format.json_schema.{unknown[0]} is not a field of it",
                           f"response_format.json_schema.{unknown[0]}")
    return Guide("json_schema", json.dumps(spec["schema"]))


def _of_vllm(fields, place: str) -> Guide:
    """``Guide.of_vllm``'s refusal as the OpenAI error naming `place`."""
    try:
        return Guide.of_vllm(fields, place)
    except InvalidRequest as error:
        raise RequestError(str(error), place) from None
