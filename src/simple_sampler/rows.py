"""Logit rows to benchmark and test samplers on: real ones, and synthetic ones.

Real rows (vocabulary 49,152) are next-token logits of SmolLM2-135M-Instruct on
the prompts shipped in ``data/prompts.json``: each prompt is continued greedily
with the KV cache and rows are taken at several decode positions.

Synthetic rows are for vocabularies that have no offline weights here (128,256,
151,936 and 262,144). THEY ARE NOT MODEL OUTPUTS. Each one is made from a real
SmolLM2 row: the real row's sorted logits (its quantile function) are resampled
to the target vocabulary size by linear interpolation on rank, keeping the top
:data:`HEAD_RANKS` values exactly so the head of the distribution is preserved
and stretching the tail, and the result is randomly permuted. Only the shape of
the distribution is fitted to SmolLM2; token identities mean nothing. Any
result measured on them must be labelled with :func:`ROWS_SOURCE`, i.e. as
"synthetic (fitted to smollm2)".

Synthetic hot rows (:func:`synthetic_hot_rows`) are the same shape fit with
SmolLM2's token identities kept: every real token has one fixed place in the
larger vocabulary (:func:`id_map`), so a hot set calibrated on SmolLM2 applies
to them once mapped there (:func:`map_hot_ids`); only the added ids are
shuffled per row. They are labelled :data:`HOT_ROWS_SOURCE`.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import math
import os
import tempfile
from importlib import resources
from pathlib import Path

import numpy as np
import torch

from . import models
from .settings import SMOLLM2_VOCAB  # the real rows' width (its users import it from here)

HEAD_RANKS = 1024
"""Number of top-ranked logits that synthetic rows copy unchanged from their real row."""

SYNTHETIC_SOURCE_ROWS = 64
"""Number of real rows that synthetic rows are fitted to (used cyclically)."""

ROWS_VERSION = "1"
"""Part of the real-rows cache key; bump it when the way rows are taken changes."""

_MIN_DECODE_STEPS = 32


HOT_ROWS_SOURCE = "synthetic (fitted to smollm2, real token ids kept)"
"""The label that results on :func:`synthetic_hot_rows` must carry."""


def ROWS_SOURCE(vocab: int) -> str:  # noqa: N802 - name fixed by the project API
    """Return the label that results on ``vocab``-sized rows must carry."""
    return "smollm2" if vocab == SMOLLM2_VOCAB else "synthetic (fitted to smollm2)"


def rows_for(vocab: int, n: int, seed: int = 0) -> np.ndarray:
    """Return ``n`` logit rows of width ``vocab``: float32 ``[n, vocab]``.

    Real rows (:func:`real_rows`, ``seed`` unused) when ``vocab`` is 49,152,
    synthetic rows (:func:`synthetic_rows`) otherwise.
    """
    if vocab == SMOLLM2_VOCAB:
        return real_rows(n)
    return synthetic_rows(vocab, n, seed)


def load_prompts() -> list[dict]:
    """Return the shipped prompts: a list of ``{"text": str, "chat": bool}``."""
    text = (resources.files(__package__) / "data" / "prompts.json").read_text(encoding="utf-8")
    return json.loads(text)


def real_rows(n: int = 64) -> np.ndarray:
    """Return SmolLM2 next-token logits on the shipped prompts: float32 ``[n, 49152]``.

    Every prompt (chat ones rendered through the chat template with the
    generation prompt) is continued greedily with the KV cache for up to
    ``max(32, 2 * ceil(n / prompts))`` tokens or until an end-of-sequence token.
    The ``n`` rows are split evenly across prompts in file order (the first
    ``n % prompts`` get one more); a prompt whose continuation ends before it
    has enough positions passes its shortfall on to the next prompt. Within a
    prompt, ``k`` rows are taken at the centres of ``k`` equal bins of its decode
    positions, so they are spread over the continuation, not only its first
    token. Rows are ordered by prompt, then position.

    The result is cached as an ``.npy`` file in :func:`models.cache_dir`, keyed by
    ``n``, :data:`ROWS_VERSION` and a hash of the prompts, so later calls only
    read that file.

    Raises:
        ValueError: ``n`` is not positive.
        RuntimeError: the continuations are too short to provide ``n`` rows.
    """
    if n <= 0:
        raise ValueError(f"n must be positive, got {n}")
    prompts = load_prompts()
    prompts_key = hashlib.sha256(json.dumps(prompts, sort_keys=True).encode()).hexdigest()[:12]
    path = models.cache_dir() / f"real_rows-v{ROWS_VERSION}-{prompts_key}-n{n}.npy"
    if path.is_file():
        return np.load(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    # one process computes, the others (pytest's workers, benches) wait and
    # read its file: each computing them too doubled their cost on 2 cores
    with open(path.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if path.is_file():
            return np.load(path)
        rows = _compute_real_rows(prompts, n)
        _save_atomic(path, rows)
    return rows


def synthetic_rows(vocab: int, n: int, seed: int = 0) -> np.ndarray:
    """Return ``n`` synthetic logit rows of width ``vocab``: float32 ``[n, vocab]``.

    Synthetic row ``j`` is built from real row ``j % 64`` of ``real_rows(64)``:
    with ``q`` that row's logits sorted in descending order (length 49,152),
    rank ``r`` of the new row gets ``q[r]`` for ``r < HEAD_RANKS`` and, for the
    remaining ranks, ``q`` linearly interpolated at positions evenly spaced from
    ``HEAD_RANKS`` to 49,151, so the tail keeps its shape while changing length.
    Each row is then permuted by ``numpy.random.default_rng(seed)``. The same
    arguments always give the same rows.

    Raises:
        ValueError: ``vocab`` or ``n`` is not positive.
    """
    if vocab <= 0 or n <= 0:
        raise ValueError(f"vocab and n must be positive, got vocab={vocab}, n={n}")
    quantiles = -np.sort(-real_rows(SYNTHETIC_SOURCE_ROWS), axis=1)
    resampled = resample_quantiles(quantiles, vocab)
    rng = np.random.default_rng(seed)
    out = np.empty((n, vocab), dtype=np.float32)
    for j in range(n):
        out[j] = resampled[j % len(resampled)][rng.permutation(vocab)]
    return out


def id_map(vocab: int, source_vocab: int = SMOLLM2_VOCAB, seed: int = 0) -> np.ndarray:
    """int64 ``[source_vocab]``: distinct ids in ``[0, vocab)``, the fixed place
    of each real token in the synthetic vocabulary of :func:`synthetic_hot_rows`."""
    return np.random.default_rng(seed).permutation(vocab)[:source_vocab]


def map_hot_ids(ids, vocab: int, seed: int = 0) -> np.ndarray:
    """SmolLM2 token ids (a ``HotProfile.order`` prefix, a ``HotVocab``'s ids):
    int ``[n]`` -> int64 ``[n]``, their ids in rows that :func:`synthetic_hot_rows`
    made from SmolLM2 rows with the same ``vocab`` and ``seed``."""
    return id_map(vocab, SMOLLM2_VOCAB, seed)[np.asarray(ids, np.int64)]


def synthetic_hot_rows(real: np.ndarray, vocab: int, seed: int = 0,
                       n: int | None = None) -> np.ndarray:
    """float32 ``[n, vocab]`` rows that keep the token identities of ``real``
    (float32 ``[m, V]``, ``V < vocab``); row ``j`` is made from ``real[j % m]``
    (``n`` defaults to ``m``). NOT MODEL OUTPUTS.

    Real token ``t`` goes to id ``id_map(vocab, V, seed)[t]`` with the value of
    rank ``pos(r)`` of the real row's quantiles resampled to ``vocab``
    (:func:`resample_quantiles`, the values of :func:`synthetic_rows`), ``r``
    its rank in the real row (ties by id): ``pos(r) = r`` below
    :data:`HEAD_RANKS`, then stretched linearly so that rank ``V - 1`` lands
    on ``vocab - 1``. The other ranks' values go to the ``vocab - V`` added
    ids in a fresh random order per row (``default_rng(seed + 1)``), so rows
    made from the same real row differ only there. The same arguments always
    give the same rows.
    """
    m, source = real.shape
    n = m if n is None else n
    mapping = id_map(vocab, source, seed)
    added = np.setdiff1d(np.arange(vocab), mapping)
    head = min(HEAD_RANKS, source)
    positions = np.arange(source, dtype=np.float64)
    positions[head:] = head + (positions[head:] - head) * (vocab - 1 - head) / (source - 1 - head)
    positions = np.round(positions).astype(np.int64)
    free = np.setdiff1d(np.arange(vocab), positions)
    values = resample_quantiles(-np.sort(-real, axis=1), vocab)
    # Per real row once, not per output row: where its tokens go, in rank order.
    ranked_ids = np.stack([mapping[np.lexsort((np.arange(source), -row))] for row in real])
    rng = np.random.default_rng(seed + 1)
    out = np.empty((n, vocab), np.float32)
    for j in range(n):
        source_row = j % m
        out[j, ranked_ids[source_row]] = values[source_row, positions]
        out[j, rng.permutation(added)] = values[source_row, free]
    return out


def resample_quantiles(quantiles: np.ndarray, vocab: int) -> np.ndarray:
    """Resample descending-sorted rows to ``vocab`` ranks, keeping the head exact.

    Args:
        quantiles: float32 ``[rows, V]``, each row sorted in descending order.
        vocab: number of ranks in the output.

    Returns:
        float32 ``[rows, vocab]``, each row descending: ranks below
        ``min(HEAD_RANKS, vocab)`` copied, the rest linearly interpolated at
        positions evenly spaced from that rank to ``V - 1``.
    """
    width = quantiles.shape[1]
    head = min(HEAD_RANKS, vocab, width)
    positions = np.concatenate(
        [np.arange(head, dtype=np.float64), np.linspace(head, width - 1, vocab - head)]
    )
    lower = np.floor(positions).astype(np.int64)
    upper = np.minimum(lower + 1, width - 1)
    frac = positions - lower
    values = quantiles[:, lower] * (1.0 - frac) + quantiles[:, upper] * frac
    return values.astype(np.float32)


def _compute_real_rows(prompts: list[dict], n: int) -> np.ndarray:
    """Run SmolLM2 over ``prompts`` and take ``n`` rows as :func:`real_rows` describes."""
    model, tokenizer = models.load_smollm2()
    ends = eos_ids(model, tokenizer)
    steps = max(_MIN_DECODE_STEPS, 2 * math.ceil(n / len(prompts)))
    base, extra = divmod(n, len(prompts))
    taken: list[np.ndarray] = []
    carry = 0
    for i, prompt in enumerate(prompts):
        want = base + (i < extra) + carry
        if want == 0:
            continue
        logits = _greedy_logits(model, prompt_ids(tokenizer, prompt), steps, ends)
        count = min(want, len(logits))
        carry = want - count
        positions = ((np.arange(count) + 0.5) * len(logits) / count).astype(np.int64)
        taken.append(logits[positions])
    if carry:
        raise RuntimeError(f"greedy continuations gave fewer than n={n} positions")
    return np.concatenate(taken).astype(np.float32)


def prompt_ids(tokenizer, prompt: dict) -> list[int]:
    """Token ids of a shipped prompt (``{"text", "chat"}``, see :func:`load_prompts`);
    chat prompts go through the chat template with the generation prompt."""
    text = prompt["text"]
    if prompt["chat"]:
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True
        )
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def eos_ids(model, tokenizer) -> set[int]:
    """Token ids that end a continuation: the generation config's and the tokenizer's."""
    configured = model.generation_config.eos_token_id
    ids = set(configured if isinstance(configured, list) else [configured])
    ids.add(tokenizer.eos_token_id)
    ids.discard(None)
    return ids


@torch.no_grad()
def _greedy_logits(model, input_ids: list[int], steps: int, eos_ids: set[int]) -> np.ndarray:
    """Greedy-decode with the KV cache; return each step's next-token logits.

    Returns:
        float32 ``[L, vocab]`` with ``1 <= L <= steps``: row 0 is the distribution
        after the prompt, row ``t`` the one after ``t`` generated tokens. Decoding
        stops after the row whose argmax is an end-of-sequence token.
    """
    out = model(input_ids=torch.tensor([input_ids]), use_cache=True, logits_to_keep=1)
    rows = []
    for step in range(steps):
        logits = out.logits[0, -1].float()
        rows.append(logits.numpy().copy())
        token = int(logits.argmax())
        if token in eos_ids or step == steps - 1:
            break
        out = model(
            input_ids=torch.tensor([[token]]),
            past_key_values=out.past_key_values,
            use_cache=True,
        )
    return np.stack(rows)


def _save_atomic(path: Path, array: np.ndarray) -> None:
    """Write ``array`` to ``path`` as ``.npy`` via a temporary file and a rename."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as fh:
            np.save(fh, array)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise
