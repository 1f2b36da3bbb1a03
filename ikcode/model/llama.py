"""The Llama / Qwen2 / Qwen3 decoder (RMSNorm, rotate-half RoPE, GQA, SwiGLU, optional q/k/v bias,
optional per-head q/k RMSNorm) over a paged KV pool.

One forward runs a flat batch of rows (tokens of several sequences). Each layer writes the new
tokens' K/V into the pool by slot (block * block_size + offset) and attends per sequence over its
blocks, gathered by block table. Attention is per sequence so one sequence's numbers never depend
on another's.

Batch invariance (temperature-0 determinism). CPU matmul kernels reduce in a different order for
different shapes (here: 1-3 rows take a matrix-vector path; with several threads, row counts that
are not a multiple of 4 split badly), and the SDPA kernel cuts queries and keys into shape-dependent
tiles. A token therefore gets the same numbers whatever else is in the batch, and whether its prefix
came from the cache or was computed, when:
- prompt rows go through matmuls of a multiple of 4 rows (padding rows added by the caller), and
  so does a batch-invariant decode row: it is run as a one-token prompt chunk, so the K/V it
  writes are the bits a later prompt read of the same token computes (an answer cached for the
  next turn, a sequence preempted and read again); every sampled row goes through the output
  layer alone;
- a prompt row at position p is given exactly the keys [0, visible_keys(p)) (a fixed function of p,
  so the kernel's key tiling for that row never depends on how the prompt was chunked; keys past p
  are masked), split at the same fixed point (`attend_group`), in SDPA calls whose last query tile
  is not a 1-3 row remainder (`padded_query_rows`);
- decode rows that may vary with the batch (the throughput mode) attend in one call over a
  padded block table (paged_attention.DecodeBatch).
tests/test_engine_determinism.py checks the outcome token for token and K/V bit for bit, for a
cached prefix, a cached answer read by the next turn, and a preempted request.

Weight layout. Every matmul weight is stored transposed, [in, out], and applied as x @ W: a decode
step is a chain of one-row matmuls bound by memory bandwidth, and MKL streams an [in, out] matrix
markedly faster for one row (measured on this model: the 30 layers' matmuls ~25% faster, the
49,152-row output layer ~1.9x); many-row prompt matmuls are as fast or faster. The rule for a
token's numbers (multiple-of-4 rows, or one row alone) was checked to hold for this layout too,
and for bf16 weights (`matmul_weights_to`, oneDNN's bf16 GEMM on an AVX512-BF16 CPU: each of
SmolLM2's matmuls, 1-256 rows, 1 and 2 threads, gave every row the same bits whatever the row
count). bf16 prompt matmuls run ~2x fp32's speed on such a CPU; elsewhere they are emulated. On a
CPU the decoder layers' fp32 weights are then repacked for oneDNN's GEMM (`pack_for_onednn`: faster
than MKL's from 4 rows up, and a row's bits never depend on the row count); the output layer stays
[in, out] for MKL (a one-row matmul over 49,152 columns: as fast either way).

Speed. Prompt rows are grouped by visible_keys (a multiple of QUERY_GROUP): rows early in a chunk
skip the keys they cannot see (for a 512-token prompt from scratch, ~40% of the attention work),
and a tail after a long cached prefix reads only up to its own group's end. GQA runs with the query
heads that share a KV head stacked as rows of one SDPA head ([kv_heads, group * queries,
head_dim]): no K/V repeat. A prompt group's keys before its own QUERY_GROUP positions go through
an unmasked call on views of the pool; only the last QUERY_GROUP keys carry a mask, built once per
step (`QueryGroup.mask`), not once per layer (paged_attention.py). A decode step reads only the
blocks it really has, and a sequence whose blocks are consecutive in the pool is read in place
instead of gathered.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ikcode.model import quantized
from ikcode.model.config import ModelConfig
from ikcode.model.paged_attention import DecodeBatch, SeqAttention, attend_group

# The decoder layers' matmul weights, each stored [in, out].
_MATMUL_WEIGHTS = ("qkv_weight_t", "o_weight_t", "gate_up_weight_t", "down_weight_t")


def _onednn_packed(weight_t: torch.Tensor) -> torch.Tensor:
    """An [in, out] fp32 matrix in oneDNN's layout for `mkldnn._linear_pointwise`."""
    return torch.ops.mkldnn._reorder_linear_weight(weight_t.t().contiguous())


