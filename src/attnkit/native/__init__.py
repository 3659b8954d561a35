"""The native CPU kernels, compiled on first use for the machine it runs on: ``splitk.cpp`` (the
split-K attention engine), ``rope.cpp`` (the one-pass rotary embedding of inference calls),
``norm.cpp`` (the one-pass RMSNorm of inference calls), ``linear.cpp`` (the weight-streaming
linear layer of decode steps: a few rows of x against a weight matrix) and ``kvquant.cpp`` (a
quantized KV cache's one-pass quantize-on-write), with the vector helpers they share in
``simd.h``.

:func:`load` returns them as ``torch.ops.attnkit_cpu``, building them once per machine and
torch build (:mod:`attnkit.native.build`: the compiler, the cache, its checks and its lock).

When no compiler is found, the build fails, or ``ATTNKIT_NATIVE=0`` is set, :func:`load` returns
None, :func:`status` says why and :func:`report` adds the compiler's last lines; the split-K engine
then runs its torch implementation (:mod:`attnkit.backends.decode`), with the same results, and
``auto`` leaves the calls SDPA runs to SDPA. :func:`implementation` with ``build=False`` says
which implementation a call would get without compiling anything (what ``describe_call``
reports).
"""

from __future__ import annotations

import os
import sys
import threading
import warnings
from pathlib import Path

import torch

from . import build as _build  # the module; ``build`` is the functions' argument
from .build import cache_dir, cpu_description

__all__ = ["load", "status", "implementation", "report", "library_path", "cache_dir", "cpu_description"]

_lock = threading.Lock()
_state: dict[str, object] = {}

#: The build's private names stay readable here (``native._paths``, ``native._command``): these
#: are spelled otherwise in :mod:`attnkit.native.build`, any other is looked up there as it is.
_MOVED = {"_compiler": "compiler", "_disabled": "disabled", "_tail": "tail", "_cache_dir": "cache_dir"}


def __getattr__(name: str):
    if name.startswith("_") and not name.startswith("__"):
        try:
            return getattr(_build, _MOVED.get(name, name))
        except AttributeError:
            pass
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def load():
    """``torch.ops.attnkit_cpu`` with the compiled kernel, or None (then :func:`status` says why).
    Compiles on the first call in a machine's life (announced on the ``attnkit.native`` logger)."""
    if "ops" in _state:
        return _state["ops"]
    with _lock:
        if "ops" in _state:
            return _state["ops"]
        ops, why, output = None, None, ""
        if _build.disabled():
            why = "disabled by ATTNKIT_NATIVE=0"
        elif (cxx := _build.compiler()) is None:
            why = "no C++ compiler found ($CXX, c++, g++ or clang++)"
        else:
            try:
                ops, path = _build.load_or_build(cxx)
                if path is not None:
                    _state["path"] = path
            except Exception as e:  # noqa: BLE001 - any build/load failure means: use the torch path
                why = str(e) or type(e).__name__
                output = getattr(e, "output", "")
        _state["why"], _state["output"] = why, output
        if ops is None and not _build.disabled():
            detail = f"\n{_build.tail(output, 5)}" if output else ""
            warnings.warn(f"attnkit: the native CPU kernel is unavailable ({why}); the split-K engine runs on torch "
                          f"ops (same results, slower) and `auto` leaves plain decode calls to SDPA. "
                          f"`attnkit info` shows why; ATTNKIT_NATIVE=0 turns it off quietly.{detail}",
                          RuntimeWarning, stacklevel=_caller_stacklevel())
        _state["ops"] = ops  # last: another thread reads "ops" without the lock
        return ops


def _caller_stacklevel() -> int:
    """The ``stacklevel`` that makes a warning point at the first frame outside attnkit and torch
    (the user's call), however deep the library's path to :func:`load` is."""
    skip = (str(Path(__file__).parents[2]) + os.sep, str(Path(torch.__file__).parent) + os.sep)
    frame, level = sys._getframe(1), 1
    while frame is not None and frame.f_code.co_filename.startswith(skip):
        frame, level = frame.f_back, level + 1
    return level


def _prediction() -> str | None:
    """Why the native kernel will not run here, known without building (None: it is expected to)."""
    if _build.disabled():
        return "disabled by ATTNKIT_NATIVE=0"
    if _build.compiler() is None:
        return "no C++ compiler found ($CXX, c++, g++ or clang++)"
    return None


def implementation(build: bool = True) -> str:
    """``"native"`` or ``"torch"``: the implementation the split-K engine runs here. With
    ``build=False`` nothing is compiled or loaded: before the first :func:`load` the answer is what
    it is expected to be (``"native"`` when a compiler is found and nothing disables it)."""
    if build or "ops" in _state:
        return "native" if load() is not None else "torch"
    return "native" if _prediction() is None else "torch"


def engine(build: bool = True) -> str:
    """Deprecated spelling of :func:`implementation` ("engine" names the split-K engine itself)."""
    warnings.warn("attnkit.native.engine() is deprecated; use attnkit.native.implementation()", DeprecationWarning,
                  stacklevel=2)
    return implementation(build)


def status(build: bool = True) -> str:
    """One line: ``"native"`` when the compiled kernel is loaded, else ``"torch (<why>)"``. With
    ``build=False`` nothing is compiled: before the first :func:`load` it is ``"native (not built
    yet)"`` or ``"torch (<why>)"``."""
    if build or "ops" in _state:
        return "native" if load() is not None else f"torch ({_state['why']})"
    why = _prediction()
    return "native (not built yet)" if why is None else f"torch ({why})"


def library_path() -> Path | None:
    """The loaded library's cached file, or None when none is loaded."""
    return _state.get("path") if "ops" in _state and _state["ops"] is not None else None


def report(build: bool = True) -> list[str]:
    """What ``attnkit info`` prints about the native kernel: which implementation runs and why,
    where the library is cached, and after a failed build the compiler's last lines.
    ``build=False`` compiles nothing (a kernel not built yet is reported as such)."""
    if build or "ops" in _state:
        loaded = load() is not None
        why = None if loaded else _state.get("why")
    else:
        loaded, why = False, _prediction()
    if loaded:
        lines = ["implementation: native (the compiled kernel)", f"  library: {library_path() or 'loaded earlier'}"]
    elif why is None:
        lines = ["implementation: native (not built yet: compiles once, on the first call that needs it; "
                 "`attnkit info` without --no-build compiles it now)"]
    else:
        lines = ["implementation: torch (the native kernel is unavailable)", f"  why: {why}",
                 "  effect: `auto` gives plain decode calls to SDPA; forced decode/paged calls, soft-capped or "
                 "ALiBi ones, RoPE and RMSNorm run on torch ops (same results, slower)"]
    lines.append(f"  cache: {cache_dir()} (ATTNKIT_CACHE_DIR, else XDG_CACHE_HOME/attnkit, else ~/.cache/attnkit)")
    cxx = _build.compiler()
    lines.append(f"  compiler: {cxx or 'none found'}" + (" (from $CXX)" if os.environ.get("CXX") else ""))
    output = _state.get("output") or ""
    if output:
        lines.append("  compiler output (last lines):")
        lines += [f"    | {line}" for line in _build.tail(output).splitlines()]
    return lines
