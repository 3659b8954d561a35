"""The native kernel's loader: a visible build, fallbacks that say why, a cache that is checked
before it is loaded and keyed on what the build depends on (not on where the environment lives),
one build at a time, nothing left behind by a killed build.

Every case that could crash or compile runs in a subprocess with its own cache folder
(``ATTNKIT_CACHE_DIR``) and a fake compiler (``CXX``): a script that "builds" by copying the
library this process compiled (or fails, writes nothing, hangs), so no test here runs a real
compile beyond the one the test session needs anyway.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from attnkit import native
from attnkit.backends.decode import auto_skip
from attnkit.backends.registry import AttentionCall
from attnkit.masks import ALiBi
from attnkit.native import build

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="fake compilers are POSIX scripts")

FAKE_CXX = """\
#!{python}
# A stand-in for a C++ compiler; FAKE_CXX_MODE says what it does with `-o <out>`.
import os, shutil, subprocess, sys, time
if sys.argv[1:] == ["--version"]:  # asked for the cache key: not a build
    print("fake-c++ 1.0")
    sys.exit(0)
out = sys.argv[sys.argv.index("-o") + 1]
log = os.environ.get("FAKE_CXX_LOG")
if log:
    with open(log, "a") as f:
        f.write(f"{{os.getpid()}}\\n")
mode = os.environ.get("FAKE_CXX_MODE", "copy")
if mode == "copy":
    time.sleep(float(os.environ.get("FAKE_CXX_SLEEP", "0")))
    shutil.copyfile(os.environ["FAKE_CXX_LIB"], out)
elif mode == "empty":
    open(out, "wb").close()
elif mode == "fail":
    print("In file included from attnkit_native.cpp:1:", file=sys.stderr)
    print("splitk.cpp:26:10: fatal error: ATen/Boom.h: No such file or directory", file=sys.stderr)
    sys.exit(1)
elif mode == "hang":  # like gcc: a driver whose child (cc1plus) names the build folder
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)", out])
    with open(log, "a") as f:
        f.write(f"{{child.pid}}\\n")
    time.sleep(600)
