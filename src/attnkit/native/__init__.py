"""The native CPU kernels, compiled on first use for the machine it runs on: ``splitk.cpp`` (the
split-K attention engine), ``rope.cpp`` (the one-pass rotary embedding of inference calls),
``norm.cpp`` (the one-pass RMSNorm of inference calls), ``linear.cpp`` (the weight-streaming
linear layer of decode steps: a few rows of x against a weight matrix) and ``kvquant.cpp`` (a
quantized KV cache's one-pass quantize-on-write).

``load()`` compiles them into one library against the installed torch with the system C++ compiler
(``$CXX``, else ``c++`` / ``g++`` / ``clang++``) and ``-march=native`` (the kernel is built for
the instruction set of the CPU that runs it: AVX2, AVX-512, ... decided by the compiler, not by
us), caches the shared library under :func:`cache_dir` (``$ATTNKIT_CACHE_DIR``, else
``$XDG_CACHE_HOME/attnkit``, else ``~/.cache/attnkit``) keyed by the sources, the torch version,
the compiler and the CPU, and loads it as the torch ops ``torch.ops.attnkit_cpu.splitk_attention``,
``.rope_rotate``, ``.rms_norm``, ``.linear_rows`` and ``.quantize_kv_rows``. The sources are compiled as one translation
unit: the torch headers they share, not the kernels, are most of the compile time.

The build is announced: one line on the ``attnkit.native`` logger when it starts (what, where the
cache is, that it happens once) and one when it ends (how long it took). They are WARNING records,
so they show on stderr when logging is not configured;
``logging.getLogger("attnkit.native").setLevel(logging.ERROR)`` silences them.

What is loaded is checked first: a build records the library's size and sha256 beside it
(``<name>.sha256``), and a cached library that does not match its record (cut short, overwritten,
another file under its name) is rebuilt, never loaded; a loaded library must provide all its
ops. A build runs under a lock file in the cache folder (``fcntl.flock``; Linux and macOS), so a
second process waits for the first one's build and loads it; a build's temporary files are removed
when it fails or is interrupted, and by the next build when its process was killed, and the
compiler dies with the build (it runs in its own process group, killed on an interrupt or a
timeout).

``ATTNKIT_NATIVE_MARCH`` names another target for ``-march=`` (``haswell``: the AVX2 build on an
AVX-512 machine, to compare the two code paths on one CPU); it is part of the cache key.

When no compiler is found, the build fails, or ``ATTNKIT_NATIVE=0`` is set, ``load()`` returns
None, :func:`status` says why and :func:`report` adds the compiler's last lines; the split-K engine
then runs its pure-torch path (:mod:`attnkit.backends.cpu_splitk.engine`), with the same results, and ``auto``
leaves the calls SDPA runs to SDPA. :func:`engine` with ``build=False`` says which implementation
a call would get without compiling anything (what ``describe_call`` reports).
"""

from __future__ import annotations

import hashlib
import logging
import os
import platform
import shutil
import signal
import subprocess
import sys
import threading
import time
import warnings
from pathlib import Path

import torch

from .._sysinfo import cpu_flags, cpu_isa, cpu_name

__all__ = ["load", "status", "engine", "report", "library_path", "cache_dir", "cpu_description"]

_SOURCES = tuple(Path(__file__).with_name(f) for f in ("splitk.cpp", "rope.cpp", "norm.cpp", "linear.cpp", "kvquant.cpp"))
#: The ops the sources register (their TORCH_LIBRARY blocks); a loaded library must have them all.
_OPS = ("splitk_attention", "rope_rotate", "rms_norm", "linear_rows", "quantize_kv_rows")
_NAMESPACE = "attnkit_cpu"
#: Part of the cache key: a change to what a cached entry is (file layout, the hash record, one
#: translation unit) must not reuse entries written under the old rules.
_LAYOUT = "2"
#: Seconds one compiler run may take before it is killed.
_BUILD_TIMEOUT = 900
#: Compiler output lines kept for :func:`report` and the fallback warning.
_ERROR_LINES = 20

