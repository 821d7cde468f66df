"""TensorRT-LLM's Python API as the engine loads it, and what an engine
directory or checkpoint says: its vocabulary, logits dtype and build limits
(the engine itself: ``serving/trtllm.py``).

Nothing here imports torch, nor TensorRT-LLM outside :func:`load_tensorrt_llm`:
the engine registry (``serving/engines.py``) reads a model's logits dtype
through this module in the launcher's process."""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import NamedTuple, Sequence

ENGINE_CACHE_ENV = "SIMPLE_SAMPLER_ENGINE_CACHE"
"""Where TensorRT-LLM's build cache keeps engines built from checkpoints
(default ``~/.cache/simple-sampler/tensorrt_llm``): a restart with the same
checkpoint and limits loads the engine instead of building it again."""
DEFAULT_MAX_NUM_TOKENS = 8192  # TensorRT-LLM's BuildConfig default (llmapi/llm_args.py)


class TrtLlmApi(NamedTuple):
    """The TensorRT-LLM names the adapter uses (``tests/trtllm_api.json``)."""

    LLM: type
    SamplingParams: type
    BuildCacheConfig: type | None = None  # None: no build cache (engines are rebuilt)
    version: str = "unknown"


def load_tensorrt_llm() -> TrtLlmApi:
    """TensorRT-LLM's TensorRT backend: the only one that calls a batched
    logits processor.

    1.x: ``tensorrt_llm._tensorrt_engine.LLM`` (``_tensorrt_engine/__init__.py``);
    there ``tensorrt_llm.LLM`` is the PyTorch backend, which accepts the
    processor and never calls it, so every request would hang: a 1.x or later
    release without ``_tensorrt_engine`` is refused, naming its version. 0.x:
    ``tensorrt_llm.LLM`` is the TensorRT backend. Raises ImportError when
    TensorRT-LLM is not installed; nothing else in this project imports it."""
    import tensorrt_llm

    version = str(getattr(tensorrt_llm, "__version__", "unknown"))
    try:
        from tensorrt_llm._tensorrt_engine import LLM
    except ImportError as missing:
        if not version.startswith("0."):
            raise ImportError(
                f"TensorRT-LLM {version} has no tensorrt_llm._tensorrt_engine.LLM (the TensorRT "
                f"backend), and its tensorrt_llm.LLM is the PyTorch backend, which never calls "
                f"batched logits processors: every request would hang. Use a release with the "
                f"TensorRT backend (0.x, or 1.x with _tensorrt_engine; docs/GPU.md)") from missing
        from tensorrt_llm import LLM
    from tensorrt_llm import SamplingParams
    try:  # llmapi/build_cache.py, exported by tensorrt_llm.llmapi
        from tensorrt_llm.llmapi import BuildCacheConfig
    except ImportError:
        BuildCacheConfig = None
    return TrtLlmApi(LLM, SamplingParams, BuildCacheConfig, version)


def engine_build_config(model: str | os.PathLike) -> dict | None:
    """A prebuilt TensorRT-LLM engine directory's ``build_config`` (its
    config.json, written by ``tensorrt_llm/builder.py`` ``EngineConfig``), or
    None for a Hugging Face checkpoint (built at start)."""
    config = json.loads((Path(model) / "config.json").read_text())
    build = config.get("build_config")
    return build if isinstance(build, dict) else None


def check_engine_limits(model: str | os.PathLike, build: dict, max_batch_size: int,
                        max_context: int) -> None:
    """ValueError naming the field when a prebuilt engine's limits are below
    what the flags ask: TensorRT-LLM would reject (or hang) requests the
    decode loop admits."""
    for field, need, flag in (("max_batch_size", max_batch_size, "--engine-max-batch-size"),
                              ("max_input_len", max_context - 1, "--max-context - 1"),
                              ("max_seq_len", max_context, "--max-context")):
        have = build.get(field)
        if have is not None and int(have) < need:
            raise ValueError(f"the prebuilt engine {model} has {field}={have}, below the {need} "
                             f"that {flag} needs: lower the flag or rebuild the engine")


