"""Built-in backends, registered in ``auto`` priority order: decode (small Sq), sdpa, math.
``flex`` is registered but never picked by ``auto`` (its first call per shape compiles)."""

from .decode import DecodeBackend
from .flex import FlexBackend
from .math import MathBackend
from .registry import (AttentionCall, BackendBase, BackendNotSupported, auto_order, backend_names, explain,
                       get_backend, register_backend, select)
from .sdpa import SdpaBackend

register_backend(DecodeBackend())
register_backend(SdpaBackend())
register_backend(MathBackend())
register_backend(FlexBackend(), auto=False)

__all__ = ["AttentionCall", "BackendBase", "BackendNotSupported", "auto_order", "backend_names", "explain",
           "get_backend", "register_backend", "select"]
