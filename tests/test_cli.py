"""The `attnkit` command."""

from __future__ import annotations

import subprocess
import sys

from attnkit.cli import main


def test_info_lists_versions_and_backends(capsys):
    assert main(["info"]) == 0
    out = capsys.readouterr().out
    import attnkit
    import torch
    assert f"attnkit {attnkit.__version__}" in out and torch.__version__ in out
    for name in ("math", "sdpa", "decode", "flex"):
        assert f"  {name}" in out
    assert "auto order: decode > sdpa > math" in out


def test_no_command_prints_help_and_fails(capsys):
    assert main([]) == 2
    assert "info" in capsys.readouterr().out


def test_module_entry_point_runs():
    res = subprocess.run([sys.executable, "-m", "attnkit", "info"], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0 and "backends" in res.stdout
