"""The static decode step compiled (``StaticEngine(..., compile_decode=True)``):
:class:`CompiledForward`, :class:`StaticForward`'s decode written as plain
functions of tensors and compiled with ``torch.compile`` (inductor), the way
pytorch-labs' gpt-fast reaches the memory bound.

Why: the eager decode step launches some 40 kernels per layer (Hugging Face's
RMSNorm is about 8 elementwise kernels in float32, RoPE about 5 per tensor,
separate q / k / v and gate / up GEMMs, the cache writes, the residual adds);
even replayed as a CUDA graph each costs a few microseconds: a floor under the
small shapes' step that does not move with B (docs/results/gpu-2026-11-28.md).
Here inductor fuses the elementwise work (RMSNorm, RoPE, SiLU times up, the
residual adds) into a few kernels per layer, and two GEMMs are fused by their
weights:

- q / k / v as one matrix (and one bias, Qwen2's), gate / up as one matrix,
  concatenated once at construction from the checkpoint's own weights (a copy:
  those matrices' memory twice over; the model object other code sees is not
  changed);
- one compiled function per layer body, :func:`decode_layer`, called for every
  layer with that layer's tensors as arguments (no modules: dynamo would
  specialize on each module and compile once per layer), one for the
  embedding lookup with RoPE's and the mask's rows (:func:`decode_inputs`) and
  one for the final norm and the output layer (:func:`decode_head`).

The arithmetic is :class:`~.static_decode.StaticForward`'s: RMSNorm exactly as
``LlamaRMSNorm`` computes it (float32 variance, cast back, times the weight),
RoPE from the same table, grouped-query attention over the static cache with
the same boolean mask, SwiGLU. Float32 logits equal the eager step's within
float32 rounding (tests/test_compiled_decode.py). In bfloat16 they are close,
not equal: inductor keeps a fused kernel's intermediates in float32 where the
eager step rounds after each op, so a near-tie can pick another greedy token.

Shapes and recompiles: the batch dimension (the bucket) and the cache's slot
dimension are marked dynamic (``torch._dynamo.maybe_mark_dynamic``), so one
graph serves every bucket above 1 and every engine of the same model, whatever
its max_batch_size; dynamo specializes a dimension of size 1, so bucket 1
compiles once more. The compiled functions are built once per process
(:func:`compiled_step`); dynamo keeps a graph per guarded layer shape (a
model with q/k/v biases is another). What was measured, on the CPU only
(inductor's C++ backend, tests/test_compiled_decode.py's two-layer models and
one-off runs like them): three graphs for the first bucket
(inputs, layer, head), none for any later bucket above 1 nor for a second
engine of another max_batch_size, three for bucket 1, one more for the Qwen2
layer (its biases); the first compile takes seconds to tens of seconds on a
loaded 2-core host, the later ones about a second (not figures to quote). The
GPU (Triton) compile time has NOT been measured: ``bench serve-gpu`` reports
it (forward_only's ``setup_s``, with the graph's capture).

CUDA graphs: :class:`~.static_decode.DecodeGraphs` captures this decode as it
captures the eager one (its warm-up runs compile, before the capture), so
``mode="reduce-overhead"`` (inductor's own graphs) is not used. A compile that
fails (no C++ compiler or Triton, a dynamo error) raises
:class:`CompileDecodeError`, naming the option and the cause.

NOT run on a GPU: written and tested on the CPU; its CUDA test skips without
one.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F

#: the engine option that selects this step (errors name it)
OPTION = "compile_decode"


class CompileDecodeError(RuntimeError):
    """torch.compile could not build the compiled decode step."""


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``LlamaRMSNorm.forward`` (Qwen2's is the same): the variance in
    float32, the normalized row cast back to the input's dtype, then times the
    weight."""
    dtype = x.dtype
    x32 = x.to(torch.float32)
    variance = x32.pow(2).mean(-1, keepdim=True)
    return weight * (x32 * torch.rsqrt(variance + eps)).to(dtype)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Hugging Face's rotate-half RoPE (``apply_rotary_pos_emb``)."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


