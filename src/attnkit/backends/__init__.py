"""Built-in backends, registered in ``auto`` priority order: decode and paged (small Sq on CPU,
the split-K engine), triton (CUDA decode), flex (CUDA calls with modifiers or block-sparse masks
that SDPA cannot fuse), sdpa, math. ``flash`` (the optional flash-attn package) is registered but
never picked by ``auto`` (why: :mod:`attnkit.backends.flash`)."""

from .decode import DecodeBackend
from .flash import FlashBackend
from .flex import FlexBackend
from .math import MathBackend
from .registry import (AttentionCall, BackendBase, BackendCompileFailed, BackendNotSupported, auto_order,
                       backend_names, explain, get_backend, register_backend, select)
from .sdpa import SdpaBackend
from .triton import TritonBackend

register_backend(DecodeBackend("decode", ("dense", "quantized")))
register_backend(DecodeBackend("paged", ("paged", "quantized_paged")))
register_backend(TritonBackend())  # auto: CUDA decode SDPA cannot fuse (MLA's widths, modifiers)
register_backend(FlexBackend())  # auto: CUDA prefill SDPA cannot fuse
register_backend(SdpaBackend())
register_backend(MathBackend())
register_backend(FlashBackend(), auto=False)

__all__ = ["AttentionCall", "BackendBase", "BackendCompileFailed", "BackendNotSupported", "auto_order", "backend_names", "explain",
           "get_backend", "register_backend", "select"]
