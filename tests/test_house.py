"""House rules that hold for every file of ``src/attnkit`` (docs/architecture.md: "one module
reading another's private names" is never done; give it a public API).

A *reach-in* is any of:

* ``x._name`` where ``x`` is not ``self`` / ``cls`` / ``super()`` / ``type(self)`` nor a name the
  file itself defines at top level (its own classes, functions and constants), and ``_name`` is
  not a dunder;
* ``getattr`` / ``setattr`` / ``hasattr`` / ``delattr`` of such an object with a literal
  ``"_name"``;
* ``from .other import _name`` (a private name of another module);
* ``from ..room._module import ...``: a private module imported from outside its room (its
  package). The package's own top-level private modules (``attnkit._checks``, ...) are shared by
  every room by design.

torch's own privates are allowed through :data:`TORCH_PRIVATE`, each with its reason. The core
files (:data:`_CORE`) may still reach in where no public spelling exists: :data:`KNOWN` lists
exactly what they do, so the list can only shrink (a stale entry fails as well as a new
reach-in).
"""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src" / "attnkit"

#: torch privates attnkit may use: (first private attribute under ``torch``) -> why.
TORCH_PRIVATE = {
    "_C": "torch's C bindings: tensor/dispatch-key queries with no public spelling",
    "_dynamo": "torch.compile's tracer: is_compiling(), allow_in_graph, config of recompiles",
    "_inductor": "torch.compile's code generator: its config (e.g. fallbacks) for compiled steps",
    "_higher_order_ops": "FlexAttention's higher-order op (the flex backend)",
    "_subclasses": "FakeTensor checks while tracing",
    "_library": "custom-op registration (register_fake) for the native kernels",
    "_guards": "dynamo's tracing context",
    "_prims_common": "dtype helpers torch itself uses for promotion",
    "_utils": "torch's own small helpers",
    "_logging": "torch's structured logging (recompile reasons)",
    "_ops": "the op-overload types of torch.ops",
}

#: Reach-ins in the core files (backends/, native/, functional.py, masks/, reference.py, rope/),
#: as (file under src/attnkit, what is read). Every other file is clean; shrink this list as
#: those files gain public APIs.
KNOWN: set[tuple[str, str]] = {
    # Python's own private: the caller's frame, for naming where a native build was asked for
    ("native/__init__.py", "sys._getframe"),
    # torch's private aten ops (the fused CPU flash kernels SDPA uses), reached as ``aten._...``
    ("backends/common.py", "aten._scaled_dot_product_flash_attention_for_cpu"),
    ("backends/common.py", "aten._scaled_dot_product_flash_attention_for_cpu_backward"),
    # torch's private SDPA kernel chooser, probed by name
    ("backends/sdpa.py", "getattr(torch, '_fused_sdp_choice', None)"),
    # a tensor's private version counter (in-place change detection)
    ("masks/typed.py", "t._version"),
    # a private table of a transformers config object
    ("rope/config.py", "getattr(config, '_rope_type_labels', None)"),
}

_CORE = ("backends/", "native/", "functional.py", "masks/", "reference.py", "rope/")


def _root_name(node: ast.AST) -> str | None:
    while isinstance(node, ast.Attribute):
        node = node.value
    return node.id if isinstance(node, ast.Name) else None


def _is_own_object(node: ast.AST, own: set[str]) -> bool:
    """``self``, ``cls``, ``super()``, ``type(self)`` or a top-level name of the file itself."""
    if isinstance(node, ast.Name):
        return node.id in ("self", "cls") or node.id in own
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
        if node.func.id == "super":
            return True
        if node.func.id == "type" and len(node.args) == 1 and isinstance(node.args[0], ast.Name):
            return node.args[0].id in ("self", "cls")
    return False


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _torch_private(node: ast.Attribute) -> bool:
    """``torch._X...`` with ``_X`` in TORCH_PRIVATE (and anything under it)."""
    chain = []
    cur: ast.AST = node
    while isinstance(cur, ast.Attribute):
        chain.append(cur.attr)
        cur = cur.value
    if not (isinstance(cur, ast.Name) and cur.id == "torch"):
        return False
    chain.reverse()
    first = next((a for a in chain if _private(a)), None)
    return first in TORCH_PRIVATE


def _own_names(tree: ast.Module) -> set[str]:
    own = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            own.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            for t in node.targets if isinstance(node, ast.Assign) else [node.target]:
                own.update(n.id for n in ast.walk(t) if isinstance(n, ast.Name))
    return own


def _module_parts(path: Path) -> list[str]:
    rel = path.relative_to(SRC.parent).with_suffix("")
    parts = list(rel.parts)
    return parts[:-1] if parts[-1] == "__init__" else parts


def _resolve(path: Path, node: ast.ImportFrom) -> list[str]:
    """The absolute module parts an ``ImportFrom`` names (relative imports resolved)."""
    if node.level == 0:
        return (node.module or "").split(".")
    pkg = list(path.relative_to(SRC.parent).parts[:-1])  # the file's package
    base = pkg[:len(pkg) - (node.level - 1)]
    return base + (node.module.split(".") if node.module else [])


