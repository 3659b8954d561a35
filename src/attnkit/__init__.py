"""attnkit: every mainstream attention mechanism for PyTorch, behind one functional core."""

from . import masks
from .backends import BackendNotSupported, backend_names, explain, register_backend
from .functional import attention, describe_call
from .reference import attention_reference

__version__ = "0.1.0"

__all__ = ["attention", "attention_reference", "describe_call", "masks", "BackendNotSupported",
           "backend_names", "explain", "register_backend", "__version__"]
