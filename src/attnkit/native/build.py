"""How the native kernels are built, cached and loaded (:func:`attnkit.native.load` is the way in).

The sources (``splitk.cpp``, ``rope.cpp``, ``norm.cpp``, ``linear.cpp``, ``kvquant.cpp``, and
the header they share, ``simd.h``) are compiled into one library against the installed torch with
the system C++ compiler (``$CXX``, else ``c++`` / ``g++`` / ``clang++``) and ``-march=native``
(the kernel is built for the instruction set of the CPU that runs it: AVX2, AVX-512, ... decided
by the compiler, not by us), as one translation unit: the torch headers they share, not the
kernels, are most of the compile time. The library is cached under :func:`cache_dir`
(``$ATTNKIT_CACHE_DIR``, else ``$XDG_CACHE_HOME/attnkit``, else ``~/.cache/attnkit``) and loaded
as the torch ops ``torch.ops.attnkit_cpu.splitk_attention``, ``.rope_rotate``, ``.rms_norm``,
``.linear_rows`` and ``.quantize_kv_rows``.

The cache key (:func:`key_inputs`) is what the library depends on: the sources' and header's
contents, the compiler and its version, the flags, the torch build, Python's version and the CPU.
It holds no path of the environment, so a new virtualenv (or an installed copy beside an editable
one) with the same of all these loads the library another one built, and any change to them
builds anew.

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
import time
from pathlib import Path

import torch

from .._sysinfo import cpu_flags, cpu_isa, cpu_name

_HERE = Path(__file__).parent
#: What the library is built from: the sources (compiled as one translation unit) and the header
#: they include. All of them are in the cache key and ship with the package (pyproject's
#: package-data), so an installed copy builds as the source tree does.
_SOURCES = tuple(_HERE / f for f in ("splitk.cpp", "rope.cpp", "norm.cpp", "linear.cpp", "kvquant.cpp"))
_HEADERS = (_HERE / "simd.h",)
#: The ops the sources register (their TORCH_LIBRARY blocks); a loaded library must have them all.
_OPS = ("splitk_attention", "rope_rotate", "rms_norm", "linear_rows", "quantize_kv_rows")
_NAMESPACE = "attnkit_cpu"
#: Part of the cache key: a change to what a cached entry is (file layout, the hash record, one
#: translation unit, what the key holds) must not reuse entries written under other rules.
_LAYOUT = "3"
#: Seconds one compiler run may take before it is killed.
_BUILD_TIMEOUT = 900
#: Compiler output lines kept for :func:`report` and the fallback warning.
_ERROR_LINES = 20

_log = logging.getLogger("attnkit.native")
_compilers: dict[tuple[str | None, str | None], str | None] = {}
_versions: dict[str, str] = {}


def cpu_description() -> str:
    """The CPU's model name and ISA (e.g. ``"AMD EPYC (AVX2)"``)."""
    return f"{cpu_name()} ({cpu_isa()})"


def _cpu_key() -> str:
    """What the compiled code depends on: the CPU's model and flags (``-march=native``)."""
    return f"{cpu_description()}|{' '.join(sorted(cpu_flags()))}|{platform.machine()}"


def compiler() -> str | None:
    """The C++ compiler's path, or None. Remembered per ($CXX, $PATH): ``auto`` asks
    :func:`attnkit.native.implementation` on decode calls until the first build, and a PATH
    search is a few stats."""
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


def disabled() -> bool:
    """Whether ``ATTNKIT_NATIVE`` (``0``, ``false``, ``no``, ``off``) turns the native kernels off."""
    return os.environ.get("ATTNKIT_NATIVE", "1").strip().lower() in ("0", "false", "no", "off")


def _march() -> str:
    """The ``-march=`` target: the CPU that runs the build, unless ``ATTNKIT_NATIVE_MARCH`` says."""
    return os.environ.get("ATTNKIT_NATIVE_MARCH", "").strip() or "native"


def _torch_dir() -> str:
    """The installed torch package's folder (its headers under ``include/``, libraries under ``lib/``)."""
    return os.path.abspath(Path(torch.__file__).parent)