def reach_ins(path: Path, text: str | None = None) -> list[str]:
    """What ``path`` (its text, or ``text`` as if it were at ``path``) reads of others' privates."""
    tree = ast.parse(path.read_text() if text is None else text, filename=str(path))
    own = _own_names(tree)
    here = _module_parts(path)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and _private(node.attr):
            if not _is_own_object(node.value, own) and not _torch_private(node):
                found.append(ast.unparse(node))
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
              and node.func.id in ("getattr", "setattr", "hasattr", "delattr") and len(node.args) >= 2
              and isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str)
              and _private(node.args[1].value) and not _is_own_object(node.args[0], own)):
            found.append(ast.unparse(node))
        elif isinstance(node, ast.ImportFrom):
            target = _resolve(path, node)
            if target and target[0] == "torch":
                if any(_private(p) and p not in TORCH_PRIVATE for p in target):
                    found.append(f"from {'.'.join(target)} import ...")
                continue
            if target[:1] != ["attnkit"]:
                continue  # other libraries' names are their business (imported lazily)
            for i, part in enumerate(target):
                # a private module may be imported from inside its own package (its room), and the
                # package's top-level private modules (attnkit._checks, ...) from anywhere in it
                if _private(part) and i > 1 and here[:i] != target[:i]:
                    found.append(f"from {'.'.join(target)} import ...")
                    break
            for alias in node.names:
                top_level_module = target == ["attnkit"] and ((SRC / alias.name).is_dir()
                                                           or (SRC / f"{alias.name}.py").is_file())
                if _private(alias.name) and target != here and not top_level_module:
                    found.append(f"from {'.'.join(target)} import {alias.name}")
    return found


def _all_reach_ins() -> set[tuple[str, str]]:
    out = set()
    for path in sorted(SRC.rglob("*.py")):
        rel = path.relative_to(SRC).as_posix()
        out.update((rel, what) for what in reach_ins(path))
    return out


def test_no_module_reads_another_modules_privates():
    found = _all_reach_ins()
    mine = sorted(f"{f}: {w}" for f, w in found if not f.startswith(_CORE))
    assert not mine, "private reach-ins (give the other side a public API):\n" + "\n".join(mine)


def test_known_reach_ins_in_the_lead_files_only_shrink():
    found = {(f, w) for f, w in _all_reach_ins() if f.startswith(_CORE)}
    new, gone = sorted(found - KNOWN), sorted(KNOWN - found)
    assert not new, "new private reach-ins:\n" + "\n".join(f"{f}: {w}" for f, w in new)
    assert not gone, "fixed: remove these from KNOWN:\n" + "\n".join(f"{f}: {w}" for f, w in gone)


def test_the_checker_sees_a_reach_in():
    """The rule itself: a private attribute of another object, a private name and a private
    module of another room are found; self's, the file's own and torch's allowed ones are not."""
    probe = SRC / "caches" / "probe.py"  # never written: a path for resolving relative imports
    got = reach_ins(probe,
        "import torch\n"
        "from ..modules._fused import FusedLoadHook\n"
        "from .base import _private_helper\n"
        "_TABLE = {}\n"
        "class A:\n"
        "    def f(self, other):\n"
        "        torch._dynamo.is_compiling()\n"
        "        _TABLE._x\n"
        "        self._mine\n"
        "        super()._parent()\n"
        "        getattr(other, '_y')\n"
        "        return other.thing._z\n")
    assert got.count("other.thing._z") == 1 and "getattr(other, '_y')" in got
    assert "from attnkit.modules._fused import ..." in got
    assert "from attnkit.caches.base import _private_helper" in got
    assert len(got) == 4, got


# ---------------------------------------------------------------------------- the import graph

BACKENDS = SRC / "backends"
#: Modules of ``attnkit.backends`` that are no backend: the registry, the neutral shared room, and
#: the package face that registers every backend.
NEUTRAL_BACKEND_MODULES = {"__init__", "registry", "common"}
#: Deprecated import paths that re-export a backend package under its old name: part of it.
DEPRECATED_BACKEND_PATHS = {"cpu_splitk": "decode", "triton_splitk": "triton"}


def _module_name(path: Path) -> str:
    return ".".join(_module_parts(path))


def _is_module(parts: list[str]) -> bool:
    """Whether ``parts`` (absolute, starting with "attnkit") name a module or package of src."""
    if parts[:1] != ["attnkit"]:
        return False
    base = SRC.joinpath(*parts[1:])
    return base.with_suffix(".py").is_file() or (base / "__init__.py").is_file()


