"""Where KV lives: the GPU page pool, the host chunk tier, per-user records and eviction policies."""

from .config import CacheConfig, CacheMode
from .host_store import HostChunkStore
from .host_tier import HostTier
from .jobs import OffloadJob, OnloadJob
from .kv_cache_manager import KVCacheManager
from .page_pool import PagePool
from .prefix_hash import IncrementalHasher, page_prefix_hashes
from .records import CacheHit, CacheStats, HostStats, LRUIndex, PoolStats, UserRecord
from .transfer import TransferEngine

__all__ = [
    "CacheConfig",
    "CacheHit",
    "CacheMode",
    "CacheStats",
    "HostChunkStore",
    "HostStats",
    "HostTier",
    "IncrementalHasher",
    "KVCacheManager",
    "LRUIndex",
    "OffloadJob",
    "OnloadJob",
    "PagePool",
    "PoolStats",
    "TransferEngine",
    "UserRecord",
    "page_prefix_hashes",
]