def read_logits_dtype(model: str | os.PathLike) -> str | None:
    """The sampler's name (fp32, fp16, bf16) for the dtype a prebuilt
    engine's rows come in (``config.json``: ``pretrained_config.logits_dtype``,
    TensorRT-LLM's ``PretrainedConfig``): the dtype the processor stages
    them in and the sampler is configured for (``engines.ENGINES``). None
    for a Hugging Face checkpoint or a config that says nothing: float32,
    TensorRT-LLM's default logits dtype."""
    try:
        config = json.loads((Path(model) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    dtype = (config.get("pretrained_config") or {}).get("logits_dtype")
    return {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16"}.get(dtype)


def read_vocab_size(model: str | os.PathLike) -> int:
    """The vocabulary of a Hugging Face checkpoint (``config.json``:
    ``vocab_size``) or a TensorRT-LLM engine directory (``config.json``:
    ``pretrained_config.vocab_size``)."""
    config = json.loads((Path(model) / "config.json").read_text())
    size = config.get("vocab_size") or config.get("pretrained_config", {}).get("vocab_size")
    if not size:
        raise ValueError(f"{model}/config.json names no vocab_size")
    return int(size)


def engine_limits(api: TrtLlmApi, model: str | os.PathLike, max_batch_size: int,
                  max_context: int, build_cache_dir: str | os.PathLike | None = None) -> dict:
    """The ``LLM`` keywords that fix the engine's limits: a prebuilt engine's
    are checked against ours (``check_engine_limits``), a checkpoint is
    built with them through the build cache. The same for the served engine
    and ``launch.gpu_check``'s reference run, so the second loads the first's
    cached engine."""
    limits = dict(max_batch_size=max_batch_size, max_seq_len=max_context)
    build = engine_build_config(model)
    if build is not None:  # prebuilt: its limits are fixed, check them against ours
        check_engine_limits(model, build, max_batch_size, max_context)
        return limits
    # Built at start: without max_input_len TensorRT-LLM's default (1024)
    # applies and longer prompts fail; max_num_tokens must cover one prompt.
    limits.update(max_input_len=max_context - 1,
                  max_num_tokens=max(DEFAULT_MAX_NUM_TOKENS, max_context))
    if api.BuildCacheConfig is not None:
        cache = Path(build_cache_dir or os.environ.get(ENGINE_CACHE_ENV) or
                     Path.home() / ".cache" / "simple-sampler" / "tensorrt_llm")
        limits["enable_build_cache"] = api.BuildCacheConfig(cache_root=cache)
    return limits


def greedy_reference(model: str | os.PathLike, prompt_ids: Sequence[int], max_tokens: int,
                     max_batch_size: int, max_context: int, api=None,
                     build_cache_dir: str | os.PathLike | None = None) -> list[int]:
    """TensorRT-LLM's own greedy tokens for ``prompt_ids`` (the TensorRT
    backend, no processor of ours, the same limits as the served engine):
    ``max_tokens`` ids, the end id ignored so that any prefix compares. The
    reference ``launch.gpu_check`` holds the served tokens to."""
    api = TrtLlmApi(*(api or load_tensorrt_llm()))
    llm = api.LLM(model=str(model), skip_tokenizer_init=True,
                  **engine_limits(api, model, max_batch_size, max_context, build_cache_dir))
    try:
        params = api.SamplingParams(max_tokens=max_tokens, top_k=1, ignore_eos=True, end_id=0,
                                    pad_id=0, detokenize=False)
        output = llm.generate_async(list(prompt_ids), sampling_params=params,
                                    streaming=False).result()
        # RequestOutput.outputs[0]: executor/result.py CompletionOutput, the beam's new ids.
        return [int(t) for t in output.outputs[0].token_ids]
    finally:
        llm.shutdown()
