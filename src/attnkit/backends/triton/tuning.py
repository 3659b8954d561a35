"""Tuned launch parameters of the Triton decode kernel, per GPU architecture, read at run time.

``tuned.json`` beside this file maps an architecture (``"sm_90"``) and a kernel shape
(:func:`shape_key`: dtype, head dims, V read from K, quantized K/V) to the launch parameters a
tuning run measured fastest on that GPU (``python benchmarks/gpu_check.py --tune`` writes it):
``BLOCK_N`` (keys per tile), ``num_warps``, ``num_stages``. The kernel's own rule
(``kernel._config``) gives every other parameter, and all of them where the table has no entry
(another GPU, a shape never tuned). An entry the kernel cannot take is an error that names it,
never a silent fallback.
"""

from __future__ import annotations

import contextlib
import functools
import json
from pathlib import Path

import torch

__all__ = ["TABLE", "TUNABLE", "arch_of", "forced", "lookup", "record", "shape_key", "tuned"]

#: The committed table.
TABLE = Path(__file__).with_name("tuned.json")

#: What a table entry may set, and the values each may take.
TUNABLE = {"BLOCK_N": (16, 32, 64, 128, 256), "num_warps": (2, 4, 8), "num_stages": (1, 2, 3, 4, 5)}

_loaded: dict[Path, dict] = {}
_forced: list[dict] = []  # a tuning run's candidate, applied to every shape while it is set


@functools.lru_cache(maxsize=None)
def arch_of(device: torch.device | str) -> str:
    """``"sm_<major><minor>"`` of a CUDA device (the table's first key)."""
    major, minor = torch.cuda.get_device_capability(torch.device(device))
    return f"sm_{major}{minor}"


def shape_key(dtype: torch.dtype, head_dim: int, v_head_dim: int, v_from_k: bool, kv_dtype: torch.dtype | None,
              selection: bool = False, latent: bool = False) -> str:
    """The table's second key: what decides a kernel's tiles. ``kv_dtype`` is the stored K/V dtype
    when it differs from q's (int8 / fp8), else None; ``selection``: the kernel that walks a
    per-query selection; ``latent``: the lean MLA kernel (:mod:`attnkit.backends.triton.latent`),
    whose best tiles are not the shared kernel's for the same shape."""
    name = str(dtype).removeprefix("torch.")
    kv = "" if kv_dtype is None else f"-kv_{str(kv_dtype).removeprefix('torch.')}"
    tail = f"{'-vk' if v_from_k else ''}{kv}{'-sel' if selection else ''}{'-latent' if latent else ''}"
    return f"{name}-d{head_dim}-dv{v_head_dim}{tail}"


def _check(entry: dict, where: str) -> dict:
    if not isinstance(entry, dict) or not entry:
        raise ValueError(f"tuned table entry {where} must be a non-empty object, got {entry!r}")
    for name, value in entry.items():
        if name not in TUNABLE:
            raise ValueError(f"tuned table entry {where} sets {name!r}; it may set {', '.join(TUNABLE)}")
        if value not in TUNABLE[name]:
            raise ValueError(f"tuned table entry {where} sets {name}={value!r}; allowed: {TUNABLE[name]}")
    return entry


def _table(path: Path) -> dict:
    if path not in _loaded:
        data = json.loads(path.read_text()) if path.exists() else {}
        if not isinstance(data, dict):
            raise ValueError(f"{path} must hold a JSON object of architectures, got {type(data).__name__}")
        _loaded[path] = data
    return _loaded[path]


def lookup(arch: str, key: str, path: Path | None = None) -> dict | None:
    """The checked entry for ``arch`` and ``key``, or None where the table has none."""
    path = TABLE if path is None else Path(path)
    entry = _table(path).get(arch, {}).get(key)
    return None if entry is None else _check(entry, f"{arch} / {key} in {path}")


def tuned(cfg: dict, arch: str | None, key: str, path: Path | None = None) -> dict:
    """``cfg`` (the kernel's own choice) with the table's entry for ``arch`` / ``key`` applied
    (``arch`` None: the interpreter, never tuned)."""
    entry = _forced[-1] if _forced else None if arch is None else lookup(arch, key, path)
    return cfg if entry is None else {**cfg, **entry}


@contextlib.contextmanager
def forced(entry: dict):
    """Every launch inside the block takes ``entry`` whatever the table says (a tuning run's
    candidate; ``benchmarks/gpu_tune.py``)."""
    _forced.append(_check(dict(entry), "forced"))
    try:
        yield
    finally:
        _forced.pop()


def record(arch: str, key: str, entry: dict, path: Path | None = None) -> None:
    """Write ``entry`` for ``arch`` / ``key`` into the table (keys sorted, one file per repo)."""
    path = TABLE if path is None else Path(path)
    _check(entry, f"{arch} / {key}")
    data = json.loads(path.read_text()) if path.exists() else {}
    data.setdefault(arch, {})[key] = dict(sorted(entry.items()))
    path.write_text(json.dumps({a: dict(sorted(v.items())) for a, v in sorted(data.items())}, indent=1) + "\n")
    _loaded.pop(path, None)
