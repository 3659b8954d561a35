"""The README's usage example runs as written (so the front page never lies)."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def test_readme_usage_example_runs():
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    assert blocks, "README has no python example"
    ns: dict = {}
    for i, block in enumerate(blocks):  # every example, in order, in one namespace
        if "attnkit.backends.triton.decode" in block and importlib.util.find_spec("triton") is None:
            continue  # the Triton example (runs wherever triton is installed: in the interpreter on CPU)
        exec(compile(block, f"README.md[block {i}]", "exec"), ns)
    assert ns["y_next"].shape == (1, 1, 256)
    assert ns["out"].shape == (2, 32, 1, 128)
    assert ns["w"].shape == (2, 32, 1, 4096)
    assert (ns["w"][1, :, :, 1000:] == 0).all()  # padded keys get no weight
    if "o_mla" in ns:
        assert ns["o_gqa"].shape == (2, 8, 1, 64) and ns["o_mla"].shape == (2, 16, 1, 512)


def test_readme_example_takes_the_path_it_claims():
    block = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)[0]
    assert "-> 'decode'" in block
    ns: dict = {}
    exec(compile(block, "README.md", "exec"), ns)
    import attnkit
    from attnkit.backends import decode, splitk
    # (without the compiled kernel, CPUs with bf16 matrix units leave bf16 decode to SDPA: the
    # README says so under the example)
    want = "sdpa" if splitk.engine_name() == "torch" and decode._bf16_matrix_isa() else "decode"
    assert attnkit.describe_call(ns["q"], ns["k"], ns["v"], causal=True) == want
