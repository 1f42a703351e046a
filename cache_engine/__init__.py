"""Where KV lives: the GPU page pool, per-user block tables and the eviction policy."""

from .config import CacheConfig, CacheMode
from .kv_cache_manager import CacheStats, KVCacheManager, UserRecord
from .lru import LRUIndex
from .page_pool import PagePool
from .prefix_hash import page_prefix_hashes

__all__ = [
    "CacheConfig",
    "CacheMode",
    "CacheStats",
    "KVCacheManager",
    "LRUIndex",
    "PagePool",
    "UserRecord",
    "page_prefix_hashes",
]