_log = logging.getLogger("attnkit.native")
_lock = threading.Lock()
_state: dict[str, object] = {}
_compilers: dict[tuple[str | None, str | None], str | None] = {}


def cpu_description() -> str:
    """The CPU's model name and ISA (e.g. ``"AMD EPYC (AVX2)"``)."""
    return f"{cpu_name()} ({cpu_isa()})"


def _cpu_key() -> str:
    """What the compiled code depends on: the CPU's model and flags (``-march=native``)."""
    return f"{cpu_description()}|{' '.join(sorted(cpu_flags()))}|{platform.machine()}"


def _compiler() -> str | None:
    """The C++ compiler's path, or None. Remembered per ($CXX, $PATH): ``auto`` asks
    :func:`engine` on decode calls until the first build, and a PATH search is a few stats."""
    env = (os.environ.get("CXX"), os.environ.get("PATH"))
    if env not in _compilers:
        _compilers[env] = _find_compiler(env[0])
    return _compilers[env]


def _find_compiler(cxx: str | None) -> str | None:
    if cxx:
        return shutil.which(cxx) or (cxx if os.path.exists(cxx) else None)
    for name in ("c++", "g++", "clang++"):
        path = shutil.which(name)
        if path:
            return path
    return None


def cache_dir() -> Path:
    """Where built libraries live: ``$ATTNKIT_CACHE_DIR``, else ``$XDG_CACHE_HOME/attnkit``, else
    ``~/.cache/attnkit``."""
    root = os.environ.get("ATTNKIT_CACHE_DIR")
    if root:
        return Path(root)
    xdg = os.environ.get("XDG_CACHE_HOME")
    return Path(xdg) / "attnkit" if xdg else Path.home() / ".cache" / "attnkit"


_cache_dir = cache_dir  # the name older code and tests use


def _disabled() -> bool:
    return os.environ.get("ATTNKIT_NATIVE", "1").strip().lower() in ("0", "false", "no", "off")


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


def _unity_source() -> str:
    """One translation unit that includes the sources: the torch headers are parsed once instead
    of once per source (the sources keep file-local names distinct for this)."""
    return "".join(f'#include "{p.resolve().as_posix()}"\n' for p in _SOURCES)


def _paths(cxx: str) -> tuple[Path, Path, Path, str]:
    """(library, hash record, lock file, key) for this compiler, torch, CPU and these sources."""
    source = b"|".join(p.read_bytes() for p in _SOURCES)
    flags = " ".join(_command(cxx, [Path("src")], Path("out"), True))
    key = hashlib.sha256(b"|".join([source, torch.__version__.encode(), flags.encode(), _cpu_key().encode(),
                                    sys.version.encode(), _LAYOUT.encode()])).hexdigest()[:20]
    root = cache_dir()
    stem = f"attnkit_splitk_{key}"
    return root / f"{stem}.so", root / f"{stem}.sha256", root / f"{stem}.lock", stem


# ------------------------------------------------------------------ what is on disk, what is loaded


