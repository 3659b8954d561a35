"""Backend registry: what each backend supports, why it refuses, and which one ``auto`` picks.

A backend is an object with ``name``, ``available() -> str | None`` (None when usable on this
machine, else why not), ``not_supported_reasons(call) -> list[str]``,
``auto_skip_reason(call) -> str | None`` (a call it runs correctly but another backend runs
faster, so ``auto`` passes it over; forcing it still works), ``layouts`` (the K/V layouts it reads
in place: "dense" tensors, "paged" :class:`attnkit.PagedKV`, "quantized" / "quantized_paged"
:class:`attnkit.QuantizedKV`) and
``run(q, k, v, call) -> (out, weights | None)`` (for a paged call ``k`` is the ``PagedKV`` and ``v``
None), and optionally ``auto_devices`` (the device types ``auto`` considers it for; None: any).
``auto`` walks the registry in priority order and takes the first backend with no reasons; a
forced backend that refuses raises :class:`BackendNotSupported` listing every backend's reasons.

Paged and quantized calls: backends that read the layout in place are tried first; any other
backend can still run the call on the gathered (dequantized) dense K/V (:meth:`attnkit.PagedKV.gather`,
:meth:`attnkit.QuantizedKV.gather`, done by ``attention()``), and is judged on that dense call.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Protocol

import torch
from torch import Tensor

from ..masks import Mask, ReducedMask
from .._deprecation import renamed_kwargs, renamed_property


@dataclass(frozen=True)
class AttentionCall:
    """Everything a backend needs to decide and run, validated by :func:`attnkit.attention`."""

    batch: int
    num_heads: int  # Hq
    num_kv_heads: int  # Hkv
    q_len: int
    kv_len: int
    head_dim: int
    v_head_dim: int
    dtype: torch.dtype
    device: torch.device
    mask: Mask | None  # causal already folded in
    scale: float
    dropout_p: float
    return_weights: bool
    needs_grad: bool
    kv_layout: str = "dense"  # "dense", "paged" (PagedKV), "quantized" / "quantized_paged" (QuantizedKV)
    softcap: float | None = None  # scores -> c * tanh(scores / c) after scaling
    sinks: Tensor | None = None  # (Hq,) logits joining each row's denominator
    #: ``device.type``, read once: ``torch.device.type`` builds a new string on every read, and
    #: the refusals ask for it on every call.
    device_type: str = field(init=False, repr=False, compare=False)
    #: The mask reduced once into what backends read (:class:`attnkit.masks.ReducedMask`):
    #: backends read this, never the mask tree.
    reduced: ReducedMask = field(init=False, repr=False, compare=False)

    def __post_init__(self):
        object.__setattr__(self, "device_type", self.device.type)
        object.__setattr__(self, "reduced", ReducedMask(self.mask, self.batch, self.q_len, self.kv_len))

    @property
    def modifiers(self) -> list[str]:
        """The score modifiers this call uses ("softcap", "sinks", "ALiBi"), for refusals."""
        out = [name for name, on in (("softcap", self.softcap is not None), ("sinks", self.sinks is not None)) if on]
        return out + (["ALiBi"] if self.reduced.has_alibi else [])

    @property
    def groups(self) -> int:
        return self.num_heads // self.num_kv_heads

    @property
    def is_empty(self) -> bool:
        return self.batch == 0 or self.q_len == 0 or self.kv_len == 0 or self.num_heads == 0

    q_heads = renamed_property("num_heads")

    kv_heads = renamed_property("num_kv_heads")


AttentionCall.__init__ = renamed_kwargs(q_heads="num_heads", kv_heads="num_kv_heads")(AttentionCall.__init__)


class Backend(Protocol):
    name: str
    layouts: tuple[str, ...]

    def available(self) -> str | None: ...

    def not_supported_reasons(self, call: AttentionCall) -> list[str]: ...

    def auto_skip_reason(self, call: AttentionCall) -> str | None: ...

    def run(self, q: Tensor, k: Tensor, v: Tensor, call: AttentionCall) -> tuple[Tensor, Tensor | None]: ...


class BackendBase:
    """Defaults for the protocol: available everywhere, supports everything, never skipped."""

    name = ""
    layouts: tuple[str, ...] = ("dense",)
    #: Device types ``auto`` considers this backend for (None: every type). A pure shortcut: the
    #: backend's own refusals or skip reasons must already turn other devices away, since
    #: ``explain`` and forced calls ignore it. ``auto`` runs on every attention call, so what it
    #: need not ask costs nothing.
    auto_devices: tuple[str, ...] | None = None

    def available(self) -> str | None:
        return None

    def not_supported_reasons(self, call: AttentionCall) -> list[str]:
        return []

    def auto_skip_reason(self, call: AttentionCall) -> str | None:
        return None


class BackendNotSupported(ValueError):
    """Raised when a forced backend cannot run a call; the message lists every backend's reasons."""


