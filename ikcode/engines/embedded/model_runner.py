"""Owns the model and the KV pool; turns a scheduled step into one forward and its logits.

The pool is one preallocated tensor per K and V: [layers, num_blocks, block_size, kv_heads,
head_dim]. It is also the cache's KVStore when a host tier is configured (block copies to and
from a host tensor of the same layout).
"""

from __future__ import annotations

import torch

from ikcode.engines.embedded.scheduler import ScheduledSeq
from ikcode.model.config import ModelConfig
from ikcode.model.llama import (
    ForwardBatch,
    LlamaModel,
    QueryGroup,
    SeqAttention,
    padded_query_rows,
    visible_keys,
)


class ModelRunner:
    def __init__(
        self,
        cfg: ModelConfig,
        state_dict: dict[str, torch.Tensor],
        num_blocks: int,
        num_host_blocks: int,
        block_size: int,
        device: torch.device,
        batch_invariant: bool,
    ):
        self.cfg = cfg
        self.device = device
        self.block_size = block_size
        self.batch_invariant = batch_invariant
        model = LlamaModel(cfg)
        model.load_hf_state_dict(state_dict)
        self.model = model.to(device).eval().requires_grad_(False)
        shape = (cfg.num_layers, num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim)
        self.k_pool = torch.zeros(shape, dtype=torch.float32, device=device)
        self.v_pool = torch.zeros(shape, dtype=torch.float32, device=device)
        host_shape = (cfg.num_layers, num_host_blocks, block_size, cfg.num_kv_heads, cfg.head_dim)
        # Page-locked host memory makes host<->GPU copies DMA transfers; without CUDA it is
        # unavailable (and pointless), so plain RAM then.
        pin = device.type == "cuda" and torch.cuda.is_available()
        self.k_host = (
            torch.zeros(host_shape, dtype=torch.float32, pin_memory=pin) if num_host_blocks else None
        )
        self.v_host = (
            torch.zeros(host_shape, dtype=torch.float32, pin_memory=pin) if num_host_blocks else None
        )

    # ---- what the tiers really occupy (measured from the tensors, not derived from settings) ---
    @property
    def device_kv_bytes(self) -> int:
        return self.k_pool.nbytes + self.v_pool.nbytes

    @property
    def host_kv_bytes(self) -> int:
        return sum(t.nbytes for t in (self.k_host, self.v_host) if t is not None)

    @property
    def host_pinned(self) -> bool:
        return self.k_host is not None and self.k_host.is_pinned()

    def block_bytes(self, block: int) -> bytes:
        """Raw K and V bytes of one device block, all layers (tests compare them bit for bit)."""
        k = self.k_pool[:, block].contiguous().cpu()
        v = self.v_pool[:, block].contiguous().cpu()
        return k.numpy().tobytes() + v.numpy().tobytes()

    # ---- KVStore ---------------------------------------------------------------------------
    def copy_device_to_host(self, pairs: list[tuple[int, int]]) -> None:
        assert self.k_host is not None and self.v_host is not None
        dev = torch.tensor([d for d, _ in pairs], device=self.device)
        host = torch.tensor([h for _, h in pairs])
        self.k_host[:, host] = self.k_pool[:, dev].cpu()
        self.v_host[:, host] = self.v_pool[:, dev].cpu()

    def copy_host_to_device(self, pairs: list[tuple[int, int]]) -> None:
        assert self.k_host is not None and self.v_host is not None
        host = torch.tensor([h for h, _ in pairs])
        dev = torch.tensor([d for _, d in pairs], device=self.device)
        self.k_pool[:, dev] = self.k_host[:, host].to(self.device)
        self.v_pool[:, dev] = self.v_host[:, host].to(self.device)

    # ---- one step --------------------------------------------------------------------------
    def build_batch(self, scheduled: list[ScheduledSeq]) -> tuple[ForwardBatch, list[int]]:
        """The flat batch and, per scheduled sequence, the row whose logits are sampled (-1: none)."""
        bs, cfg = self.block_size, self.cfg
        group = cfg.num_heads // cfg.num_kv_heads
        # Prompt (prefill) rows first, then decode rows, so prompt rows share one matmul.
        prefill = [s for s in scheduled if not (self.batch_invariant and s.seq.is_decoding)]
        decode = [s for s in scheduled if self.batch_invariant and s.seq.is_decoding]
        ids: list[int] = []
        pos: list[int] = []
        write_slots: list[int] = []
        seqs: list[SeqAttention] = []
        sample_row: dict[int, int] = {}
        groups: list[tuple[int, int]] = []

        def add(item: ScheduledSeq) -> None:
            seq, n = item.seq, item.num_tokens
            start = seq.num_computed_tokens
            row0, keys = len(ids), start + n
            ids.extend(seq.token_ids[start:keys])
            pos.extend(range(start, keys))
            table = seq.block_table
            write_slots.extend(table[p // bs] * bs + p % bs for p in range(start, keys))
            if seq.is_decoding:
                # One query over exactly its keys: no padding, no mask (see llama.py).
                blocks = table[: -(-keys // bs)]
                seqs.append(self._seq_attention(blocks, [QueryGroup(row0, 1, 1, keys, None)]))
            else:
                seqs.append(self._prompt_attention(table, row0, start, n, group))
            if keys == len(seq.token_ids):
                sample_row[id(seq)] = row0 + n - 1

        for item in prefill:
            add(item)
        num_real = len(ids)
        if prefill:
            if self.batch_invariant and len(ids) % 4:
                pad = 4 - len(ids) % 4
                ids.extend([0] * pad)
                pos.extend([0] * pad)
            groups.append((0, len(ids)))
        write_rows = list(range(num_real))
        for item in decode:
            write_rows.append(len(ids))
            add(item)
            groups.append((len(ids) - 1, len(ids)))
        batch = ForwardBatch(
            self._ids(ids), self._ids(pos), self._ids(write_rows), self._ids(write_slots), seqs, groups
        )
        return batch, [sample_row.get(id(s.seq), -1) for s in scheduled]

    def _prompt_attention(self, table: list[int], row0: int, start: int, n: int, group: int) -> SeqAttention:
        """Rows start..start+n of a prompt, grouped by the keys they are given (llama.visible_keys)."""
        groups: list[QueryGroup] = []
        p = start
        while p < start + n:
            num_keys = visible_keys(p)
            rows = min(start + n, num_keys) - p
            qrows = padded_query_rows(rows, group) if self.batch_invariant else rows
            mask = self._mask(p, rows, qrows, num_keys, group)
            groups.append(QueryGroup(row0 + p - start, rows, qrows, num_keys, mask))
            p += rows
        bs = self.block_size
        blocks = table[: -(-(start + n) // bs)]
        # Padding blocks only hold masked keys: any block will do (pool values are always finite:
        # zeros or K/V the model wrote); the next ones keep a run of consecutive blocks whole.
        num_padding = -(-num_keys // bs) - len(blocks)
        after = blocks[-1] + 1
        if after + num_padding <= self.k_pool.shape[1]:
            blocks = blocks + list(range(after, after + num_padding))
        else:
            blocks = blocks + [blocks[0]] * num_padding
        return self._seq_attention(blocks, groups)

    def _seq_attention(self, blocks: list[int], groups: list[QueryGroup]) -> SeqAttention:
        first = blocks[0]
        consecutive = blocks[-1] - first == len(blocks) - 1 and blocks == list(
            range(first, first + len(blocks))
        )
        return SeqAttention(self._ids(blocks), groups, first if consecutive else None)

    def _ids(self, xs: list[int]) -> torch.Tensor:
        return torch.tensor(xs, dtype=torch.long, device=self.device)

    def _mask(self, start: int, n: int, qrows: int, kpad: int, group: int) -> torch.Tensor:
        """Additive causal mask for queries start..start+n over kpad keys, repeated for the group's
        stacked query heads. Padding queries attend to key 0 only: no NaN rows."""
        visible = torch.arange(kpad).unsqueeze(0) <= torch.arange(start, start + qrows).unsqueeze(1)
        visible[n:] = False
        visible[n:, 0] = True
        mask = torch.zeros(qrows, kpad).masked_fill_(~visible, float("-inf"))
        return mask.repeat(group, 1).to(self.device)

    @torch.inference_mode()
    def run(self, scheduled: list[ScheduledSeq]) -> tuple[torch.Tensor, list[int]]:
        """Logits [n, vocab] (CPU) for the sequences that sample this step, and their indexes."""
        batch, rows = self.build_batch(scheduled)
        hidden = self.model(batch, self.k_pool, self.v_pool)
        which = [i for i, r in enumerate(rows) if r >= 0]
        if not which:
            return torch.empty(0, self.cfg.vocab_size), []
        picked = hidden[self._ids([rows[i] for i in which])]
        return self.model.logits(picked).float().cpu(), which