def _digest(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _record(lib: Path) -> str:
    """The hash record of a library: ``<sha256> <size>``."""
    return f"{_digest(lib)} {lib.stat().st_size}\n"


def _mismatch(lib: Path, record: Path) -> str | None:
    """Why the cached ``lib`` must not be loaded (None: it is the file the build recorded). The
    size is compared first: a truncated file is caught without reading it."""
    try:
        want_hash, want_size = record.read_text().split()
        want_size = int(want_size)
    except (OSError, ValueError):
        return f"no valid hash record ({record.name})"
    size = lib.stat().st_size
    if size != want_size:
        return f"size {size} bytes, recorded {want_size}"
    if _digest(lib) != want_hash:
        return "content differs from its recorded sha256"
    return None


def _registered_ops() -> list[str]:
    prefix = _NAMESPACE + "::"
    return [n[len(prefix):] for n in torch._C._dispatch_get_all_op_names() if n.startswith(prefix)]


def _missing_ops() -> list[str]:
    ns = getattr(torch.ops, _NAMESPACE)
    return [name for name in _OPS if not hasattr(ns, name)]


def _load_library(path: Path):
    """Load ``path`` and return ``torch.ops.attnkit_cpu``, or raise. Never loads a second library
    into a namespace that already has ops: a second TORCH_LIBRARY block for one namespace aborts
    the process."""
    taken = _registered_ops()
    if taken:
        raise RuntimeError(f"this process already has ops in torch.ops.{_NAMESPACE} ({', '.join(sorted(taken))}) "
                           f"from another library; not loading {path.name} beside them")
    torch.ops.load_library(str(path))
    missing = _missing_ops()
    if missing:
        raise RuntimeError(f"{path.name} loaded but lacks the ops {', '.join(missing)}")
    return getattr(torch.ops, _NAMESPACE)


# --------------------------------------------------------------------------------- the build


class _BuildError(RuntimeError):
    """A compile that failed; ``output`` holds the compiler's last lines."""

    def __init__(self, message: str, output: str = ""):
        super().__init__(message)
        self.output = output


def _tail(text: str, lines: int = _ERROR_LINES) -> str:
    kept = [line for line in text.strip().splitlines() if line.strip()]
    return "\n".join(kept[-lines:])


def _first_error(text: str) -> str:
    """The line of compiler output a one-line summary should quote: the first ``error``, else the
    last line."""
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    for line in lines:
        if "error" in line.lower():
            return line
    return lines[-1] if lines else ""


def _die_with_parent():
    """A function for the compiler's process to run before exec (Linux; else None): it asks the
    kernel to SIGKILL that process when the one that started it dies, even by SIGKILL. The libc
    function is looked up here, in the parent: the child of a threaded process must not import or
    dlopen between fork and exec."""
    if not sys.platform.startswith("linux"):
        return None
    import ctypes

    prctl = ctypes.CDLL(None, use_errno=True).prctl
    PR_SET_PDEATHSIG = 1

    def set_death_signal():
        prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL))

    return set_death_signal


