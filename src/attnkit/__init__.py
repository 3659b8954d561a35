"""attnkit: every mainstream attention mechanism for PyTorch, behind one functional core."""

from . import caches, masks, models, nn, sizing
from .backends import BackendCompileFailed, BackendNotSupported, backend_names, explain, register_backend
from .caches import BlockAllocator, DynamicCache, OutOfBlocks, PagedKVCache, SlidingWindowCache, StaticCache
from .functional import attention, describe_call, set_debug
from .kvlayout import PagedKV, QuantizedKV
from .models import Decoder, DecoderConfig
from .models.text import TextGenerator
from .modules import GroupedQueryAttention, MLAConfig, MultiHeadAttention, MultiHeadLatentAttention, MultiQueryAttention
from .reference import attention_reference
from .sizing import kv_cache_bytes, kv_cache_table
from .rope import RopeConfig, RotaryEmbedding, apply_rotary

__version__ = "0.1.0"

__all__ = ["attention", "attention_reference", "describe_call", "set_debug", "PagedKV", "QuantizedKV", "masks", "caches",
           "BackendCompileFailed", "BackendNotSupported", "backend_names", "explain", "register_backend", "MultiHeadAttention",
           "GroupedQueryAttention", "MultiQueryAttention", "MLAConfig", "MultiHeadLatentAttention", "models", "Decoder",
           "DecoderConfig", "TextGenerator", "nn", "sizing", "kv_cache_bytes", "kv_cache_table", "DynamicCache",
           "StaticCache", "SlidingWindowCache", "PagedKVCache", "BlockAllocator", "OutOfBlocks", "RotaryEmbedding",
           "RopeConfig", "apply_rotary", "__version__"]
