"""The prefix cache: chained block keys, a device tier and a host tier, a swappable policy.

The cache imports nothing above it and never touches KV bytes (the engine does, via KVStore).
"""

from .budget import blocks_for_budget, kv_bytes_per_block
from .hashing import BlockHash, hash_blocks
from .ikcode_policy import IkcodePolicy
from .policy import EvictionPolicy, LRUPolicy, make_policy
from .prefix_cache import PrefixCache
from .stats import CacheStats
from .types import Allocation, KVStore, Match, OutOfBlocks

__all__ = [
    "Allocation",
    "BlockHash",
    "CacheStats",
    "EvictionPolicy",
    "IkcodePolicy",
    "KVStore",
    "LRUPolicy",
    "Match",
    "OutOfBlocks",
    "PrefixCache",
    "blocks_for_budget",
    "hash_blocks",
    "kv_bytes_per_block",
    "make_policy",
]
