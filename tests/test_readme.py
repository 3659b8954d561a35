"""The README's quickstart runs as written, in the environment either README command creates, and
prints what it computes; its two commands are what CI runs (so the front page never lies)."""

from __future__ import annotations

import re
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"


def _blocks(lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", README.read_text(), flags=re.S)


@pytest.fixture(scope="module")
def quickstart() -> dict:
    blocks = _blocks("python")
    assert blocks, "README has no python example"
    ns: dict = {}
    for i, block in enumerate(blocks):  # every example, in order, in one namespace
        exec(compile(block, f"README.md[block {i}]", "exec"), ns)
    return ns


def test_readme_quickstart_runs(quickstart):
    ns = quickstart
    assert ns["out"].shape == (2, 32, 1, 128)
    assert ns["w"].shape == (2, 32, 1, 4096)
    assert (ns["w"][1, :, :, 1000:] == 0).all()  # padded keys get no weight
    assert ns["y_next"].shape == (1, 1, 256)
    assert [len(t) for t in ns["gen"].tokens] == [8, 8]
    assert ns["hf_out"].shape == (1, 7)
    assert ns["y_tf"].shape == (2, 7, 64)
    import attnkit
    mhas = [m for m in ns["net"].modules() if isinstance(m, torch.nn.MultiheadAttention)]
    assert mhas and all(isinstance(m, attnkit.nn.MultiheadAttention) for m in mhas)


def test_readme_example_takes_the_path_it_claims(quickstart):
    ns = quickstart
    assert "'decode' runs it" in _blocks("python")[0]
    import attnkit
    from attnkit import native
    # Without the compiled kernel, auto leaves decode to SDPA (docs/masks.md, "Which kernel ran").
    want = "sdpa" if native.implementation(build=False) == "torch" else "decode"
    assert attnkit.describe_call(ns["q"], ns["k"], ns["v"], causal=True) == want


def _commands() -> list[str]:
    return [line.split("#")[0].strip() for block in _blocks("bash") for line in block.splitlines()]


def test_readme_commands_are_what_ci_runs():
    """The test command is .ci/run's, character for character (less pip's -q); the main job's
    command is the demo."""
    ci = (ROOT / ".ci" / "run").read_text()
    ci_test = next(line for line in ci.splitlines() if "python -m pytest" in line and not line.startswith("#"))
    ci_test = ci_test.replace(" -q", "").strip()
    commands = _commands()
    assert ci_test in commands, f"README's test command differs from .ci/run's: {ci_test!r}"
    assert 'pip install torch==2.13.0 && pip install -e ".[viz,hf]" && attnkit demo' in commands
    assert "attnkit demo --quick" in ci  # the main job's quick mode is smoke-tested by CI


def test_readme_stays_a_front_door():
    text = README.read_text()
    assert len(text.encode()) <= 12_000, f"README is {len(text.encode())} bytes: move detail to docs/"
    quick = _blocks("python")
    assert sum(len(b.splitlines()) for b in quick) <= 40, "the quickstart is at most 40 lines"
    rows = [line for line in text.splitlines() if line.startswith("|")]
    assert len(rows) <= 40, "timing tables belong in benchmarks/README.md"


# What a fresh virtual environment holds before either command runs.
_VENV_BASE = {"pip", "setuptools", "wheel"}


def _installed_by(extras: list[str]) -> set[str]:
    """The distributions `pip install -e ".[extras]"` brings in: attnkit with those extras and
    everything they require, transitively, as installed here."""
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    seen: set[str] = set()
    todo = [("attnkit", set(extras))]
    while todo:
        name, wanted = todo.pop()
        key = canonicalize_name(name)
        if key in seen:
            continue
        seen.add(key)
        try:
            requires = metadata.distribution(name).requires or []
        except metadata.PackageNotFoundError:
            continue
        envs = [{"extra": e} for e in wanted] or [{"extra": ""}]
        for line in requires:
            req = Requirement(line)
            if req.marker is None or any(req.marker.evaluate(env) for env in envs):
                todo.append((req.name, set(req.extras)))
    return seen | {canonicalize_name(n) for n in _VENV_BASE}


def _absent_modules(extras: list[str]) -> set[str]:
    """Top-level modules installed here that the command with these extras would not install."""
    from packaging.utils import canonicalize_name

    keep = _installed_by(extras)
    return {mod for mod, dists in metadata.packages_distributions().items()
            if mod not in sys.stdlib_module_names and not mod.startswith("__editable__")
            and not any(canonicalize_name(d) in keep for d in dists)}


# Run first in the Quickstart's process: every import finder answers "not found" for those modules,
# as in an environment where they were never installed (importlib.util.find_spec gives None).
_HIDE = """
import sys
ABSENT = {absent!r}
class _NotInstalled:
    def __init__(self, finder):
        self.finder = finder
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in ABSENT:
            return None
        return self.finder.find_spec(name, path, target)
    def __getattr__(self, attr):
        return getattr(self.finder, attr)
sys.meta_path[:] = [_NotInstalled(f) for f in sys.meta_path]
"""


@pytest.mark.parametrize("job", ["main job", "tests"])
def test_readme_quickstart_runs_after_either_command_and_prints_its_results(job):
    """The Quickstart runs in a fresh process where only what the README's command installs can be
    imported (the main job's extras lack the test extra's tools, and the other way round), and
    prints each result."""
    command = next(c for c in _commands() if c.endswith("attnkit demo" if job == "main job" else "pytest"))
    extras = re.search(r'pip install -e "\.\[([\w,]+)\]"', command).group(1).split(",")
    absent = _absent_modules(extras)
    if job == "main job":
        assert {"pytest", "hypothesis"} <= absent  # the check hides something real
    source = _HIDE.format(absent=sorted(absent)) + _blocks("python")[0]
    run = subprocess.run([sys.executable, "-c", source], capture_output=True, text=True, timeout=600,
                         cwd=ROOT)
    assert run.returncode == 0, f"the Quickstart fails after `{command}`:\n{run.stdout}\n{run.stderr[-3000:]}"
    printed = [r"attention: \(2, 32, 1, 128\) ran on \w+",
               r"weight on sequence 1's padded keys: 0\.0",
               r"cached decode = one full forward: True",
               r"generated: \[\[(\d+, ){7}\d+\], \[(\d+, ){7}\d+\]\]",
               r"transformers with attnkit: \[\[1, 2, 3(, \d+){4}\]\]",
               r"torch\.nn\.Transformer with attnkit: \(2, 7, 64\)"]
    for line in printed:
        assert re.search(line, run.stdout), f"the Quickstart does not print {line!r}:\n{run.stdout}"