def imported_modules(path: Path, text: str | None = None) -> set[str]:
    """The modules of ``attnkit`` that ``path`` imports anywhere: at the top level, inside
    functions and under ``if TYPE_CHECKING`` (two modules that name each other's types are one
    circle of rooms too). ``from pkg import name`` imports the submodule ``pkg.name`` when there is
    one, else the package ``pkg`` itself; relative imports are resolved from the file's package."""
    tree = ast.parse(path.read_text() if text is None else text, filename=str(path))
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                parts = alias.name.split(".")
                if _is_module(parts):
                    out.add(".".join(parts))
        elif isinstance(node, ast.ImportFrom):
            target = _resolve(path, node)
            if target[:1] != ["attnkit"]:
                continue
            for alias in node.names:
                sub = target + [alias.name]
                out.add(".".join(sub) if _is_module(sub) else ".".join(target))
    return out


def import_graph() -> dict[str, set[str]]:
    """Module -> the attnkit modules it imports, over every file of ``src/attnkit``."""
    return {_module_name(p): imported_modules(p) - {_module_name(p)} for p in sorted(SRC.rglob("*.py"))}


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle (a list of modules, the first repeated at the end) for each strongly connected
    set of modules that import each other, directly or through others (Tarjan's algorithm)."""
    index, low, on_stack, stack, sccs = {}, {}, set(), [], []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            scc = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                scc.append(w)
                if w == v:
                    break
            if len(scc) > 1:
                sccs.append(sorted(scc))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    cycles = []
    for scc in sccs:  # a shortest way back to the first module, through the set only
        members, start = set(scc), scc[0]
        prev, frontier = {start: None}, [start]
        while frontier and start not in [w for v in frontier for w in graph[v]]:
            nxt = []
            for v in frontier:
                for w in sorted(graph[v] & members):
                    if w not in prev:
                        prev[w] = v
                        nxt.append(w)
            frontier = nxt
        last = next(v for v in frontier if start in graph[v])
        path = [last]
        while prev[path[-1]] is not None:
            path.append(prev[path[-1]])
        cycles.append(list(reversed(path)) + [start])
    return cycles


def _backend_unit(module: str) -> str | None:
    """The backend a module of ``attnkit.backends`` belongs to (its file or package under
    backends/), or None for the neutral modules and for modules outside backends/."""
    parts = module.split(".")
    if parts[:2] != ["attnkit", "backends"]:
        return None
    unit = parts[2] if len(parts) > 2 else "__init__"
    unit = DEPRECATED_BACKEND_PATHS.get(unit, unit)
    return None if unit in NEUTRAL_BACKEND_MODULES else unit


def backend_cross_imports(graph: dict[str, set[str]]) -> list[str]:
    """"a -> b" for every module of one backend that imports a module of another backend, or the
    ``attnkit.backends`` package (which imports them all)."""
    found = []
    for module, targets in sorted(graph.items()):
        unit = _backend_unit(module)
        if unit is None:
            continue
        for t in sorted(targets):
            other = _backend_unit(t)
            if t == "attnkit.backends" or (other is not None and other != unit):
                found.append(f"{module} -> {t}")
    return found


def test_no_backend_imports_another():
    """A backend (a file or package under backends/) imports only the registry, the neutral
    ``backends.common`` and rooms outside backends/: what two backends share lives in common."""
    found = backend_cross_imports(import_graph())
    assert not found, "backends importing other backends (move the shared piece to backends/common.py):\n" + \
        "\n".join(found)


def test_no_import_cycles_among_modules():
    """No module of attnkit imports itself back through others, counting imports inside
    functions and for type checking too (a lazy import that closes a circle still ties the two
    rooms together)."""
    cycles = import_cycles(import_graph())
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(c) for c in cycles)


def test_the_import_checkers_see_a_cycle_and_a_backend_import():
    """The rules themselves: ``from . import x`` names the submodule x, ``from .. import y`` a
    name of the package (the package itself), imports in functions and for type checking count;
    a cycle through three modules is reported as one;
    a backend importing another backend's package or module is found, one importing the
    registry or common is not."""
    probe = SRC / "backends" / "decode" / "probe.py"  # never written: a path for resolving imports
    got = imported_modules(probe, "from . import splitk\nfrom .. import common, registry\n"
                                  "def f():\n    from ..sdpa import sinks_refusals\n"
                                  "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from ..flex import x\n")
    assert got == {"attnkit.backends.decode.splitk", "attnkit.backends.common", "attnkit.backends.registry",
                   "attnkit.backends.sdpa", "attnkit.backends.flex"}, got
    assert imported_modules(probe, "from ... import native, masks\nfrom ...masks import Mask\n") == {
        "attnkit.native", "attnkit.masks"}
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set(), "e": {"e"}}
    assert import_cycles(graph) == [["a", "b", "c", "a"]]
    graph = {"attnkit.backends.decode.backend": {"attnkit.backends.common", "attnkit.backends.registry",
                                                 "attnkit.backends.sdpa"},
             "attnkit.backends.triton.backend": {"attnkit.backends.decode", "attnkit.backends.triton.limits"},
             "attnkit.backends.cpu_splitk": {"attnkit.backends.decode.backend"}}
    assert backend_cross_imports(graph) == ["attnkit.backends.decode.backend -> attnkit.backends.sdpa",
                                            "attnkit.backends.triton.backend -> attnkit.backends.decode"]
