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

torch's own privates are allowed through :data:`TORCH_PRIVATE`, each with its reason. The files
the lead is reworking may still reach in: :data:`KNOWN` lists exactly what they do today, so the
list can only shrink (a stale entry fails as well as a new reach-in).
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

#: Reach-ins in the files the lead owns (backends/, functional.py, masks.py, reference.py,
#: rope/), as (file under src/attnkit, what is read). Every other file is clean; shrink this
#: list as those files gain public APIs.
KNOWN: set[tuple[str, str]] = {
    # Python's own private: the caller's frame, for naming where a native build was asked for
    ("native/__init__.py", "sys._getframe"),
    # torch's private aten ops (the fused CPU flash kernels SDPA uses), reached as ``aten._...``
    ("backends/sdpa.py", "aten._scaled_dot_product_flash_attention_for_cpu"),
    ("backends/sdpa.py", "aten._scaled_dot_product_flash_attention_for_cpu_backward"),
    # torch's private SDPA kernel chooser, probed by name
    ("backends/sdpa.py", "getattr(torch, '_fused_sdp_choice', None)"),
    # a tensor's private version counter (in-place change detection)
    ("masks.py", "t._version"),
    # a private table of a transformers config object
    ("rope/config.py", "getattr(config, '_rope_type_labels', None)"),
}

_LEAD_OWNED = ("backends/", "native/", "functional.py", "masks.py", "reference.py", "rope/")


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
    mine = sorted(f"{f}: {w}" for f, w in found if not f.startswith(_LEAD_OWNED))
    assert not mine, "private reach-ins (give the other side a public API):\n" + "\n".join(mine)


def test_known_reach_ins_in_the_lead_files_only_shrink():
    found = {(f, w) for f, w in _all_reach_ins() if f.startswith(_LEAD_OWNED)}
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