@dataclass(frozen=True)
class RowGroup:
    """Rows [start, end) that go through one matmul per weight."""

    start: int
    end: int
    # Through the quantized weights when the model has them (LlamaModel.quantize): never for
    # batch-invariant rows (see int8.py, int4.py).
    quantized: bool = False


@dataclass
class ForwardBatch:
    input_ids: torch.Tensor  # long [rows]
    positions: torch.Tensor  # long [rows]
    # long: rows whose K/V go to the pool (padding rows excluded); None: every row, in order
    write_rows: torch.Tensor | None
    write_slots: torch.Tensor  # long: flat pool slot of each of those rows
    seqs: list[SeqAttention]  # attended one sequence at a time
    row_groups: list[RowGroup]
    decode: DecodeBatch | None = None  # decode rows attended all at once


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, self.weight.shape, self.weight, self.eps)  # one fused kernel


def linear_t(x: torch.Tensor, weight_t: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x @ weight_t (+ bias), weight_t stored [in, out]: see "Weight layout" above. bf16 weights
    (LlamaModel.matmul_weights_to) take bf16 activations and give fp32 back; fp32 weights packed
    for oneDNN (LlamaModel.pack_for_onednn) go through its GEMM."""
    if weight_t.is_mkldnn:
        return torch.ops.mkldnn._linear_pointwise(x, weight_t, bias, "none", [], "")
    if weight_t.dtype == torch.bfloat16:
        out = torch.mm(x.to(torch.bfloat16), weight_t).float()
        return out if bias is None else out.add_(bias)
    return torch.mm(x, weight_t) if bias is None else torch.addmm(bias, x, weight_t)


def grouped_linear(
    x: torch.Tensor,
    weight_t: torch.Tensor,
    bias: torch.Tensor | None,
    groups: list[RowGroup],
    packed: quantized.QuantizedWeight | None = None,
) -> torch.Tensor:
    def one(group: RowGroup) -> torch.Tensor:
        rows = x if (group.start, group.end) == (0, x.shape[0]) else x[group.start : group.end]
        if group.quantized and packed is not None:
            return packed.linear(rows)
        return linear_t(rows, weight_t, bias)

    return one(groups[0]) if len(groups) == 1 else torch.cat([one(g) for g in groups])


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        q_out, kv_out = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        self.q_size, self.kv_size = q_out, kv_out
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        # q, k, v (and gate, up) fused: one matmul instead of three (two). Stored [in, out].
        self.qkv_weight_t = nn.Parameter(torch.empty(cfg.hidden_size, q_out + 2 * kv_out))
        self.qkv_bias = nn.Parameter(torch.zeros(q_out + 2 * kv_out)) if cfg.attention_bias else None
        # Qwen3: one weight per head_dim channel, shared by all q heads (resp. all k heads); stacked
        # [q heads + kv heads, head_dim] so q and k are normalised in one call, like RoPE below.
        self.qk_norm_weight = (
            nn.Parameter(torch.ones(cfg.num_heads + cfg.num_kv_heads, cfg.head_dim)) if cfg.qk_norm else None
        )
        self.rms_norm_eps = cfg.rms_norm_eps
        self.o_weight_t = nn.Parameter(torch.empty(q_out, cfg.hidden_size))
        self.gate_up_weight_t = nn.Parameter(torch.empty(cfg.hidden_size, 2 * cfg.intermediate_size))
        self.down_weight_t = nn.Parameter(torch.empty(cfg.intermediate_size, cfg.hidden_size))
        self.packed: dict[str, quantized.QuantizedWeight] = {}  # quantized copies (quantize)

    def quantize(self, kind: quantized.Kind) -> None:
        self.packed = {
            "qkv": quantized.pack(kind, self.qkv_weight_t, self.qkv_bias),
            "o": quantized.pack(kind, self.o_weight_t),
            "gate_up": quantized.pack(kind, self.gate_up_weight_t),
            "down": quantized.pack(kind, self.down_weight_t),
        }

    def attention(
        self,
        x: torch.Tensor,
        batch: ForwardBatch,
        cos: torch.Tensor,
        sin: torch.Tensor,
        k_pool: torch.Tensor,
        v_pool: torch.Tensor,
    ) -> torch.Tensor:
        rows = x.shape[0]
        qkv = grouped_linear(x, self.qkv_weight_t, self.qkv_bias, batch.row_groups, self.packed.get("qkv"))
        qk, v = qkv.split([self.q_size + self.kv_size, self.kv_size], dim=-1)
        qk = qk.view(rows, self.num_heads + self.num_kv_heads, self.head_dim)
        if self.qk_norm_weight is not None:
            qk = F.rms_norm(qk, (self.head_dim,), None, self.rms_norm_eps) * self.qk_norm_weight
        # q and k heads rotated together. Rotate-half RoPE, x * cos + [-x2, x1] * sin, as
        # x * cos + [x2, x1] * [-sin1, sin2]: one roll instead of two slices, a negation and a cat
        # (the same products, so the same numbers).
        qk = qk * cos + qk.roll(self.head_dim // 2, dims=-1) * sin
        q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
        v = v.view(rows, self.num_kv_heads, self.head_dim)
        if batch.write_rows is not None:  # padding rows write nothing
            k, v = k.index_select(0, batch.write_rows), v.index_select(0, batch.write_rows)
        k_pool.view(-1, self.num_kv_heads, self.head_dim).index_copy_(0, batch.write_slots, k)
        v_pool.view(-1, self.num_kv_heads, self.head_dim).index_copy_(0, batch.write_slots, v)
        if not batch.seqs and batch.decode is not None:  # decode rows only: one call is the output
            out = batch.decode.attend(q, k_pool, v_pool, self.num_kv_heads)
        else:
            out = self._attend_rows(q, batch, k_pool, v_pool)
        return grouped_linear(out, self.o_weight_t, None, batch.row_groups, self.packed.get("o"))

    def _attend_rows(
        self, q: torch.Tensor, batch: ForwardBatch, k_pool: torch.Tensor, v_pool: torch.Tensor
    ) -> torch.Tensor:
        """Attention output [rows, q_size] of a batch with prompt or batch-invariant rows: each
        sequence's query groups over its own keys, then the shared decode rows in one call."""
        rows = q.shape[0]
        out = torch.empty(rows, self.q_size, dtype=q.dtype, device=q.device)
        if batch.write_rows is not None and batch.write_rows.numel() < rows:
            out.zero_()  # padding rows (every other row writes K/V): keep them finite
        kvh, hd, group = self.num_kv_heads, self.head_dim, self.num_heads // self.num_kv_heads
        for s in batch.seqs:
            # Read (or gathered) once per sequence; each group takes a prefix of the keys (a view).
            kk, vv = s.keys_and_values(k_pool, v_pool)
            for g in s.groups:
                n, qrows, r0 = g.num_rows, g.query_rows, g.row_start
                # [n, heads, hd] -> [kv_heads, group, queries, hd]: heads sharing a KV head as rows.
                qq = q[r0 : r0 + n].view(n, kvh, group, hd).permute(1, 2, 0, 3)
                if qrows > n:
                    qq = F.pad(qq, (0, 0, 0, qrows - n))
                qq = qq.reshape(1, kvh, group * qrows, hd)
                o = attend_group(qq, kk, vv, g).view(kvh, group, qrows, hd)[:, :, :n].permute(2, 0, 1, 3)
                out[r0 : r0 + n] = o.reshape(n, self.q_size)
        if batch.decode is not None:
            d0 = batch.decode.row_start
            d1 = d0 + batch.decode.block_table.shape[0]
            out[d0:d1] = batch.decode.attend(q[d0:d1], k_pool, v_pool, kvh)
        return out

    def mlp(self, x: torch.Tensor, groups: list[RowGroup]) -> torch.Tensor:
        packed = self.packed
        gate, up = grouped_linear(x, self.gate_up_weight_t, None, groups, packed.get("gate_up")).chunk(
            2, dim=-1
        )
        return grouped_linear(F.silu(gate).mul_(up), self.down_weight_t, None, groups, packed.get("down"))

    def forward(
        self,
        x: torch.Tensor,
        batch: ForwardBatch,
        cos: torch.Tensor,
        sin: torch.Tensor,
        k_pool: torch.Tensor,
        v_pool: torch.Tensor,
    ) -> torch.Tensor:
        # .forward, not __call__: modules without hooks, called 60 times a step.
        x = x + self.attention(self.input_layernorm.forward(x), batch, cos, sin, k_pool, v_pool)
        return x.add_(self.mlp(self.post_attention_layernorm.forward(x), batch.row_groups))


class LlamaModel(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(
            cfg.vocab_size, cfg.hidden_size, _weight=torch.empty(cfg.vocab_size, cfg.hidden_size)
        )
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        # The output layer [hidden, vocab]; when tied, a transposed copy of the embedding table (the
        # table itself stays [vocab, hidden] for row lookups).
        self.lm_head_t = nn.Parameter(torch.empty(cfg.hidden_size, cfg.vocab_size))
        inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, cfg.head_dim, 2).float() / cfg.head_dim))
        freqs = torch.outer(torch.arange(cfg.max_position_embeddings).float(), inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        ones = torch.ones_like(freqs)
        self.register_buffer("rope_cos", emb.cos(), persistent=False)
        # sin with its first half negated: see DecoderLayer.attention.
        self.register_buffer("rope_sin", emb.sin() * torch.cat((-ones, ones), dim=-1), persistent=False)
        self.lm_head_packed: quantized.QuantizedWeight | None = None

    def quantize(self, kind: quantized.Kind) -> int:
        """Add `kind` copies of every matmul weight (batch-invariant rows keep the float weights);
        returns the bytes they take. Taken from fp32 weights: before matmul_weights_to."""
        first = self.layers[0].qkv_weight_t
        if first.dtype != torch.float32 or first.is_mkldnn:
            raise RuntimeError("quantize from the fp32 weights, before matmul_weights_to or pack_for_onednn")
        for layer in self.layers:
            layer.quantize(kind)
        # The output layer stays int8 under int4: GGUFs keep it at 8 bits or more (SmolLM2's is
        # the tied Q8_0 embedding), and 4 bits there cost the most. Measured with
        # bench/quantized_quality.py: int4 everywhere, perplexity +6.6% and greedy answers apart
        # from fp32 after 9.6 tokens on average (20 prompts); int8 output layer, -0.4% and 48.5.
        self.lm_head_packed = quantized.pack("int8" if kind == "int4" else kind, self.lm_head_t)
        packs = [self.lm_head_packed] + [p for layer in self.layers for p in layer.packed.values()]
        return sum(p.nbytes for p in packs)

    def pack_for_onednn(self) -> None:
        """Keep the decoder layers' fp32 matmul weights in oneDNN's own layout and multiply
        through its GEMM (`mkldnn._linear_pointwise`, the op torch's CPU compiler emits for a
        linear layer) instead of MKL's. `bench/onednn_matmul.py`, SmolLM2-135M's shapes, 30
        layers, two threads of an AVX2 EPYC: 4 rows 43 vs 166 ms, 32 rows 106 vs 201, 256 rows
        436 vs 557; one row about even (40 vs 35). A row's bits never depend on the rows beside it,
        one row included (the same bench; tests/test_engine_determinism.py checks the outcome).
        The packed weight replaces the plain one (no second copy); quantize first. Raises
        RuntimeError, changing nothing, where oneDNN cannot run the first matmul right."""
        first = self.layers[0].qkv_weight_t.detach()
        x = torch.randn(4, first.shape[0], generator=torch.Generator().manual_seed(0))
        got = linear_t(x, _onednn_packed(first), None)  # the path every packed matmul takes
        if not torch.allclose(got, x @ first, rtol=1e-4, atol=1e-4):
            raise RuntimeError("oneDNN's linear does not match torch.mm here")
        for layer in self.layers:
            for name in _MATMUL_WEIGHTS:
                packed = _onednn_packed(getattr(layer, name).detach())
                delattr(layer, name)  # a Parameter cannot hold an opaque oneDNN tensor
                setattr(layer, name, packed)

    def matmul_weights_to(self, dtype: torch.dtype) -> None:
        """Keep the decoder layers' matmul weights (not norms, embeddings or the output layer) in
        `dtype`. Quantized copies are taken from the fp32 weights: quantize first."""
        for layer in self.layers:
            for name in _MATMUL_WEIGHTS:
                weight = getattr(layer, name)
                setattr(layer, name, nn.Parameter(weight.detach().to(dtype), requires_grad=False))

    def load_hf_state_dict(self, sd: dict[str, torch.Tensor]) -> None:
        """Take weights named as Hugging Face names them (q/k already in rotate-half order)."""
        cfg = self.cfg
        with torch.no_grad():
            self.embed_tokens.weight.copy_(sd["model.embed_tokens.weight"])
            self.norm.weight.copy_(sd["model.norm.weight"])
            head = sd.get("lm_head.weight")
            if head is None or cfg.tie_word_embeddings:
                head = sd["model.embed_tokens.weight"]
            self.lm_head_t.copy_(head.t())
            for i, layer in enumerate(self.layers):
                p = f"model.layers.{i}."
                a = p + "self_attn."
                layer.qkv_weight_t.copy_(torch.cat([sd[a + f"{n}_proj.weight"] for n in "qkv"]).t())
                if layer.qkv_bias is not None:
                    layer.qkv_bias.copy_(torch.cat([sd[a + f"{n}_proj.bias"] for n in "qkv"]))
                if layer.qk_norm_weight is not None:
                    q_norm, k_norm = sd[a + "q_norm.weight"], sd[a + "k_norm.weight"]
                    layer.qk_norm_weight.copy_(
                        torch.cat([q_norm.expand(cfg.num_heads, -1), k_norm.expand(cfg.num_kv_heads, -1)])
                    )
                layer.o_weight_t.copy_(sd[a + "o_proj.weight"].t())
                m = p + "mlp."
                gate_up = torch.cat([sd[m + "gate_proj.weight"], sd[m + "up_proj.weight"]])
                layer.gate_up_weight_t.copy_(gate_up.t())
                layer.down_weight_t.copy_(sd[m + "down_proj.weight"].t())
                layer.input_layernorm.weight.copy_(sd[p + "input_layernorm.weight"])
                layer.post_attention_layernorm.weight.copy_(sd[p + "post_attention_layernorm.weight"])

    def forward(self, batch: ForwardBatch, k_pools: torch.Tensor, v_pools: torch.Tensor) -> torch.Tensor:
        """Hidden states [rows, hidden] after the last layer (before the final norm)."""
        x = self.embed_tokens(batch.input_ids)
        cos = self.rope_cos[batch.positions].unsqueeze(1)
        sin = self.rope_sin[batch.positions].unsqueeze(1)
        for i, layer in enumerate(self.layers):
            x = layer.forward(x, batch, cos, sin, k_pools[i], v_pools[i])
        return x

    def logits(self, hidden_rows: torch.Tensor, alone: list[bool]) -> torch.Tensor:
        """Logits of the selected rows. A row marked alone goes through its own one-row fp32
        matmul (the same kernel whatever else samples in the step: batch-invariant; with [in, out]
        weights a one-row matmul streams the 49,152-column output layer about as fast per row as
        a 4-row one); the others share one matmul (quantized when the model is), so the output layer is
        read once for all of them."""
        h = self.norm(hidden_rows)
        shared = [i for i, a in enumerate(alone) if not a]
        if len(shared) == len(alone):  # no row alone: no scatter of [rows, vocab] into `out`
            return self._shared_logits(h)
        out = torch.empty(h.shape[0], self.lm_head_t.shape[1], dtype=h.dtype, device=h.device)
        if shared:
            index = torch.tensor(shared, device=h.device)
            out[index] = self._shared_logits(h[index])
        for i, a in enumerate(alone):
            if a:
                out[i] = torch.mm(h[i : i + 1], self.lm_head_t)[0]
        return out

    def _shared_logits(self, rows: torch.Tensor) -> torch.Tensor:
        packed = self.lm_head_packed
        return packed.linear(rows) if packed is not None else torch.mm(rows, self.lm_head_t)
