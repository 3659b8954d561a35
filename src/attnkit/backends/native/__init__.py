"""The native CPU kernels, compiled on first use for the machine it runs on: ``splitk.cpp`` (the
split-K attention engine), ``rope.cpp`` (the one-pass rotary embedding of inference calls) and
``norm.cpp`` (the one-pass RMSNorm of inference calls).

``load()`` compiles them into one library against the installed torch with the system C++ compiler
(``$CXX``, else ``c++`` / ``g++`` / ``clang++``) and ``-march=native`` (the kernel is built for
the instruction set of the CPU that runs it: AVX2, AVX-512, ... decided by the compiler, not by
us), caches the shared library under ``$ATTNKIT_CACHE_DIR`` (default ``~/.cache/attnkit``) keyed
by the sources, the torch version, the compiler and the CPU, and loads it as the torch ops
``torch.ops.attnkit_cpu.splitk_attention``, ``.rope_rotate`` and ``.rms_norm``. A second process
finds the cached library; two processes compiling at once each write a private file and rename it
into place.

``ATTNKIT_NATIVE_MARCH`` names another target for ``-march=`` (``haswell``: the AVX2 build on an
AVX-512 machine, to compare the two code paths on one CPU); it is part of the cache key.

When no compiler is found, the build fails, or ``ATTNKIT_NATIVE=0`` is set, ``load()`` returns
None and :func:`status` says why; the split-K engine then runs its pure-torch path
(:mod:`attnkit.backends.splitk`), with the same results.
"""

from __future__ import annotations

import hashlib
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import threading
import warnings
from pathlib import Path

import torch

from ..._sysinfo import cpu_flags, cpu_isa, cpu_name

__all__ = ["load", "status", "cpu_description"]

_SOURCES = tuple(Path(__file__).with_name(f) for f in ("splitk.cpp", "rope.cpp", "norm.cpp"))
_lock = threading.Lock()
_state: dict[str, object] = {}


def cpu_description() -> str:
    """The CPU's model name and ISA (e.g. ``"AMD EPYC (AVX2)"``)."""
    return f"{cpu_name()} ({cpu_isa()})"


def _cpu_key() -> str:
    """What the compiled code depends on: the CPU's model and flags (``-march=native``)."""
    return f"{cpu_description()}|{' '.join(sorted(cpu_flags()))}|{platform.machine()}"


def _compiler() -> str | None:
    cxx = os.environ.get("CXX")
    if cxx:
        return shutil.which(cxx) or (cxx if os.path.exists(cxx) else None)
    for name in ("c++", "g++", "clang++"):
        path = shutil.which(name)
        if path:
            return path
    return None


def _cache_dir() -> Path:
    root = os.environ.get("ATTNKIT_CACHE_DIR")
    if root:
        return Path(root)
    xdg = os.environ.get("XDG_CACHE_HOME")
    return Path(xdg) / "attnkit" if xdg else Path.home() / ".cache" / "attnkit"


def _march() -> str:
    """The ``-march=`` target: the CPU that runs the build, unless ``ATTNKIT_NATIVE_MARCH`` says."""
    return os.environ.get("ATTNKIT_NATIVE_MARCH", "").strip() or "native"


def _command(cxx: str, srcs, out: Path, native_arch: bool) -> list[str]:
    from torch.utils import cpp_extension

    lib = Path(torch.__file__).parent / "lib"
    cmd = [cxx, "-O3", "-std=c++17", "-shared", "-fPIC", "-w", *map(str, srcs), "-o", str(out),
           f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}"]
    # at::parallel_for is inlined into this library: it must be built with the OpenMP torch uses
    # (and link torch's own libgomp when it ships one, so both share one thread pool and settings).
    if torch._C.has_openmp:
        cmd.append("-fopenmp")
        bundled = sorted(lib.glob("libgomp*.so*"))
        if bundled:
            cmd.append(str(bundled[0]))
    else:
        cmd.append("-fopenmp-simd")
    if native_arch:
        cmd.append(f"-march={_march()}")
    cmd += [f"-I{p}" for p in cpp_extension.include_paths()]
    cmd += [f"-L{lib}", "-lc10", "-ltorch_cpu"]
    if sys.platform == "darwin":
        cmd += ["-undefined", "dynamic_lookup"]
    else:
        cmd.append(f"-Wl,-rpath,{lib}")
    return cmd


def _build(cxx: str) -> Path:
    source = b"|".join(p.read_bytes() for p in _SOURCES)
    flags = " ".join(_command(cxx, [Path("src")], Path("out"), True))
    key = hashlib.sha256(b"|".join([source, torch.__version__.encode(), flags.encode(), _cpu_key().encode(),
                                    sys.version.encode()])).hexdigest()[:20]
    root = _cache_dir()
    target = root / f"attnkit_splitk_{key}.so"
    if target.exists():
        return target
    root.mkdir(parents=True, exist_ok=True)
    errors = []
    for native_arch in (True, False):  # a compiler that does not know -march=native still builds
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=root)
        os.close(fd)
        try:
            res = subprocess.run(_command(cxx, _SOURCES, Path(tmp), native_arch), capture_output=True, text=True,
                                 timeout=600)
            if res.returncode == 0:
                os.replace(tmp, target)
                return target
            errors.append(res.stderr.strip()[-2000:])
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    raise RuntimeError("compiling the native kernel failed:\n" + "\n---\n".join(errors))


def load():
    """``torch.ops.attnkit_cpu`` with the compiled kernel, or None (then :func:`status` says why)."""
    if "ops" in _state:
        return _state["ops"]
    with _lock:
        if "ops" in _state:
            return _state["ops"]
        ops, why = None, None
        if os.environ.get("ATTNKIT_NATIVE", "1").strip().lower() in ("0", "false", "no", "off"):
            why = "disabled by ATTNKIT_NATIVE=0"
        elif (cxx := _compiler()) is None:
            why = "no C++ compiler found ($CXX, c++, g++ or clang++)"
        else:
            try:
                path = _build(cxx)
                torch.ops.load_library(str(path))
                ops = torch.ops.attnkit_cpu
            except Exception as e:  # noqa: BLE001 - any build/load failure means: use the torch path
                why = f"{type(e).__name__}: {e}"
                warnings.warn(f"attnkit: the native CPU kernel is unavailable ({why.splitlines()[0]}); using the "
                              f"pure-torch split-K path (same results, slower)", RuntimeWarning, stacklevel=3)
        _state["ops"], _state["why"] = ops, why
        return ops


def status() -> str:
    """"native" when the compiled kernel is loaded, else "torch (<why>)"."""
    return "native" if load() is not None else f"torch ({_state['why']})"
