"""The data planes by name: what ``--engine NAME`` builds, tokenizes with,
waits for at startup and labels its outputs with.

Adding an engine touches its module, one :class:`EngineSpec` in
:data:`ENGINES` and its settings (its name in ``settings.ENGINE_NAMES``, fields of
its own in ``LlmSettings`` with ``engines=(name,)``; tests/test_settings.py
holds the names to this registry). No other module compares engine names.

This module imports nothing heavy (the CLI and the launcher read it): each
engine's module, and torch or TensorRT-LLM with it, loads when it is built.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

from ..settings import SIMULATED_DTYPES, SIMULATED_LABEL, TORCH_DTYPES, LlmSettings
from .trtllm_api import read_logits_dtype

if TYPE_CHECKING:  # annotations only: text and engine import torch
    from .engine import Engine
    from .text import TextCodec

#: What every output of a run over random weights says (``--model-config``).
RANDOM_WEIGHTS_LABEL = "RANDOM WEIGHTS (the shape's step times, not its tokens)"
#: Seconds the launcher waits for the models to load, unless an engine says more.
DEFAULT_STARTUP_TIMEOUT_S = 180.0


@dataclass(frozen=True)
class EngineSpec:
    """One data plane.

    build: the engine for validated settings.
    codec: the text codec its token ids are decoded with.
    startup_timeout_s: how long the launcher waits for the llm model to load.
    logits_dtype: the sampler's name for the dtype its rows come in, which
        the sampler is configured for (the torch and static engines'
        ``torch_dtype``, the simulated engine's ``sim_dtype``, a prebuilt
        TensorRT-LLM engine's ``logits_dtype``); None when the rows are
        float32 that the sampler's own ``--logits-dtype`` applies to.
    label: what every output of a run on it is labelled with ("" for a real
        model); ``describe`` says more, for the ready line.
    runs_model: False when no model runs (``--model`` then names only the
        tokenizer), so no model-specific profile applies.
    hot_profile: the shipped SmolLM2 hot profile as it applies to the
        engine's rows (the simulated bank keeps SmolLM2's tokens at other
        ids); None: not at all unless the model is SmolLM2.
    vocab_size: the token ids its rows cover, from the settings and its
        codec (the tokenizer's size for a real model), without building it.
    """

    name: str
    build: Callable[[LlmSettings], "Engine"]
    codec: Callable[[LlmSettings], "TextCodec"]
    startup_timeout_s: float = DEFAULT_STARTUP_TIMEOUT_S
    logits_dtype: Callable[[LlmSettings], str | None] = lambda settings: None
    label: str = ""
    describe: Callable[[LlmSettings], str] = lambda settings: ""
    runs_model: bool = True
    hot_profile: Callable | None = None
    vocab_size: Callable[[LlmSettings, "TextCodec"], int] = \
        lambda settings, codec: len(codec.tokenizer)


def _build_torch(settings: LlmSettings) -> "Engine":
    # lazy: torch and transformers load for this engine only
    from .device import resolve
    from .torch_engine import TorchEngine

    device, dtype = resolve(settings.device, settings.torch_dtype)
    # inline samples on the engine's device; every other mode takes host rows.
    return TorchEngine.from_source(settings.model or None, device=device, dtype=dtype,
                                   max_batch_size=settings.engine_max_batch_size,
                                   max_context=settings.max_context,
                                   batch_invariant=settings.batch_invariant,
                                   host_logits=settings.sampling_mode != "inline")


def _build_static(settings: LlmSettings) -> "Engine":
    # lazy: torch and transformers load for this engine only
    from .device import resolve
    from .static_decode import StaticEngine

    device, dtype = resolve(settings.device, settings.torch_dtype)
    sizes = {"max_batch_size": settings.engine_max_batch_size,
             "max_context": settings.max_context,
             "host_logits": settings.sampling_mode != "inline",
             "compile_decode": settings.compile_decode}
    if settings.model_config:  # random weights of a shipped or given shape
        return StaticEngine.from_config(settings.model_config, device=device, dtype=dtype,
                                        **sizes)
    return StaticEngine.from_source(settings.model or None, device=device, dtype=dtype, **sizes)


def _static_codec(settings: LlmSettings) -> "TextCodec":
    """--model's tokenizer; with --model-config, SmolLM2's (or --model's),
    ids beyond it decoded as placeholders: a random model's tokens mean
    nothing, and its vocabulary may be wider than the tokenizer's."""
    if not settings.model_config:
        return _text_codec(settings)
    return _simulated_codec(settings)


def _config_vocab_size(model_config: str) -> int:
    from .static_decode import config_path  # lazy: torch

    return int(json.loads(config_path(model_config).read_text())["vocab_size"])


def _static_vocab_size(settings: LlmSettings, codec: "TextCodec") -> int:
    return (_config_vocab_size(settings.model_config) if settings.model_config
            else len(codec.tokenizer))


def _static_hot_profile(profile, settings: LlmSettings):
    """The shipped SmolLM2 hot set at a random-weight shape of another
    vocabulary: mapped to its ids as the simulated engine's (its rows are
    nearly flat, so which ids are hot matters little; they must be in range)."""
    from .simulated import simulated_profile  # lazy: torch

    vocab = (_config_vocab_size(settings.model_config) if settings.model_config
             else profile.vocab_size)
    return profile if vocab == profile.vocab_size else simulated_profile(profile, vocab)


def _describe_static(settings: LlmSettings) -> str:
    step = f"{'compiled ' if settings.compile_decode else ''}static decode step on {settings.device}"
    if not settings.model_config:
        return step
    return f"{step}, --model-config {settings.model_config}: {RANDOM_WEIGHTS_LABEL}"


def _build_trtllm(settings: LlmSettings) -> "Engine":
    from .trtllm import TrtLlmEngine  # lazy: TensorRT-LLM is optional and absent without a GPU

    return TrtLlmEngine.from_source(
        settings.model, max_batch_size=settings.engine_max_batch_size,
        max_context=settings.max_context, tensor_parallel_size=settings.tensor_parallel_size,
        pipeline_parallel_size=settings.pipeline_parallel_size)


def _build_simulated(settings: LlmSettings) -> "Engine":
    from .simulated import SimulatedEngine, SimulatedSpec  # lazy: torch

    return SimulatedEngine(SimulatedSpec.from_settings(settings),
                           max_batch_size=settings.engine_max_batch_size,
                           max_context=settings.max_context)


def _text_codec(settings: LlmSettings) -> "TextCodec":
    from .text import TextCodec  # lazy: transformers

    return TextCodec.from_source(settings.model or None)


def _torch_logits_dtype(settings: LlmSettings) -> str:
    """The model's dtype: the torch and static engines' rows are not widened."""
    return TORCH_DTYPES[settings.torch_dtype]


def _trtllm_logits_dtype(settings: LlmSettings) -> str | None:
    """What the bridge stages the rows in (``TrtLlmEngine.from_source``):
    the sampler must be configured for the same."""
    return (read_logits_dtype(settings.model) or "fp32") if settings.model else None


def _simulated_codec(settings: LlmSettings) -> "TextCodec":
    from .simulated_text import SimulatedCodec  # lazy: transformers

    return SimulatedCodec.from_source(settings.model or None)


def _simulated_hot_profile(profile, settings: LlmSettings):
    from .simulated import simulated_profile  # lazy: torch

    return simulated_profile(profile, settings.sim_vocab)


def _describe_simulated(settings: LlmSettings) -> str:
    from .simulated import SimulatedSpec  # lazy: torch

    return f"{SimulatedSpec.from_settings(settings).describe()}; no model runs"


ENGINES: dict[str, EngineSpec] = {spec.name: spec for spec in (
    EngineSpec("torch", _build_torch, _text_codec, logits_dtype=_torch_logits_dtype),
    # The decode step replayed as CUDA graphs (eager on the CPU): the first
    # step of each batch bucket captures its graph, after the model loads.
    EngineSpec("static", _build_static, _static_codec, logits_dtype=_torch_logits_dtype,
               describe=_describe_static, hot_profile=_static_hot_profile,
               vocab_size=_static_vocab_size),
    # A TensorRT engine is built from the checkpoint while the model loads
    # (tens of minutes for a 7-8B model; a restart reads TensorRT-LLM's cache).
    EngineSpec("tensorrt_llm", _build_trtllm, _text_codec, startup_timeout_s=1800.0,
               logits_dtype=_trtllm_logits_dtype),
    EngineSpec("simulated", _build_simulated, _simulated_codec,
               logits_dtype=lambda settings: SIMULATED_DTYPES[settings.sim_dtype],
               label=SIMULATED_LABEL, describe=_describe_simulated, runs_model=False,
               hot_profile=_simulated_hot_profile,
               vocab_size=lambda settings, codec: settings.sim_vocab),
)}


def engine_spec(name: str) -> EngineSpec:
    """The spec of a data plane; ValueError naming the known ones."""
    try:
        return ENGINES[name]
    except KeyError:
        raise ValueError(f"engine must be one of {', '.join(ENGINES)}, got {name!r}") from None


def startup_timeout(engine: str | None) -> float:
    """Seconds the launcher waits for readiness with this data plane (None: sampler only)."""
    return engine_spec(engine).startup_timeout_s if engine else DEFAULT_STARTUP_TIMEOUT_S
