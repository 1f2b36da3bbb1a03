"""Chained block hashes over token ids.

Block i's key covers block i-1's key and block i's own token ids, so equal keys mean equal
prefixes (the same idea as vLLM's automatic prefix caching). A salt (per-user isolation) is
mixed in once, at the first salted block; every later key inherits it through the chain.
Blocks that lie entirely inside the first `shared_prefix_tokens` tokens (the system prompt and
tool definitions every session shares) stay in the unsalted namespace when asked to.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from hashlib import blake2b

BlockHash = bytes

_DIGEST_SIZE = 16  # 128 bits: collisions are not a practical concern at any cache size
_ROOT = b"ikcode-prefix-v1"


def hash_blocks(
    token_ids: Sequence[int],
    block_size: int,
    salt: str = "",
    shared_prefix_tokens: int = 0,
    parent: BlockHash | None = None,
) -> list[BlockHash]:
    """Chained keys of the FULL blocks of token_ids; a partial last block gets no key.

    `parent` continues an existing chain (incremental hashing of a growing conversation): pass
    the key of the block just before token_ids[0]. The salt is mixed into one block only, so
    pass it (with shared_prefix_tokens counted from the start of token_ids) only while that
    block is still ahead; once the chain holds it, continue with salt="" (the keys inherit it).
    """
    if block_size <= 0:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    salted_from = max(0, shared_prefix_tokens) // block_size if salt else -1
    salt_bytes = salt.encode()
    keys: list[BlockHash] = []
    prev = _ROOT if parent is None else parent
    for i in range(len(token_ids) // block_size):
        h = blake2b(prev, digest_size=_DIGEST_SIZE)
        if i == salted_from:
            h.update(b"\x00salt\x00" + salt_bytes + b"\x00")
        h.update(array("q", token_ids[i * block_size : (i + 1) * block_size]).tobytes())
        prev = h.digest()
        keys.append(prev)
    return keys