@dataclass(frozen=True)
class LayerShape:
    """What a layer body needs besides tensors: constants to dynamo (one
    compiled graph per distinct shape, guarded)."""
    heads: int
    kv_heads: int
    head_dim: int
    eps: float


@dataclass(frozen=True)
class LayerWeights:
    """One decoder layer's tensors, fused where two GEMMs read the same input
    (biases None where the checkpoint has none)."""
    input_norm: torch.Tensor
    qkv: torch.Tensor
    qkv_bias: torch.Tensor | None
    out: torch.Tensor
    out_bias: torch.Tensor | None
    post_norm: torch.Tensor
    gate_up: torch.Tensor
    gate_up_bias: torch.Tensor | None
    down: torch.Tensor
    down_bias: torch.Tensor | None

    @classmethod
    def fuse(cls, layer) -> "LayerWeights":
        """Concatenated copies of a Hugging Face Llama / Qwen2 decoder layer's
        q / k / v and gate / up weights, its other tensors as they are."""
        attention, mlp = layer.self_attn, layer.mlp
        qkv = (attention.q_proj, attention.k_proj, attention.v_proj)
        gate_up = (mlp.gate_proj, mlp.up_proj)
        return cls(input_norm=layer.input_layernorm.weight,
                   qkv=torch.cat([p.weight for p in qkv]).detach(), qkv_bias=_cat_bias(qkv),
                   out=attention.o_proj.weight, out_bias=attention.o_proj.bias,
                   post_norm=layer.post_attention_layernorm.weight,
                   gate_up=torch.cat([p.weight for p in gate_up]).detach(),
                   gate_up_bias=_cat_bias(gate_up),
                   down=mlp.down_proj.weight, down_bias=mlp.down_proj.bias)


def _cat_bias(projections) -> torch.Tensor | None:
    biases = [p.bias for p in projections]
    if all(b is None for b in biases):
        return None
    if any(b is None for b in biases):
        raise ValueError("fused projections need a bias on all of them or none")
    return torch.cat(biases).detach()


def decode_inputs(embedding: torch.Tensor, cos_table: torch.Tensor, sin_table: torch.Tensor,
                  context_index: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor):
    """(hidden [b, hidden], cos and sin [b, 1, 1, head_dim], mask [b, 1, 1,
    context]) of one token per slot: ``StaticForward.decode``'s prologue."""
    cos = cos_table[positions][:, None, None, :]
    sin = sin_table[positions][:, None, None, :]
    mask = (context_index[None, :] <= positions[:, None])[:, None, None, :]
    return F.embedding(tokens, embedding), cos, sin, mask


def decode_layer(shape: LayerShape, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 mask: torch.Tensor, positions: torch.Tensor, keys: torch.Tensor,
                 values: torch.Tensor, w: LayerWeights) -> torch.Tensor:
    """One decoder layer over one token per slot ``0 .. b-1`` of ``keys``
    (``hidden`` [b, hidden]), its key and value written into the layer's
    cache ``keys`` / ``values`` [slots, kv_heads, context, head_dim] (the
    slots from a window's first) at ``positions``; the
    layer's output [b, hidden]. ``StaticForward.decode``'s loop body."""
    rows = hidden.shape[0]
    group, dim = shape.heads // shape.kv_heads, shape.head_dim
    q_width, kv_width = shape.heads * dim, shape.kv_heads * dim
    x = rms_norm(hidden, w.input_norm, shape.eps)
    qkv = F.linear(x, w.qkv, w.qkv_bias)
    q = qkv[:, :q_width].reshape(rows, shape.kv_heads, group, dim)
    k = qkv[:, q_width:q_width + kv_width].reshape(rows, shape.kv_heads, 1, dim)
    v = qkv[:, q_width + kv_width:].reshape(rows, shape.kv_heads, dim)
    q, k = rope(q, cos, sin), rope(k, cos, sin)[:, :, 0]
    slots = torch.arange(rows, device=hidden.device)
    keys[slots, :, positions] = k
    values[slots, :, positions] = v
    out = F.scaled_dot_product_attention(q, keys[:rows], values[:rows], attn_mask=mask)
    hidden = hidden + F.linear(out.reshape(rows, q_width), w.out, w.out_bias)
    gate, up = F.linear(rms_norm(hidden, w.post_norm, shape.eps), w.gate_up,
                        w.gate_up_bias).chunk(2, dim=-1)
    return hidden + F.linear(F.silu(gate) * up, w.down, w.down_bias)


