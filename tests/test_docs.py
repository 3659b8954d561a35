"""Every python block of docs/*.md runs, in order, in one namespace per page."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

DOCS = sorted((Path(__file__).resolve().parents[1] / "docs").glob("*.md"))


@pytest.mark.parametrize("page", DOCS, ids=[p.name for p in DOCS])
def test_doc_page_code_runs(page):
    blocks = re.findall(r"```python\n(.*?)```", page.read_text(), flags=re.S)
    assert blocks, f"{page.name} has no python blocks"
    ns: dict = {}
    for i, block in enumerate(blocks):
        exec(compile(block, f"{page.name}[block {i}]", "exec"), ns)