def _run_compiler(cmd: list[str]) -> tuple[int, str]:
    """Run the compiler in its own process group and return (exit code, its output). An interrupt
    (KeyboardInterrupt), a timeout or any other error kills the whole group (the driver and the
    cc1plus / as / ld it started) before it propagates."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                            text=True, errors="replace", start_new_session=True, preexec_fn=_die_with_parent())
    try:
        out, _ = proc.communicate(timeout=_BUILD_TIMEOUT)
    except BaseException as e:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except OSError:
            pass
        proc.wait()
        if isinstance(e, subprocess.TimeoutExpired):
            raise _BuildError(f"the compiler ran past {_BUILD_TIMEOUT} s and was stopped") from None
        raise
    return proc.returncode, out or ""


def _kill_leftover_compilers(build: Path) -> None:
    """SIGKILL the processes still working in a dead build's folder. A build killed by SIGKILL
    takes the compiler driver with it (:func:`_die_with_parent`) but not the cc1plus or ld it
    started; they name the folder in their command line (Linux ``/proc``; elsewhere nothing)."""
    needle = os.fsencode(str(build) + os.sep)
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            if needle in (proc / "cmdline").read_bytes():
                os.kill(int(proc.name), signal.SIGKILL)
        except (OSError, ValueError):
            pass


def _remove_stale(root: Path, stem: str) -> None:
    """Delete what killed builds left: their build folders and compilers. Runs under this key's
    lock, so every build folder of this key belongs to a dead process; also removes the
    ``tmp*.so`` files of earlier attnkit versions, once they are older than any build could run."""
    for p in root.glob(f"{stem}.build-*"):
        _kill_leftover_compilers(p)
        shutil.rmtree(p, ignore_errors=True)
    now = time.time()
    for p in root.glob("tmp*.so"):
        try:
            if now - p.stat().st_mtime > 2 * _BUILD_TIMEOUT:
                p.unlink()
        except OSError:
            pass


def _compile(cxx: str, build: Path) -> Path:
    """Compile the sources into ``build/<name>.so`` and return it; raise :class:`_BuildError`."""
    unity = build / "attnkit_native.cpp"
    unity.write_text(_unity_source())
    out = build / "attnkit_native.so"
    errors = []
    for native_arch in (True, False):  # a compiler that does not know -march=native still builds
        rc, text = _run_compiler(_command(cxx, [unity], out, native_arch))
        if rc == 0:
            size = out.stat().st_size if out.exists() else 0
            if size > 0:
                return out
            errors.append(f"{cxx} exited 0 but wrote {'an empty file' if out.exists() else 'no file'} ({out.name})")
        else:
            error = f"{cxx} exited with status {rc}:\n{_tail(text)}"
            if error not in errors:  # without -march=native it often fails the same way
                errors.append(error)
    first = errors[0].splitlines()
    summary = _first_error("\n".join(first[1:])) or first[0]
    raise _BuildError(f"compiling the native kernel failed: {summary}", "\n---\n".join(errors))


def _build_and_load(cxx: str, target: Path, record: Path, stem: str):
    """Compile, load the new library from its build folder (a path no earlier load used), and
    only then publish it under ``target`` with its hash record: a library that does not load, or
    lacks the ops, is never cached."""
    root = target.parent
    build = root / f"{stem}.build-{os.getpid()}"
    shutil.rmtree(build, ignore_errors=True)
    build.mkdir()
    try:
        _log.warning("attnkit: compiling the native CPU kernel (split-K attention, RoPE, RMSNorm, linear, KV quantizer) for this machine "
                     "with %s; this happens once, the library is cached in %s", cxx, root)
        t0 = time.perf_counter()
        try:
            out = _compile(cxx, build)
        except _BuildError:
            _log.warning("attnkit: compiling the native CPU kernel failed after %.1f s", time.perf_counter() - t0)
            raise
        text = _record(out)
        ops = _load_library(out)
        tmp_record = build / "record"
        tmp_record.write_text(text)
        os.replace(out, target)
        os.replace(tmp_record, record)
        _log.warning("attnkit: native CPU kernel compiled in %.1f s (%s)", time.perf_counter() - t0, target)
        return ops
    finally:
        shutil.rmtree(build, ignore_errors=True)


class _FileLock:
    """An exclusive ``flock`` on ``path`` (Linux, macOS; elsewhere no cross-process lock). Says
    so on the logger when it has to wait for another process's build."""

    def __init__(self, path: Path):
        self.path, self.fd = path, None

    def __enter__(self):
        try:
            import fcntl
        except ImportError:
            return self
        try:
            self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError:  # a read-only cache folder: its library can still be checked and loaded
            return self
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            _log.warning("attnkit: waiting for another process compiling the native CPU kernel (lock %s)", self.path)
            fcntl.flock(self.fd, fcntl.LOCK_EX)
        return self

    def __exit__(self, *exc):
        if self.fd is not None:
            os.close(self.fd)  # closing the descriptor releases the lock
            self.fd = None


def _try_cached(target: Path, record: Path):
    """(ops, None) when the cached library is the one built and loads with its ops; (None, why)
    when it must be rebuilt; (None, None) when there is none."""
    if not target.exists():
        return None, None
    why = _mismatch(target, record)
    if why is None:
        try:
            return _load_library(target), None
        except (RuntimeError, OSError) as e:  # OSError: dlopen refused the file
            if _registered_ops():  # a library is in this process now: no second one can load
                raise
            why = str(e)
    return None, why


