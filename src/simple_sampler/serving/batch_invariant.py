"""A batch-invariant forward for the PyTorch engine: a sequence's logits at a
step are bitwise the same whatever the other sequences in the step, their
count, their lengths and their order.

How: every token-wise part (norms, projections, MLP, the final norm and
lm_head) runs on tiles of exactly ``tile_rows`` token rows (the last padded
with zero rows), so every GEMM has the same M whatever the batch; attention
runs per sequence over exactly its own cached keys and values, in place; rotary
embeddings come from a table computed once; the engine pins its thread count.
Prefill and decode tokens share the tiles: one forward per step.

Supported: Llama-architecture causal LMs (SmolLM2, the default model), whose
layers this module calls one by one; other models are refused with a clear
error rather than served without the guarantee.

Why the ordinary forward is not invariant (GEMM blocking by M, padded
attention, thread counts), what is tested and what the mode costs:
docs/SERVING.md, "Same seed, same text".
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

#: token rows per GEMM. Every projection runs on [TILE_ROWS, in] tiles: larger
#: tiles waste more padding at low concurrency, smaller ones re-read the weights
#: more often at high concurrency. 8 is a middle ground, not tuned (docs/SERVING.md
#: gives the measured cost).
TILE_ROWS = 8
SUPPORTED = ("llama",)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class InvariantForward:
    """Logits of rows ``(slot, cached, pending)`` over the engine's slot
    cache (``keys``, ``values``: ``[layers, slots, kv_heads, context,
    head_dim]``); see the module docstring."""

    def __init__(self, model, keys: torch.Tensor, values: torch.Tensor,
                 tile_rows: int = TILE_ROWS):
        config = model.config
        if config.model_type not in SUPPORTED:
            raise ValueError(f"batch_invariant supports {', '.join(SUPPORTED)} models "
                             f"(SmolLM2), not {config.model_type!r}; turn it off for this model")
        if tile_rows < 1:
            raise ValueError(f"tile_rows must be >= 1, got {tile_rows}")
        self.model, self.keys, self.values, self.tile_rows = model, keys, values, tile_rows
        self.layers = model.model.layers
        self.heads = config.num_attention_heads
        self.kv_heads = config.num_key_value_heads
        self.head_dim = keys.shape[-1]
        context = keys.shape[3]
        with torch.inference_mode():
            probe = torch.zeros(1, dtype=keys.dtype)
            cos, sin = model.model.rotary_emb(probe, torch.arange(context)[None])
        self.cos, self.sin = cos[0], sin[0]  # [context, head_dim]

    def _tiles(self, x: torch.Tensor):
        return x.split(self.tile_rows)

    def _padded(self, x: torch.Tensor) -> torch.Tensor:
        rows = -(-x.shape[0] // self.tile_rows) * self.tile_rows
        return torch.cat([x, x.new_zeros(rows - x.shape[0], *x.shape[1:])]) if rows > x.shape[0] else x

    def _rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        return x * cos[:, None] + _rotate_half(x) * sin[:, None]

    @torch.inference_mode()
    def __call__(self, work: list[tuple[int, int, list[int]]]) -> torch.Tensor:
        lengths = [len(pending) for _, _, pending in work]
        ends = torch.tensor(lengths).cumsum(0).tolist()
        starts = [end - n for end, n in zip(ends, lengths)]
        ids = torch.tensor([t for _, _, pending in work for t in pending])
        positions = torch.cat([torch.arange(cached, cached + len(pending))
                               for _, cached, pending in work])
        ids, positions = self._padded(ids), self._padded(positions)  # padding: token 0 at 0
        cos, sin = self.cos[positions], self.sin[positions]
        hidden = self.model.model.embed_tokens(ids)
        for index, layer in enumerate(self.layers):
            attention = layer.self_attn
            tiles = map(layer.input_layernorm, self._tiles(hidden))
            q, k, v = (torch.cat(parts) for parts in zip(*(
                (attention.q_proj(h), attention.k_proj(h), attention.v_proj(h)) for h in tiles)))
            q = self._rope(q.view(-1, self.heads, self.head_dim), cos, sin)
            k = self._rope(k.view(-1, self.kv_heads, self.head_dim), cos, sin)
            v = v.view(-1, self.kv_heads, self.head_dim)
            mixed = torch.zeros_like(q)  # padding rows stay zero
            keys, values = self.keys[index], self.values[index]
            for (slot, cached, _), start, end in zip(work, starts, ends):
                total = cached + end - start
                keys[slot, :, cached:total] = k[start:end].transpose(0, 1)
                values[slot, :, cached:total] = v[start:end].transpose(0, 1)
                query = q[start:end].transpose(0, 1)[None]
                mask = None
                if end - start > 1:  # causal, with the query at positions cached..total-1
                    mask = (torch.arange(total)[None, :] <=
                            torch.arange(cached, total)[:, None])
                out = F.scaled_dot_product_attention(
                    query, keys[slot, :, :total][None], values[slot, :, :total][None],
                    attn_mask=mask, scale=attention.scaling, enable_gqa=True)
                mixed[start:end] = out[0].transpose(0, 1)
            mixed = mixed.view(mixed.shape[0], -1)
            hidden = torch.cat([self._block_out(layer, h, m)
                                for h, m in zip(self._tiles(hidden), self._tiles(mixed))])
        last = self._padded(hidden[[end - 1 for end in ends]])
        logits = torch.cat([self.model.lm_head(self.model.model.norm(h)) for h in self._tiles(last)])
        return logits[:len(work)]

    @staticmethod
    def _block_out(layer, hidden: torch.Tensor, mixed: torch.Tensor) -> torch.Tensor:
        """The rest of a decoder layer for one tile: output projection,
        residual, post-attention norm, MLP, residual."""
        hidden = hidden + layer.self_attn.o_proj(mixed)
        return hidden + layer.mlp(layer.post_attention_layernorm(hidden))
