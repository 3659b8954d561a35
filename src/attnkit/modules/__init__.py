"""Attention modules: parameters and wiring around :func:`attnkit.attention`."""

from .attention import GroupedQueryAttention, MultiHeadAttention, MultiQueryAttention

__all__ = ["MultiHeadAttention", "GroupedQueryAttention", "MultiQueryAttention"]
