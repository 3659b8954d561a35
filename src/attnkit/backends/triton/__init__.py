"""The ``triton`` backend: ``backend`` (:class:`TritonBackend`), ``limits`` (its limits and
probes, read without importing Triton), ``plan`` (the split rule, a pure function), ``kernel``
(the Triton kernels and their custom op), ``latent`` (the lean kernel of plain absorbed-MLA
decode, which ``kernel`` dispatches to) and ``ops`` (the public entry points
:func:`~attnkit.backends.triton.ops.paged_decode_attention` and
:func:`~attnkit.backends.triton.ops.decode_attention`, which check their arguments). Importing
this package does not import Triton; ``kernel``, ``latent`` and ``ops`` do."""

from .backend import TritonBackend
from .limits import MAX_HEAD_DIM, MAX_Q_LEN, MAX_V_HEAD_DIM, NO_CAUSAL, interpreting

__all__ = ["MAX_HEAD_DIM", "MAX_Q_LEN", "MAX_V_HEAD_DIM", "NO_CAUSAL", "TritonBackend", "interpreting"]