class BackendCompileFailed(RuntimeError):
    """Raised by a backend whose kernel for a call failed to compile (FlexAttention's inductor
    finding no kernel, say). Under ``backend="auto"`` the call runs on the next backend in auto
    order, with a warning; a forced backend raises it."""


_REGISTRY: dict[str, Backend] = {}
_AUTO_ORDER: list[str] = []


def register_backend(backend: Backend, *, auto: bool = True, before: str | None = None) -> None:
    """Add ``backend``; with ``auto=True`` it takes part in ``backend="auto"``, before ``before``."""
    _REGISTRY[backend.name] = backend
    _AVAILABLE.pop(backend.name, None)
    if backend.name in _AUTO_ORDER:
        _AUTO_ORDER.remove(backend.name)
    if auto:
        idx = _AUTO_ORDER.index(before) if before in _AUTO_ORDER else len(_AUTO_ORDER)
        _AUTO_ORDER.insert(idx, backend.name)


def get_backend(name: str) -> Backend:
    if not isinstance(name, str):
        raise TypeError(f"backend must be a string ('auto' or one of {sorted(_REGISTRY)}), got {type(name).__name__} {name!r}")
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ValueError(f"backend must be 'auto' or one of {sorted(_REGISTRY)}, got {name!r}") from None


def backend_names() -> list[str]:
    return list(_REGISTRY)


def auto_order() -> list[str]:
    return list(_AUTO_ORDER)


def reads_in_place(backend: Backend, call: AttentionCall) -> bool:
    """True when ``backend`` takes ``call``'s K/V layout as is (else paged K/V is gathered)."""
    return call.kv_layout in getattr(backend, "layouts", ("dense",))


def as_read_by(backend: Backend, call: AttentionCall) -> AttentionCall:
    """``call`` as ``backend`` runs it: the same call, or, for K/V in a layout the backend cannot
    read in place, the dense call over the gathered K/V (which ``attention()`` gathers). The one
    place a paged layout is demoted."""
    return call if reads_in_place(backend, call) else replace(call, kv_layout="dense")


#: Each backend's ``available()`` answer, asked once per process outside traced code: a package
#: or device probe (``find_spec``, a CUDA query) must never run inside torch.compile's tracing,
#: where it fails or answers differently.
_AVAILABLE: dict[str, str | None] = {}


def availability(backend: Backend) -> str | None:
    """``backend.available()``, cached per backend name once asked outside ``torch.compile``."""
    try:
        return _AVAILABLE[backend.name]
    except KeyError:
        pass
    why = backend.available()
    if not torch.compiler.is_compiling():
        _AVAILABLE[backend.name] = why
    return why


def resolve_availability() -> None:
    """Ask every registered backend whether it is usable here, now (eagerly), so that calls
    traced by torch.compile only read the answers."""
    if torch.compiler.is_compiling():
        return
    for b in list(_REGISTRY.values()):
        availability(b)


def reasons(backend: Backend, call: AttentionCall) -> list[str]:
    why = availability(backend)
    if why:
        return [why]
    return backend.not_supported_reasons(as_read_by(backend, call))  # judged on the call it would run


def explain(call: AttentionCall) -> dict[str, list[str]]:
    """Every registered backend's reasons for refusing ``call`` (empty list = would run it)."""
    return {name: reasons(b, call) for name, b in _REGISTRY.items()}


def _refusal(header: str, call: AttentionCall) -> str:
    lines = [header]
    for name, why in explain(call).items():
        lines.append(f"  {name}: " + ("supported" if not why else "; ".join(why)))
    return "\n".join(lines)


def select(call: AttentionCall, backend: str = "auto", exclude: frozenset[str] = frozenset()) -> Backend:
    """The backend that will run ``call``: the forced one, or the first in auto order that accepts
    (leaving out the names in ``exclude``)."""
    if len(_AVAILABLE) < len(_REGISTRY):
        resolve_availability()
    if backend != "auto":
        b = get_backend(backend)
        if reasons(b, call):
            raise BackendNotSupported(_refusal(f"backend {backend!r} cannot run this call "
                                               f"(q {call.batch, call.num_heads, call.q_len, call.head_dim}, "
                                               f"Sk={call.kv_len}, {call.dtype}, {call.device}):", call))
        return b
    # Paged K/V: first the backends that read it in place, then any other (gathering first).
    for in_place_only in ((True, False) if call.kv_layout != "dense" else (False,)):
        for name in _AUTO_ORDER:
            b = _REGISTRY[name]
            if name in exclude or (in_place_only and not reads_in_place(b, call)):
                continue
            devices = getattr(b, "auto_devices", None)
            if devices is not None and call.device_type not in devices:
                continue
            if call.kv_layout == "dense" and not reads_in_place(b, call):  # dense K/V cannot be paged
                continue
            c = as_read_by(b, call)
            if not reasons(b, c) and b.auto_skip_reason(c) is None:
                return b
    raise BackendNotSupported(_refusal("no backend can run this call:", call))