def _command(cxx: str, srcs, out: Path, native_arch: bool) -> list[str]:
    """The compiler's command line. The include, library and rpath folders are this environment's
    torch; a library built in another environment with the same torch build (same cache key) loads
    here all the same, since torch's own libraries are already loaded, under the sonames the
    library asks for, by the time it is."""
    from torch.utils import cpp_extension

    lib = Path(_torch_dir()) / "lib"
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


def _compiler_version(cxx: str) -> str:
    """What ``cxx --version`` prints (the compiler, its version and vendor build), remembered per
    compiler; the compiler's resolved path where it prints nothing."""
    if cxx not in _versions:
        try:
            res = subprocess.run([cxx, "--version"], capture_output=True, text=True, errors="replace",
                                 stdin=subprocess.DEVNULL, timeout=60)
            text = res.stdout.strip() if res.returncode == 0 else ""
        except (OSError, subprocess.SubprocessError):
            text = ""
        _versions[cxx] = text or os.path.realpath(cxx)
    return _versions[cxx]


def _torch_build() -> str:
    """The torch build the library is compiled against: its version, commit, debug flag, C++ ABI,
    OpenMP, and the build configuration it reports (compiler, flags, libraries), less the line
    naming the CPU capability it picked at run time (the CPU is keyed on its own). Two torch builds
    differ in at least one of these, so they never share a library."""
    config = "\n".join(line for line in torch.__config__.show().splitlines() if "CPU capability usage" not in line)
    return (f"{torch.__version__}|{torch.version.git_version}|debug={torch.version.debug}"
            f"|cxx11abi={int(torch._C._GLIBCXX_USE_CXX11_ABI)}|openmp={torch._C.has_openmp}|{config}")


def _portable_flags(cmd: list[str], torch_dir: str) -> str:
    """``cmd``'s flags (the compiler's path left out) with the torch folder written as ``<torch>``:
    what the command asks for, not where this environment keeps it."""
    return " ".join(arg.replace(torch_dir, "<torch>") for arg in cmd[1:])


def key_inputs(cxx: str) -> dict[str, str]:
    """What the library built here depends on, by name: the sources' and header's contents, the
    compiler's identity and version, the flags, the torch build, Python's version and the CPU (its
    model, flags and ``-march`` target). No path of this environment is among them, so two
    environments with the same of all these share one cached library and a new virtualenv does not
    rebuild; a change to any of them is a new key."""
    files = hashlib.sha256()
    for p in (*_SOURCES, *_HEADERS):
        files.update(p.name.encode() + b"\0" + p.read_bytes() + b"\0")
    return {
        "layout": _LAYOUT,
        "sources": files.hexdigest(),
        "compiler": _compiler_version(cxx),
        "flags": _portable_flags(_command(cxx, [Path("src.cpp")], Path("out.so"), True), _torch_dir()),
        "torch": _torch_build(),
        "python": f"{sys.version}|{sys.implementation.cache_tag}",
        "cpu": _cpu_key(),
    }


def cache_key(inputs: dict[str, str]) -> str:
    """The cache key (20 hex digits) of :func:`key_inputs`' answer."""
    h = hashlib.sha256()
    for name in sorted(inputs):
        h.update(f"{name}\0{inputs[name]}\0".encode())
    return h.hexdigest()[:20]


def _paths(cxx: str) -> tuple[Path, Path, Path, str]:
    """(library, hash record, lock file, stem) of the cache entry for what :func:`key_inputs` says."""
    key = cache_key(key_inputs(cxx))
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


def tail(text: str, lines: int = _ERROR_LINES) -> str:
    """The last ``lines`` non-blank lines of ``text`` (a compiler's output)."""
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
            error = f"{cxx} exited with status {rc}:\n{tail(text)}"
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


def load_or_build(cxx: str) -> tuple[object, Path | None]:
    """(``torch.ops.attnkit_cpu``, the library's cached file) from the verified cached library,
    else from one fresh build; raises when neither works. The file is None when the ops were
    already in this process (loaded by hand, or by an earlier state of :mod:`attnkit.native`)."""
    if not _missing_ops():
        return getattr(torch.ops, _NAMESPACE), None
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
    return ops, target
