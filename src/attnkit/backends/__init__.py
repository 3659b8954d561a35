"""Built-in backends, registered in ``auto`` priority order: decode and paged (small Sq on CPU,
the split-K engine), triton (CUDA), sdpa, math.
``flex`` is registered but never picked by ``auto`` (its first call per shape compiles), nor is
``flash`` (the optional flash-attn package; why: :mod:`attnkit.backends.flash`)."""

from .decode import SplitKBackend
from .flash import FlashBackend
from .flex import FlexBackend
from .math import MathBackend
from .registry import (AttentionCall, BackendBase, BackendNotSupported, auto_order, backend_names, explain,
                       get_backend, register_backend, select)
from .sdpa import SdpaBackend
from .triton import TritonBackend

register_backend(SplitKBackend("decode", "dense"))
register_backend(SplitKBackend("paged", "paged"))
register_backend(TritonBackend())  # auto: CUDA calls with unequal K/V widths (MLA decode) only
register_backend(SdpaBackend())
register_backend(MathBackend())
register_backend(FlexBackend(), auto=False)
register_backend(FlashBackend(), auto=False)

__all__ = ["AttentionCall", "BackendBase", "BackendNotSupported", "auto_order", "backend_names", "explain",
           "get_backend", "register_backend", "select"]
