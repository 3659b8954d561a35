"""``math``: the reference path in plain torch ops. Supports every call, including weights,
dropout and fp64; the fallback ``auto`` always reaches."""

from __future__ import annotations

from ..reference import attention_math
from .registry import AttentionCall


class MathBackend:
    name = "math"

    def available(self) -> str | None:
        return None

    def auto_skip_reason(self, call: AttentionCall) -> str | None:
        return None

    def not_supported_reasons(self, call: AttentionCall) -> list[str]:
        return []

    def run(self, q, k, v, call: AttentionCall):
        return attention_math(q, k, v, call.mask, scale=call.scale, dropout_p=call.dropout_p,
                              return_weights=call.return_weights)