def _load_or_build(cxx: str):
    """``torch.ops.attnkit_cpu`` from the verified cached library, else from one fresh build."""
    if not _missing_ops():  # already loaded in this process (by an earlier state, or by hand)
        return getattr(torch.ops, _NAMESPACE)
    target, record, lockfile, stem = _paths(cxx)
    # The common case takes no lock: a published library is never changed in place, only
    # replaced whole (rename), so a file that matches its record can be loaded as it is.
    ops, _ = _try_cached(target, record)
    if ops is None:
        target.parent.mkdir(parents=True, exist_ok=True)
        with _FileLock(lockfile):
            _remove_stale(target.parent, stem)
            ops, why = _try_cached(target, record)  # another process may have built it meanwhile
            if ops is None:
                if why is not None:
                    for p in (target, record):
                        p.unlink(missing_ok=True)
                    _log.warning("attnkit: the cached native library %s is not the one built (%s); rebuilding it",
                                 target.name, why)
                try:
                    ops = _build_and_load(cxx, target, record, stem)
                except _BuildError as e:
                    if why is not None:
                        raise _BuildError(f"{e} (rebuilding after: {why})", e.output) from None
                    raise
    _state["path"] = target
    return ops


# ------------------------------------------------------------------------------ public face


def load():
    """``torch.ops.attnkit_cpu`` with the compiled kernel, or None (then :func:`status` says why).
    Compiles on the first call in a machine's life (announced on the ``attnkit.native`` logger)."""
    if "ops" in _state:
        return _state["ops"]
    with _lock:
        if "ops" in _state:
            return _state["ops"]
        ops, why, output = None, None, ""
        if _disabled():
            why = "disabled by ATTNKIT_NATIVE=0"
        elif (cxx := _compiler()) is None:
            why = "no C++ compiler found ($CXX, c++, g++ or clang++)"
        else:
            try:
                ops = _load_or_build(cxx)
            except Exception as e:  # noqa: BLE001 - any build/load failure means: use the torch path
                why = str(e) or type(e).__name__
                output = getattr(e, "output", "")
        _state["why"], _state["output"] = why, output
        if ops is None and not _disabled():
            detail = f"\n{_tail(output, 5)}" if output else ""
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
    if _disabled():
        return "disabled by ATTNKIT_NATIVE=0"
    if _compiler() is None:
        return "no C++ compiler found ($CXX, c++, g++ or clang++)"
    return None


def engine(build: bool = True) -> str:
    """``"native"`` or ``"torch"``: the implementation the split-K engine runs here. With
    ``build=False`` nothing is compiled or loaded: before the first :func:`load` the answer is what
    it is expected to be (``"native"`` when a compiler is found and nothing disables it)."""
    if build or "ops" in _state:
        return "native" if load() is not None else "torch"
    return "native" if _prediction() is None else "torch"


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
    """What ``attnkit info`` prints about the native kernel: which engine runs and why, where the
    library is cached, and after a failed build the compiler's last lines. ``build=False``
    compiles nothing (an engine not built yet is reported as such)."""
    if build or "ops" in _state:
        loaded = load() is not None
        why = None if loaded else _state.get("why")
    else:
        loaded, why = False, _prediction()
    if loaded:
        lines = ["engine: native (the compiled kernel)", f"  library: {library_path() or 'loaded earlier'}"]
    elif why is None:
        lines = ["engine: native (not built yet: compiles once, on the first call that needs it; "
                 "`attnkit info` without --no-build compiles it now)"]
    else:
        lines = ["engine: torch (the native kernel is unavailable)", f"  why: {why}",
                 "  effect: `auto` gives plain decode calls to SDPA; forced decode/paged calls, soft-capped or "
                 "ALiBi ones, RoPE and RMSNorm run on torch ops (same results, slower)"]
    lines.append(f"  cache: {cache_dir()} (ATTNKIT_CACHE_DIR, else XDG_CACHE_HOME/attnkit, else ~/.cache/attnkit)")
    cxx = _compiler()
    lines.append(f"  compiler: {cxx or 'none found'}" + (" (from $CXX)" if os.environ.get("CXX") else ""))
    output = _state.get("output") or ""
    if output:
        lines.append("  compiler output (last lines):")
        lines += [f"    | {line}" for line in _tail(output).splitlines()]
    return lines
