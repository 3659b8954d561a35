"""``math``: the reference path in plain torch ops. Supports every call, including weights,
dropout and fp64; the fallback ``auto`` always reaches."""

from __future__ import annotations

from ..reference import attention_math
from .registry import AttentionCall, BackendBase


class MathBackend(BackendBase):
    name = "math"

    def run(self, q, k, v, call: AttentionCall):
        return attention_math(q, k, v, call.mask, scale=call.scale, dropout_p=call.dropout_p,
                              return_weights=call.return_weights, softcap=call.softcap, sinks=call.sinks)
