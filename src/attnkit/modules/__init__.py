"""Attention modules: parameters and wiring around :func:`attnkit.attention`."""

from ._fused import FusedLoadHook
from .attention import GroupedQueryAttention, MultiHeadAttention, MultiQueryAttention
from .linear import Linear
from .mla import MLAConfig, MultiHeadLatentAttention
from .norm import RMSNorm

__all__ = ["MultiHeadAttention", "GroupedQueryAttention", "MultiQueryAttention", "MLAConfig", "MultiHeadLatentAttention",
           "RMSNorm", "FusedLoadHook", "Linear"]
