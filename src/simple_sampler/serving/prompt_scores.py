"""Prompt logprobs: how likely the model found each token of a prompt, given
the tokens before it (vLLM's ``prompt_logprobs``; OpenAI's legacy
completions ``echo`` with ``logprobs``, which lm-evaluation-harness's
loglikelihood tasks send).

They are the model's own distribution, ``log_softmax`` of its logits in
float32: no temperature, bias or penalty applies, since no prompt token was
sampled (vLLM's default ``raw_logprobs``). An engine that can score a prompt
has ``score_prompt`` (``engine.ScoresPrompts``); the decode loop scores a
request that asks before it queues it (``prompt_scorer.PromptScorer``), and the
scores come as an event of their own, before any token.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np
import torch

#: prompt positions whose [rows, V] float32 logprobs exist at once
ROWS_PER_CHUNK = 64
#: Hugging Face model types whose logits are their head's output alone
#: (``LlamaForCausalLM.forward``: ``self.lm_head(hidden_states[...])``), so a
#: prompt's rows can be made a chunk at a time from its hidden states
PLAIN_HEAD_FAMILIES = ("llama", "mistral", "qwen2", "qwen3")


@dataclass
class PromptScores:
    """A prompt's scores. ``prompt_ids`` int32 [T], the prompt as the model
    read it; ``token_logprobs`` float32 [T - 1], entry i the logprob of
    token i + 1 given tokens 0..i (the first token has none);
    ``token_ranks`` int32 [T - 1], each of those tokens' rank at its place:
    how many tokens are at least as likely, itself among them (1 when no
    other is; vLLM's rank, which counts ties against it);
    ``top_ids`` int32 and ``top_logprobs`` float32 [T - 1, n], at each of
    those positions the n most likely tokens, most likely first, ties by
    lower id (n = 0: empty)."""

    prompt_ids: np.ndarray
    token_logprobs: np.ndarray
    token_ranks: np.ndarray
    top_ids: np.ndarray
    top_logprobs: np.ndarray


def score_prompt_rows(rows: Callable[[int, int], torch.Tensor], prompt_ids: Sequence[int],
                      num_top: int) -> PromptScores:
    """The scores of `prompt_ids` from its logits: ``rows(start, stop)``
    gives float logits [stop - start, V] of positions start..stop - 1 (the
    distribution of the token after each), any dtype and device; they are
    read ROWS_PER_CHUNK positions at a time."""
    ids = np.asarray(prompt_ids, np.int64)
    count = len(ids) - 1
    logprobs = np.empty(count, np.float32)
    ranks = np.empty(count, np.int32)
    top_ids = np.empty((count, num_top), np.int32)
    top_logprobs = np.empty((count, num_top), np.float32)
    for start in range(0, count, ROWS_PER_CHUNK):
        stop = min(start + ROWS_PER_CHUNK, count)
        chunk = torch.log_softmax(rows(start, stop).float(), dim=-1)
        following = torch.as_tensor(ids[start + 1:stop + 1], device=chunk.device)
        chosen = chunk.gather(1, following[:, None])
        logprobs[start:stop] = chosen[:, 0].cpu().numpy()
        ranks[start:stop] = (chunk >= chosen).sum(dim=-1).cpu().numpy()
        if num_top:
            values, order = most_likely(chunk, num_top)
            top_ids[start:stop], top_logprobs[start:stop] = order.cpu().numpy(), values.cpu().numpy()
    return PromptScores(ids.astype(np.int32), logprobs, ranks, top_ids, top_logprobs)


def most_likely(logprobs: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row of float [R, V] its n largest values and their ids [R, n],
    largest first, ties by lower id: the order of a stable descending sort,
    from a top-k (a sort of the whole row only where ties cross the n-th
    place, where a top-k may keep a higher id)."""
    n = min(n, logprobs.shape[-1])
    values, order = logprobs.topk(n, dim=-1)
    by_id = order.sort(dim=-1).values  # then by value, stably: equal values keep id order
    values, ranked = logprobs.gather(1, by_id).sort(dim=-1, descending=True, stable=True)
    order = by_id.gather(1, ranked)
    crowded = (logprobs >= values[:, -1:]).sum(dim=-1) > n
    if bool(crowded.any()):
        rows = crowded.nonzero()[:, 0]
        tied, tied_order = logprobs.index_select(0, rows).sort(dim=-1, descending=True,
                                                               stable=True)
        values[rows], order[rows] = tied[:, :n], tied_order[:, :n]
    return values, order
