"""Owns the model and the KV pool; turns a scheduled step into one forward and its logits.

The pool is one preallocated tensor per K and V: [layers, num_blocks, block_size, kv_heads,
head_dim]. It is also the cache's KVStore when a host tier is configured (block copies to and
from host tensors of the same layout: host_kv.py).
"""

from __future__ import annotations

import dataclasses
import logging

import torch

from ikcode.engines.embedded.host_kv import HostKV
from ikcode.engines.embedded.scheduler import ScheduledSeq
from ikcode.engines.embedded.sequence import Sequence
from ikcode.model.config import ModelConfig
from ikcode.model.llama import ForwardBatch, LlamaModel, RowGroup
from ikcode.model.paged_attention import (
    QUERY_GROUP,
    DecodeBatch,
    QueryGroup,
    SeqAttention,
    padded_query_rows,
    visible_keys,
)

logger = logging.getLogger(__name__)


def fast_bf16_cpu() -> bool:
    """Whether this CPU multiplies bf16 matrices natively (AVX512-BF16 or AMX): elsewhere bf16
    matmuls are emulated and slower than fp32."""
    return torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()


class ModelRunner:
    def __init__(
        self,
        cfg: ModelConfig,
        state_dict: dict[str, torch.Tensor],
        num_blocks: int,
        num_host_blocks: int,
        block_size: int,
        device: torch.device,
        batch_invariance: str,
        weights: str = "fp32",
        float_weights: str = "fp32",
        staging_blocks: int = 0,
        fp32_gemm: str = "onednn",
    ):
        self.cfg = cfg
        self.device = device
        self.block_size = block_size
        self.batch_invariance = batch_invariance
        # Positions past what the pool holds are never computed: RoPE tables for those only (a
        # 1M-token context_length cost GBs of tables, a corrupt one failed the allocation).
        window = min(cfg.max_position_embeddings, num_blocks * block_size)
        model = LlamaModel(dataclasses.replace(cfg, max_position_embeddings=window))
        model.load_hf_state_dict(state_dict)
        self.model = model.to(device).eval().requires_grad_(False)
        self.quantized_weight_bytes = 0
        if weights != "fp32":
            if device.type != "cpu":  # fbgemm's and torch's int4 kernels here are CPU kernels
                logger.warning("%s weights are a CPU feature; %s keeps its float weights", weights, device)
            else:
                self.quantized_weight_bytes = self.model.quantize(weights)  # from the fp32 weights
        if float_weights == "auto":
            float_weights = "bf16" if device.type == "cpu" and fast_bf16_cpu() else "fp32"
        self.float_weights = float_weights  # prompts' and batch-invariant rows' weights
        if float_weights == "bf16":
            self.model.matmul_weights_to(torch.bfloat16)
        elif fp32_gemm == "onednn" and device.type == "cpu" and torch.backends.mkldnn.is_available():
            try:
                self.model.pack_for_onednn()  # fp32 through oneDNN's GEMM: faster than MKL's here
            except RuntimeError:
                logger.warning("oneDNN could not pack the fp32 weights; MKL multiplies them", exc_info=True)
        # What the decode rows that share a batch read.
        self.decode_weights = weights if self.quantized_weight_bytes else float_weights
        shape = (cfg.num_layers, num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim)
        self.k_pool = torch.zeros(shape, dtype=torch.float32, device=device)
        self.v_pool = torch.zeros(shape, dtype=torch.float32, device=device)
        layer_block = (cfg.num_layers, block_size, cfg.num_kv_heads, cfg.head_dim)
        self.host = HostKV(layer_block, num_host_blocks, device, staging_blocks) if num_host_blocks else None

    # ---- what the tiers really occupy (measured from the tensors, not derived from settings) ---
    @property
    def device_kv_bytes(self) -> int:
        return self.k_pool.nbytes + self.v_pool.nbytes

    @property
    def host_kv_bytes(self) -> int:
        return self.host.nbytes if self.host is not None else 0

    @property
    def host_pinned(self) -> bool:
        return self.host is not None and self.host.pinned

    # ---- KVStore ---------------------------------------------------------------------------
    def copy_device_to_host(self, pairs: list[tuple[int, int]]) -> None:
        assert self.host is not None
        self.host.copy_device_to_host(self.k_pool, self.v_pool, pairs)

    def copy_host_to_device(self, pairs: list[tuple[int, int]]) -> None:
        assert self.host is not None
        self.host.copy_host_to_device(self.k_pool, self.v_pool, pairs)

    # ---- one step --------------------------------------------------------------------------
    def is_invariant(self, seq: Sequence) -> bool:
        """Whether seq's numbers must not depend on the batch (see EmbeddedEngineConfig)."""
        mode = self.batch_invariance
        return mode == "all" or (mode == "greedy" and seq.request.sampling.temperature == 0)

    def build_batch(self, scheduled: list[ScheduledSeq]) -> tuple[ForwardBatch, list[int]]:
        """The flat batch and, per scheduled sequence, the row whose logits are sampled (-1: none).

        Rows, in order, each part one matmul per weight:
        1. prompt chunks, and batch-invariant decode rows as one-token prompt chunks (float
           weights, a multiple of 4 rows, the prompt's attention; llama.py), so a cached block
           holds the same K/V whichever request computed it, and whether its tokens were a
           prompt's or generated (an answer cached for the next turn is read as a prompt);
        2. decode rows that may vary with the batch: the weights (quantized when the model is) are read
           once for all of them, and they attend in one call over a padded block table."""
        rows = _Rows(self.block_size)
        prefills = [s for s in scheduled if not s.seq.is_decoding]
        decodes = [s for s in scheduled if s.seq.is_decoding]
        invariant = [s for s in decodes if self.is_invariant(s.seq)]  # one-token chunks (above)
        for item in prefills + invariant:
            seq, start = item.seq, item.seq.num_computed_tokens
            row0 = rows.add_tokens(seq, start, start + item.num_tokens)
            rows.seqs.append(self._prompt_attention(seq.block_table, row0, start, item.num_tokens))
        if rows.ids:
            rows.pad_to_multiple(4)
            rows.row_groups.append(RowGroup(0, len(rows.ids)))
        first_shared = len(rows.ids)
        decode = self._add_shared_decodes(rows, [s for s in decodes if not self.is_invariant(s.seq)])
        if decode is not None:
            rows.row_groups.append(RowGroup(first_shared, len(rows.ids), quantized=True))
        batch = ForwardBatch(
            self._ids(rows.ids),
            self._ids(rows.positions),
            None if len(rows.write_rows) == len(rows.ids) else self._ids(rows.write_rows),
            self._ids(rows.write_slots),
            rows.seqs,
            rows.row_groups,
            decode,
        )
        return batch, [rows.sample_rows.get(id(s.seq), -1) for s in scheduled]

    def _add_shared_decodes(self, rows: _Rows, items: list[ScheduledSeq]) -> DecodeBatch | None:
        """One new token per sequence, attended in one call over a padded block table."""
        if not items:
            return None
        first_row = len(rows.ids)
        num_keys = []
        for item in items:
            position = item.seq.num_computed_tokens
            rows.add_tokens(item.seq, position, position + 1)
            num_keys.append(position + 1)
        max_blocks = -(-max(num_keys) // self.block_size)
        table = []
        for item in items:
            own = item.seq.block_table[:max_blocks]
            table.append(own + [own[-1]] * (max_blocks - len(own)))  # padding: its own (masked) block
        max_keys = max_blocks * self.block_size
        past_end = torch.arange(max_keys).unsqueeze(0) >= torch.tensor(num_keys).unsqueeze(1)
        mask = torch.zeros(len(items), max_keys).masked_fill_(past_end, float("-inf"))
        return DecodeBatch(
            first_row,
            torch.tensor(table, dtype=torch.long, device=self.device),
            mask.view(len(items), 1, 1, max_keys).to(self.device),
        )

    def _prompt_attention(self, table: list[int], row0: int, start: int, n: int) -> SeqAttention:
        """Rows start..start+n of a prompt, grouped by the keys they are given (visible_keys)."""
        group = self.cfg.num_heads // self.cfg.num_kv_heads
        groups: list[QueryGroup] = []
        p = start
        while p < start + n:
            num_keys = visible_keys(p)
            num_rows = min(start + n, num_keys) - p
            query_rows = padded_query_rows(num_rows, group)
            # The keys before the group's own QUERY_GROUP positions are seen by all its rows:
            # attended unmasked (paged_attention.attend_group; the log-sum-exp merge needs the CPU kernel).
            masked_from = num_keys - QUERY_GROUP if self.device.type == "cpu" else 0
            mask = self._mask(p, num_rows, query_rows, masked_from, num_keys, group)
            groups.append(QueryGroup(row0 + p - start, num_rows, query_rows, num_keys, mask, masked_from))
            p += num_rows
        blocks = table[: -(-(start + n) // self.block_size)]
        return self._seq_attention(blocks, groups)

    def _seq_attention(self, blocks: list[int], groups: list[QueryGroup]) -> SeqAttention:
        first = blocks[0]
        consecutive = blocks == list(range(first, first + len(blocks)))
        return SeqAttention(self._ids(blocks), groups, first if consecutive else None)

    def _ids(self, xs: list[int]) -> torch.Tensor:
        return torch.tensor(xs, dtype=torch.long, device=self.device)

    def _mask(self, start: int, n: int, qrows: int, first_key: int, end_key: int, group: int) -> torch.Tensor:
        """Additive causal mask for queries start..start+n over keys first_key..end_key, repeated
        for the group's stacked query heads. Padding queries attend to first_key only: no NaN rows."""
        keys = torch.arange(first_key, end_key).unsqueeze(0)
        visible = keys <= torch.arange(start, start + qrows).unsqueeze(1)
        visible[n:] = False
        visible[n:, 0] = True
        mask = torch.zeros(qrows, end_key - first_key).masked_fill_(~visible, float("-inf"))
        return mask.repeat(group, 1).to(self.device)

    @torch.inference_mode()
    def run(self, scheduled: list[ScheduledSeq]) -> tuple[torch.Tensor, list[int]]:
        """Logits [n, vocab] (CPU) for the sequences that sample this step, and their indexes."""
        batch, rows = self.build_batch(scheduled)
        hidden = self.model(batch, self.k_pool, self.v_pool)
        which = [i for i, r in enumerate(rows) if r >= 0]
        if not which:
            return torch.empty(0, self.cfg.vocab_size), []
        picked = [rows[i] for i in which]
        alone = [self.is_invariant(scheduled[i].seq) for i in which]
        logits = self.model.logits(hidden[self._ids(picked)], alone)
        return logits.float().cpu(), which


class _Rows:
    """The flat batch while it is built: token rows, where their K/V go, what attends how."""

    def __init__(self, block_size: int):
        self.block_size = block_size
        self.ids: list[int] = []
        self.positions: list[int] = []
        self.write_rows: list[int] = []
        self.write_slots: list[int] = []
        self.seqs: list[SeqAttention] = []
        self.row_groups: list[RowGroup] = []
        self.sample_rows: dict[int, int] = {}  # id(sequence) -> the row its next token comes from

    def add_tokens(self, seq: Sequence, start: int, end: int) -> int:
        """Rows for seq's tokens start..end (K/V written to its blocks); returns the first row."""
        row0, bs, table = len(self.ids), self.block_size, seq.block_table
        self.ids.extend(seq.token_ids[start:end])
        self.positions.extend(range(start, end))
        self.write_rows.extend(range(row0, row0 + end - start))
        self.write_slots.extend(table[p // bs] * bs + p % bs for p in range(start, end))
        if end == len(seq.token_ids):
            self.sample_rows[id(seq)] = row0 + end - start - 1
        return row0

    def pad_to_multiple(self, multiple: int) -> None:
        """Padding rows: computed, never written to the pool, never sampled."""
        pad = -len(self.ids) % multiple
        self.ids.extend([0] * pad)
        self.positions.extend([0] * pad)