"""


@pytest.fixture
def fake_cxx(tmp_path):
    path = tmp_path / "fake-c++"
    path.write_text(FAKE_CXX.format(python=sys.executable))
    path.chmod(0o755)
    return path


@pytest.fixture(scope="module")
def real_lib(tmp_path_factory):
    """A copy of the library this test session compiled (what the fake compiler "builds")."""
    if native.load() is None or native.library_path() is None:
        pytest.skip(f"no native kernel here: {native.status()}")
    copy = tmp_path_factory.mktemp("lib") / "built.so"
    shutil.copyfile(native.library_path(), copy)
    return copy


def run_py(code: str, tmp_path: Path, cxx, timeout: float = 300, **env) -> subprocess.CompletedProcess:
    """Run ``code`` in a fresh interpreter with the cache in ``tmp_path/cache`` and CXX=``cxx``."""
    full = dict(os.environ, ATTNKIT_CACHE_DIR=str(tmp_path / "cache"), CXX=str(cxx), **env)
    full.pop("ATTNKIT_NATIVE", None)
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          timeout=timeout, env=full, cwd=tmp_path)


LOAD = """
from attnkit import native
print(native.status())
print(native.library_path())
"""


def loaded(res: subprocess.CompletedProcess) -> tuple[str, str]:
    assert res.returncode == 0, res.stderr  # a negative code is a signal: SIGBUS, SIGILL, ...
    status, path = res.stdout.strip().splitlines()[-2:]
    return status, path


def builds(res: subprocess.CompletedProcess) -> int:
    return res.stderr.count("attnkit: compiling the native CPU kernel")


# ---------------------------------------------------------------------------- a visible build


def test_first_build_announces_start_and_end_then_is_reused(tmp_path, fake_cxx, real_lib):
    first = run_py(LOAD, tmp_path, fake_cxx, FAKE_CXX_LIB=str(real_lib))
    assert loaded(first)[0] == "native"
    lines = [line for line in first.stderr.splitlines() if line.startswith("attnkit:")]
    assert len(lines) == 2, first.stderr
    assert "compiling" in lines[0] and "once" in lines[0] and str(tmp_path / "cache") in lines[0]
    assert "compiled in" in lines[1] and " s " in lines[1]
    second = run_py(LOAD, tmp_path, fake_cxx, FAKE_CXX_LIB=str(real_lib))
    assert loaded(second) == loaded(first)
    assert "attnkit:" not in second.stderr


def test_build_messages_can_be_silenced_with_logging(tmp_path, fake_cxx, real_lib):
    code = "import logging\nlogging.getLogger('attnkit.native').setLevel(logging.ERROR)\n" + LOAD
    res = run_py(code, tmp_path, fake_cxx, FAKE_CXX_LIB=str(real_lib))
    assert loaded(res)[0] == "native"
    assert "attnkit:" not in res.stderr


def test_describe_call_and_info_no_build_never_compile(tmp_path, fake_cxx):
    log = tmp_path / "invocations"
    code = """
    import torch, attnkit
    from attnkit.cli import main
    torch.manual_seed(0)
    q, k = torch.randn(1, 8, 1, 64), torch.randn(1, 2, 5000, 64)
    print(attnkit.describe_call(q, k, k))
    print(attnkit.describe_call(q, k, k, detail=True))
    main(["info", "--no-build"])
    """
    res = run_py(code, tmp_path, fake_cxx, FAKE_CXX_MODE="fail", FAKE_CXX_LOG=str(log))
    assert res.returncode == 0, res.stderr
    out = res.stdout.splitlines()
    assert out[:2] == ["decode", "decode[native (not built yet)]"]
    assert "not built yet" in res.stdout and "implementation: native" in res.stdout
    assert not log.exists(), "the compiler ran"
    assert not list((tmp_path / "cache").glob("*.so"))


def test_import_compiles_and_loads_nothing(tmp_path, fake_cxx):
    log = tmp_path / "invocations"
    code = """
    import sys, attnkit
    from attnkit import native
    print("ops" in native._state, "torch.utils.cpp_extension" in sys.modules)
    """
    res = run_py(code, tmp_path, fake_cxx, FAKE_CXX_LOG=str(log))
    assert res.returncode == 0, res.stderr
    assert res.stdout.split() == ["False", "False"]
    assert not log.exists() and not (tmp_path / "cache").exists()


# ------------------------------------------------------------------------ fallbacks say why


def test_no_compiler_is_reported_and_auto_leaves_decode_to_sdpa(tmp_path):
    code = """
    import warnings, torch, attnkit
    from attnkit.cli import main
    torch.manual_seed(0)
    q, k = torch.randn(1, 8, 1, 64), torch.randn(1, 2, 5000, 64)
    print(attnkit.describe_call(q, k, k))
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        out = attnkit.attention(q, k, k, backend="decode")  # forcing still works
    print(attnkit.describe_call(q, k, k, backend="decode", detail=True))
    print(float((out - attnkit.attention(q, k, k, backend="sdpa")).abs().max()))
    print("WARN", [str(x.message) for x in w])
    main(["info"])
    """
    res = run_py(code, tmp_path, "/nonexistent")
    assert res.returncode == 0, res.stderr
    out = res.stdout.splitlines()
    assert out[:2] == ["sdpa", "decode[torch]"]
    assert float(out[2]) < 5e-5, f"torch fallback vs SDPA differ by {out[2]}"  # fp32 sums of 5000 terms
    assert "no C++ compiler found" in out[3]
    info = res.stdout[res.stdout.index("backends (auto order"):]
    assert "implementation torch" in info and "why: no C++ compiler found" in info


def test_failed_build_warning_names_compiler_error_and_points_at_the_caller(tmp_path, fake_cxx):
    script = tmp_path / "user_script.py"
    script.write_text(textwrap.dedent("""\
        import torch, attnkit
        q, k = torch.randn(1, 8, 1, 64), torch.randn(1, 2, 5000, 64)
        attnkit.attention(q, k, k, backend="decode")
        from attnkit.cli import main
        main(["info"])
        """))
    res = run_py(f"exec(compile(open({str(script)!r}).read(), {str(script)!r}, 'exec'))", tmp_path, fake_cxx,
                 FAKE_CXX_MODE="fail")
    assert res.returncode == 0, res.stderr
    assert f"{script}:3: RuntimeWarning" in res.stderr, res.stderr
    assert "fatal error: ATen/Boom.h: No such file or directory" in res.stderr
    assert "compiling the native CPU kernel failed after" in res.stderr
    assert "why: compiling the native kernel failed: splitk.cpp:26:10: fatal error: ATen/Boom.h" in res.stdout
    assert "    | splitk.cpp:26:10: fatal error" in res.stdout  # the compiler's last lines
    assert not list((tmp_path / "cache").glob("*.so"))


def _call(kv_layout="dense", D=64, Dv=64, Sk=5000, dtype=torch.float32, softcap=None, mask=None):
    return AttentionCall(1, 8, 2, 1, Sk, D, Dv, dtype, torch.device("cpu"), mask, 0.125, 0.0, False, False,
                         kv_layout=kv_layout, softcap=softcap)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_auto_skips_the_torch_implementation_where_sdpa_runs_the_call(dtype):
    """Without the native kernel the torch implementation is slower than SDPA: ``auto`` gives
    SDPA every call it can run (dense, paged via gathering, MLA widths); calls SDPA cannot fuse
    (soft cap, ALiBi) still take the engine. With the native kernel nothing changes."""
    for call in (_call(dtype=dtype), _call("paged", dtype=dtype), _call(D=576, Dv=512, dtype=dtype),
                 _call(Sk=1 << 20, dtype=dtype)):
        assert auto_skip(call, "native") is None
        why = auto_skip(call, "torch")
        assert why is not None and "no native kernel" in why and "forces" in why
    assert auto_skip(_call(softcap=30.0, dtype=dtype), "torch") is None
    assert auto_skip(_call(mask=ALiBi(torch.ones(8)), dtype=dtype), "torch") is None
    assert "tiny cache" in auto_skip(_call(Sk=17, dtype=dtype), "native")


# ------------------------------------------------------ the cache key: what the build depends on


def test_every_included_header_is_keyed_and_shipped():
    """A header a source includes is part of the cache key (a change to it rebuilds) and of the
    package data (an installed copy builds)."""
    import fnmatch
    import re
    import tomllib

    included = {m for p in build._SOURCES for m in re.findall(r'#include "([^"]+)"', p.read_text())}
    assert included and included == {p.name for p in build._HEADERS}
    pyproject = Path(__file__).resolve().parents[1] / "pyproject.toml"
    shipped = tomllib.loads(pyproject.read_text())["tool"]["setuptools"]["package-data"]["attnkit"]
    for p in (*build._SOURCES, *build._HEADERS):
        assert p.exists() and any(fnmatch.fnmatch(f"native/{p.name}", g) for g in shipped), p.name


def test_cache_key_holds_no_path_of_this_environment():
    inputs = build.key_inputs(build.compiler() or "c++")
    text = repr(inputs)
    for where in {sys.prefix, sys.base_prefix, build._torch_dir(), str(Path(torch.__file__).parent)}:
        assert where not in text, where
    assert "<torch>/include" in inputs["flags"]


def test_cache_key_is_the_same_wherever_torch_is_installed(tmp_path):
    """A second environment with the same torch, compiler and flags (here: the same torch package
    reached through another folder) finds the library the first one built."""
    site = tmp_path / "elsewhere" / "site-packages"
    site.mkdir(parents=True)
    (site / "torch").symlink_to(Path(torch.__file__).parent, target_is_directory=True)
    code = """
    import json, torch
    from attnkit.native import build
    inputs = build.key_inputs(build.compiler() or "c++")
    print(json.dumps([torch.__file__, build.cache_key(inputs), inputs]))
    """
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")]))
    res = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, env=env,
                         timeout=300)
    assert res.returncode == 0, res.stderr
    torch_file, key, inputs = json.loads(res.stdout.strip().splitlines()[-1])
    assert torch_file.startswith(str(site)), "the other torch folder was not used"
    here = build.key_inputs(build.compiler() or "c++")
    assert inputs == here
    assert key == build.cache_key(here)


def _copy_sources(tmp_path, monkeypatch) -> Path:
    folder = tmp_path / "native"
    folder.mkdir()
    for p in (*build._SOURCES, *build._HEADERS):
        shutil.copyfile(p, folder / p.name)
    monkeypatch.setattr(build, "_SOURCES", tuple(folder / p.name for p in build._SOURCES))
    monkeypatch.setattr(build, "_HEADERS", tuple(folder / p.name for p in build._HEADERS))
    return folder


@pytest.mark.parametrize("changed", ["splitk.cpp", "simd.h"])
def test_cache_key_follows_the_sources_and_header_not_their_folder(tmp_path, monkeypatch, changed):
    cxx = build.compiler() or "c++"
    before = build.cache_key(build.key_inputs(cxx))
    folder = _copy_sources(tmp_path, monkeypatch)
    assert build.cache_key(build.key_inputs(cxx)) == before  # an installed copy: same key
    with open(folder / changed, "a") as f:
        f.write("\n// one more line\n")
    assert build.cache_key(build.key_inputs(cxx)) != before


def test_cache_key_follows_the_torch_build(monkeypatch):
    cxx = build.compiler() or "c++"
    before = build.cache_key(build.key_inputs(cxx))
    monkeypatch.setattr(torch, "__version__", torch.__version__ + ".other")
    after_version = build.cache_key(build.key_inputs(cxx))
    monkeypatch.undo()
    monkeypatch.setattr(torch.version, "git_version", "0" * 40)
    after_commit = build.cache_key(build.key_inputs(cxx))
    assert len({before, after_version, after_commit}) == 3


def test_cache_key_follows_every_input():
    inputs = build.key_inputs(build.compiler() or "c++")
    key = build.cache_key(inputs)
    assert build.cache_key(dict(reversed(list(inputs.items())))) == key
    for name in inputs:
        assert build.cache_key({**inputs, name: inputs[name] + "x"}) != key, name


# --------------------------------------------------------------------- what is loaded is checked


def _unrelated_library(tmp_path) -> Path:
    cxx = shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")
    if cxx is None:
        pytest.skip("no compiler for the unrelated library")
    src, out = tmp_path / "unrelated.cpp", tmp_path / "unrelated.so"
    src.write_text('extern "C" int attnkit_unrelated() { return 1; }\n')
    subprocess.run([cxx, "-shared", "-fPIC", str(src), "-o", str(out)], check=True, capture_output=True)
    return out


def _half(lib: Path, tmp_path) -> None:
    data = lib.read_bytes()
    lib.write_bytes(data[: len(data) // 2])


def _overwrite_code(lib: Path, tmp_path) -> None:
    data = bytearray(lib.read_bytes())
    mid = len(data) // 2
    data[mid: mid + 4096] = b"\x0f\x0b" * 2048  # ud2: SIGILL if it ever ran
    lib.write_bytes(bytes(data))


def _empty(lib: Path, tmp_path) -> None:
    lib.write_bytes(b"")


def _unrelated(lib: Path, tmp_path) -> None:
    shutil.copyfile(_unrelated_library(tmp_path), lib)


def _unrelated_with_forged_record(lib: Path, tmp_path) -> None:
    """Another library whose hash record matches it: caught after loading (no ops), rebuilt."""
    _unrelated(lib, tmp_path)
    data = lib.read_bytes()
    lib.with_suffix(".sha256").write_text(f"{hashlib.sha256(data).hexdigest()} {len(data)}\n")


@pytest.mark.parametrize("damage", [_half, _overwrite_code, _empty, _unrelated, _unrelated_with_forged_record],
                         ids=lambda f: f.__name__.strip("_"))
def test_damaged_cached_library_is_rebuilt_never_loaded(tmp_path, fake_cxx, real_lib, damage, monkeypatch):
    # The cache entry a build with the fake compiler writes: the library and its hash record.
    monkeypatch.setenv("ATTNKIT_CACHE_DIR", str(tmp_path / "cache"))
    lib, record, _, _ = build._paths(str(fake_cxx))
    lib.parent.mkdir()
    shutil.copyfile(real_lib, lib)
    record.write_text(f"{hashlib.sha256(lib.read_bytes()).hexdigest()} {lib.stat().st_size}\n")
    damage(lib, tmp_path)
    res = run_py(LOAD, tmp_path, fake_cxx, FAKE_CXX_LIB=str(real_lib))
    assert loaded(res) == ("native", str(lib))
    assert "is not the one built" in res.stderr and builds(res) == 1, res.stderr
    assert lib.read_bytes() == real_lib.read_bytes()
    digest, size = lib.with_suffix(".sha256").read_text().split()
    assert (digest, int(size)) == (hashlib.sha256(lib.read_bytes()).hexdigest(), lib.stat().st_size)


def test_a_compiler_that_writes_nothing_is_not_cached(tmp_path, fake_cxx, real_lib):
    res = run_py(LOAD, tmp_path, fake_cxx, FAKE_CXX_MODE="empty")
    status, _ = loaded(res)
    assert status.startswith("torch (compiling the native kernel failed") and "exited 0 but wrote an empty" in status
    assert not list((tmp_path / "cache").glob("*.so"))
    assert not list((tmp_path / "cache").glob("*.build-*"))
    assert loaded(run_py(LOAD, tmp_path, fake_cxx, FAKE_CXX_LIB=str(real_lib)))[0] == "native"


# ---------------------------------------------------------------- one build at a time, no leftovers


def test_concurrent_first_uses_build_once(tmp_path, fake_cxx, real_lib):
    log, go = tmp_path / "invocations", tmp_path / "go"
    code = f"""
    import os, time
    from attnkit import native
    native.build._paths(native.build.compiler())  # everything but the build, before the start line
    print("ready", flush=True)
    while not os.path.exists({str(go)!r}):
        time.sleep(0.01)
    print(native.status())
    print(native.library_path())
    """
    env = dict(os.environ, ATTNKIT_CACHE_DIR=str(tmp_path / "cache"), CXX=str(fake_cxx), FAKE_CXX_LIB=str(real_lib),
               FAKE_CXX_LOG=str(log), FAKE_CXX_SLEEP="3")
    procs = [subprocess.Popen([sys.executable, "-c", textwrap.dedent(code)], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env=env) for _ in range(2)]
    for p in procs:
        assert p.stdout.readline().strip() == "ready"
    go.touch()
    results = [p.communicate(timeout=300) for p in procs]
    assert all(p.returncode == 0 for p in procs), results
    assert len(log.read_text().split()) == 1, "each process compiled"
    outs = [out.split() for out, _ in results]
    assert outs[0] == outs[1] and outs[0][0] == "native"
    assert sum("waiting for another process" in err for _, err in results) == 1


def _pids(log: Path, n: int, timeout: float = 120) -> list[int]:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        pids = log.read_text().split() if log.exists() else []
        if len(pids) >= n:
            return [int(p) for p in pids[:n]]
        time.sleep(0.05)
    raise AssertionError("the fake compiler did not start")


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"  # a zombie has exited; only its parent (or init) has not reaped it yet


def _wait_dead(pids, timeout: float = 30) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if not any(_alive(p) for p in pids):
            return True
        time.sleep(0.05)
    return False


def _start_hanging_build(tmp_path, fake_cxx):
    log = tmp_path / "invocations"
    env = dict(os.environ, ATTNKIT_CACHE_DIR=str(tmp_path / "cache"), CXX=str(fake_cxx), FAKE_CXX_MODE="hang",
               FAKE_CXX_LOG=str(log))
    # Ctrl-C raises KeyboardInterrupt even where this test runs with SIGINT ignored (a background
    # job of a non-interactive shell), whose disposition the child would inherit
    code = "import signal; signal.signal(signal.SIGINT, signal.default_int_handler); from attnkit import native; " \
           "native.load()"
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env)
    return proc, _pids(log, 2)


def test_interrupted_build_kills_the_compiler_and_removes_its_files(tmp_path, fake_cxx):
    proc, pids = _start_hanging_build(tmp_path, fake_cxx)
    try:
        proc.send_signal(signal.SIGINT)  # Ctrl-C: KeyboardInterrupt in the waiting build
        _, err = proc.communicate(timeout=60)
        assert "KeyboardInterrupt" in err
        assert _wait_dead(pids), "the compiler outlived the interrupted build"
        assert not list((tmp_path / "cache").glob("*.build-*"))
    finally:
        for pid in pids:
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)


def test_killed_build_leftovers_are_cleaned_by_the_next_build(tmp_path, fake_cxx, real_lib):
    proc, (driver, child) = _start_hanging_build(tmp_path, fake_cxx)
    try:
        proc.kill()  # SIGKILL: no Python code runs in the build's process
        proc.wait()
        assert _wait_dead([driver]), "the compiler driver outlived the killed build"
        assert list((tmp_path / "cache").glob("*.build-*"))
        old = tmp_path / "cache" / "tmpabcdefgh.so"  # what earlier versions left behind
        old.write_bytes(b"")
        os.utime(old, (time.time() - 7200, time.time() - 7200))
        assert loaded(run_py(LOAD, tmp_path, fake_cxx, FAKE_CXX_LIB=str(real_lib)))[0] == "native"
        assert _wait_dead([child]), "the compiler's child outlived the next build"
        assert not list((tmp_path / "cache").glob("*.build-*")) and not old.exists()
    finally:
        for pid in (driver, child):
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