def decode_head(hidden: torch.Tensor, norm: torch.Tensor, eps: float,
                output: torch.Tensor) -> torch.Tensor:
    """Logits [b, V] in the model's dtype: the final norm, then the output
    layer (no bias in the families covered)."""
    return F.linear(rms_norm(hidden, norm, eps), output)


@functools.cache
def compiled_step():
    """(inputs, layer, head): the three functions compiled, once per process
    (dynamo keeps their graphs per guarded shape; ``fullgraph``: a graph
    break is an error, not a silent eager fallback)."""
    compile = functools.partial(torch.compile, fullgraph=True)
    return compile(decode_inputs), compile(decode_layer), compile(decode_head)


class CompiledForward:
    """:class:`~.static_decode.StaticForward` whose ``decode`` runs the
    compiled functions over fused weights (module docstring); its prefill,
    the RoPE table and the cache are the eager forward's."""

    def __init__(self, eager):
        model, config = eager.model, eager.model.config
        if config.hidden_act != "silu":
            raise ValueError(f"{OPTION} covers SwiGLU (hidden_act silu), not "
                             f"{config.hidden_act!r}")
        self.eager = eager
        self.keys, self.values = eager.keys, eager.values
        inner = model.model
        self.shape = LayerShape(eager.heads, eager.kv_heads, eager.head_dim,
                                float(config.rms_norm_eps))
        with torch.no_grad():
            self.layers = [LayerWeights.fuse(layer) for layer in eager.layers]
        self.embedding = inner.embed_tokens.weight
        self.norm = inner.norm.weight
        self.output = model.lm_head.weight

    def prefill(self, prompts, slots) -> torch.Tensor:
        return self.eager.prefill(prompts, slots)

    @torch.inference_mode()
    def decode(self, tokens: torch.Tensor, positions: torch.Tensor,
               start: int = 0) -> torch.Tensor:
        """``StaticForward.decode``'s contract, compiled: logits in the model's
        dtype [b, V] of slots ``start .. start+b-1``; CompileDecodeError when
        torch.compile fails."""
        inputs, layer, head = compiled_step()
        try:
            hidden, cos, sin, mask = inputs(self.embedding, self.eager.cos, self.eager.sin,
                                            self.eager.context_index,
                                            *_batch_dynamic(tokens, positions))
            _batch_dynamic(hidden, cos, sin, mask)
            for index, weights in enumerate(self.layers):
                # the cache's slots too: engines of another max_batch_size, and
                # windows of slots (a view from `start`), share the graph
                keys, values = _batch_dynamic(self.keys[index, start:],
                                              self.values[index, start:])
                hidden = layer(self.shape, hidden, cos, sin, mask, positions, keys, values,
                               weights)
            return head(hidden, self.norm, self.shape.eps, self.output)
        except torch._dynamo.exc.TorchDynamoException as error:
            raise CompileDecodeError(
                f"{OPTION}: torch.compile could not build the decode step "
                f"({type(error).__name__}: {_cause(error)}); run without {OPTION}") from error


def _batch_dynamic(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The tensors, their first (batch) dimension marked dynamic: one graph
    for every bucket above 1 (dynamo specializes a size of 1 regardless)."""
    for tensor in tensors:
        torch._dynamo.maybe_mark_dynamic(tensor, 0)
    return tensors


def _cause(error: BaseException) -> str:
    """The innermost cause's type and first line: a backend's failure (no
    C++ compiler, no Triton) is wrapped in dynamo's, whose own first line
    names only the backend."""
    while True:
        inner = getattr(error, "inner_exception", None) or error.__cause__
        if inner is None or inner is error:
            break
        error = inner
    lines = str(error).strip().splitlines()
    return f"{type(error).__name__}: {lines[0] if lines else ''}"
