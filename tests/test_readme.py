"""The README's quickstart runs as written, and its two commands are what CI runs (so the front
page never lies)."""

from __future__ import annotations

import re
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
    want = "sdpa" if native.engine(build=False) == "torch" else "decode"
    assert attnkit.describe_call(ns["q"], ns["k"], ns["v"], causal=True) == want


def test_readme_commands_are_what_ci_runs():
    """The test command is .ci/run's, character for character (less pip's -q); the main job's
    command is the demo."""
    ci = (ROOT / ".ci" / "run").read_text()
    ci_test = next(line for line in ci.splitlines() if "python -m pytest" in line and not line.startswith("#"))
    ci_test = ci_test.replace(" -q", "").strip()
    commands = [line.split("#")[0].strip() for block in _blocks("bash") for line in block.splitlines()]
    assert ci_test in commands, f"README's test command differs from .ci/run's: {ci_test!r}"
    assert 'pip install torch==2.13.0 && pip install -e ".[viz]" && attnkit demo' in commands
    assert "attnkit demo --quick" in ci  # the main job's quick mode is smoke-tested by CI


def test_readme_stays_a_front_door():
    text = README.read_text()
    assert len(text.encode()) <= 12_000, f"README is {len(text.encode())} bytes: move detail to docs/"
    quick = _blocks("python")
    assert sum(len(b.splitlines()) for b in quick) <= 40, "the quickstart is at most 40 lines"
    rows = [line for line in text.splitlines() if line.startswith("|")]
    assert len(rows) <= 40, "timing tables belong in benchmarks/README.md"
