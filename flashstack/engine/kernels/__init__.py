"""Engine kernels: a plain-torch reference per kernel (oracle, CPU path) and a dispatch point."""

from flashstack.engine.kernels.attention import (
    AttentionBackend,
    AttentionMetadata,
    get_attention_backend,
    paged_attention_reference,
    register_attention_backend,
    store_kvcache_reference,
)

__all__ = [
    "AttentionBackend",
    "AttentionMetadata",
    "get_attention_backend",
    "paged_attention_reference",
    "register_attention_backend",
    "store_kvcache_reference",
]
