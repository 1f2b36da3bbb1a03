"""Turn tier budgets (bytes or tokens, as profiles state them) into block counts."""

from __future__ import annotations


def kv_bytes_per_block(
    num_layers: int, num_kv_heads: int, head_dim: int, block_size: int, dtype_bytes: int = 2
) -> int:
    """Bytes of K and V for one block of block_size tokens across all layers."""
    return 2 * num_layers * num_kv_heads * head_dim * block_size * dtype_bytes


def blocks_for_budget(
    block_size: int,
    *,
    bytes_budget: int | None = None,
    tokens_budget: int | None = None,
    bytes_per_block: int | None = None,
) -> int:
    """Whole blocks that fit the budget (never more: a budget is a ceiling).

    Give tokens_budget, or bytes_budget together with bytes_per_block; both: the smaller wins.
    """
    if block_size <= 0:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    limits: list[int] = []
    if tokens_budget is not None:
        limits.append(max(0, tokens_budget) // block_size)
    if bytes_budget is not None:
        if not bytes_per_block or bytes_per_block <= 0:
            raise ValueError("bytes_budget needs bytes_per_block > 0")
        limits.append(max(0, bytes_budget) // bytes_per_block)
    if not limits:
        raise ValueError("give tokens_budget or bytes_budget")
    return min(limits)
