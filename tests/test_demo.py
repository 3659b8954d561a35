"""`attnkit demo`: the quick run completes and writes every file it promises; bad options, an
existing folder, a missing matplotlib and Ctrl-C leave clear errors and no half-written report."""

from __future__ import annotations

import importlib.util
import json

import pytest
import torch

import attnkit.demo as demo
from attnkit.cli import main

PNG = b"\x89PNG\r\n\x1a\n"
HAS_MPL = importlib.util.find_spec("matplotlib") is not None


def _leftovers(folder):
    return [p.name for p in folder.iterdir() if ".partial-" in p.name or ".old-" in p.name]


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("demo")
    out = root / "report"
    args = ["demo", "--quick", "--out", str(out)] + ([] if HAS_MPL else ["--no-figures"])
    rc = main(args)
    return rc, root, out


def test_quick_demo_writes_every_promised_file(quick_run, capsys):
    rc, root, out = quick_run
    assert rc == 0
    report = json.loads((out / "report.json").read_text())
    promised = report["files"]
    assert set(demo.REPORT_FILES) <= set(promised)
    if HAS_MPL:
        assert set(demo.FIGURES) <= set(promised)
    assert sorted(p.name for p in out.iterdir()) == sorted(promised)  # exactly what it promises
    for name in promised:
        data = (out / name).read_bytes()
        assert len(data) > 100, name
        if name.endswith(".png"):
            assert data.startswith(PNG), name
    assert _leftovers(root) == []


def test_quick_demo_report_contents(quick_run):
    _, _, out = quick_run
    report = json.loads((out / "report.json").read_text())
    rows = {r["variant"]: r for r in report["results"]}
    assert list(rows) == ["mha", "gqa", "mqa", "mla"]
    params = [r["params"] for r in rows.values()]
    assert max(params) - min(params) <= 3 * 64 * 2  # matched budgets: within one MLP column
    # KV bytes per token follow the variants: MHA 4 heads, GQA 2, MQA 1 (x 2 layers x (K + V) x 16 dims x 4 B).
    assert [rows[v]["kv_bytes_per_token"] for v in ("mha", "gqa", "mqa")] == [1024, 512, 256]
    assert rows["mla"]["kv_bytes_per_token"] == 2 * (32 + 8) * 4
    for r in rows.values():
        assert 0.0 <= r["accuracy"] <= 1.0 and r["accuracy_at"][str(report["plan"]["task"]["num_pairs"])] == r["accuracy"]
        assert r["prefill_ms"] > 0 and r["decode_tok_s"] > 0 and len(r["losses"]) == report["plan"]["steps"]
        assert r["losses"][-1] < r["losses"][0]  # it learned something
        h = r["retrieval_head"]
        assert 0 <= h["layer"] < 2 and 0 <= h["head"] < 4 and 0.0 <= h["score"] <= 1.0
    # An int8 KV cache per variant: one byte per value plus an fp32 scale per row (K and V per KV
    # head; MLA's latent: one), over 2 layers.
    assert [rows[v]["quantized_kv"]["kv_bytes_per_token"] for v in ("mha", "gqa", "mqa")] == [320, 160, 80]
    assert rows["mla"]["quantized_kv"]["kv_bytes_per_token"] == 2 * (32 + 8 + 4)
    for r in rows.values():
        qr = r["quantized_kv"]
        assert qr["kv_dtype"] == "int8" and qr["decode_tok_s"] > 0
        assert set(qr["accuracy_at"]) == set(r["accuracy_at"]) and all(0 <= a <= 1 for a in qr["accuracy_at"].values())
    md = (out / "report.md").read_text()
    assert "| MHA | 4 |" in md and "| MLA | latent 32 |" in md and "Reading it" in md
    assert "| MHA, int8 KV | 4 |" in md and "An int8 KV cache" in md


def test_same_seed_same_training(tmp_path):
    runs = []
    for i in range(2):
        out = tmp_path / f"r{i}"
        assert main(["demo", "--quick", "--steps", "12", "--variants", "gqa", "--no-figures", "--out", str(out)]) == 0
        runs.append(json.loads((out / "report.json").read_text())["results"][0])
    assert runs[0]["losses"] == runs[1]["losses"] and runs[0]["accuracy_at"] == runs[1]["accuracy_at"]


def test_mqar_examples_are_answerable_only_from_context():
    task = demo.Task(num_keys=16, num_values=16, num_pairs=5, num_queries=2)
    ids, targets = demo.make_mqar(task, 64, torch.Generator().manual_seed(0))
    assert ids.shape == (64, task.seq_len) and (ids[:, 0] == task.BOS).all() and (ids[:, 11] == task.SEP).all()
    for x, y in zip(ids.tolist(), targets.tolist()):
        keys, vals = x[1:11:2], x[2:11:2]
        assert len(set(keys)) == 5 and all(2 <= k < 18 for k in keys) and all(18 <= v < 34 for v in vals)
        for t in range(12, len(x), 2):  # each query's target is its key's value in the context
            assert y[t] == vals[keys.index(x[t])] == x[t + 1]
        assert [t for t, v in enumerate(y) if v != -100] == [12, 14]
    assert demo.curriculum(task, 0, 100) == (2, 1) and demo.curriculum(task, 99, 100) == (5, 2)


@pytest.mark.parametrize("argv,msg", [
    (["--variants", "mha,flash"], "--variants must be a comma-separated subset"),
    (["--steps", "0"], "--steps must be >= 1"),
    (["--threads", "0"], "--threads must be >= 1"),
    (["--pairs", "0"], "--pairs must be >= 1"),
])
def test_bad_options_are_clear_errors(tmp_path, capsys, argv, msg):
    assert main(["demo", "--quick", "--out", str(tmp_path / "x"), *argv]) == 2
    assert msg in capsys.readouterr().err
    assert not (tmp_path / "x").exists() and _leftovers(tmp_path) == []


def test_existing_out_needs_force(tmp_path, capsys):
    out = tmp_path / "taken"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    assert main(["demo", "--quick", "--out", str(out)]) == 2
    assert "already exists" in capsys.readouterr().err and (out / "keep.txt").read_text() == "mine"
    assert main(["demo", "--quick", "--steps", "2", "--variants", "mqa", "--no-figures", "--force",
                 "--out", str(out)]) == 0
    assert not (out / "keep.txt").exists() and (out / "report.md").is_file() and _leftovers(tmp_path) == []


def test_missing_matplotlib_is_named(tmp_path, capsys, monkeypatch):
    import attnkit.viz

    def missing():
        raise ImportError("attnkit.viz draws with matplotlib, which is not installed: pip install 'attnkit[viz]'")
    monkeypatch.setattr(attnkit.viz, "require_matplotlib", missing)
    assert main(["demo", "--quick", "--out", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err
    assert "attnkit[viz]" in err and "--no-figures" in err and not (tmp_path / "x").exists()


def test_ctrl_c_leaves_no_half_written_report(tmp_path, capsys, monkeypatch):
    def interrupted(*a, **k):
        raise KeyboardInterrupt
    monkeypatch.setattr(demo, "measure_speed", interrupted)
    out = tmp_path / "never"
    assert main(["demo", "--quick", "--steps", "2", "--variants", "mha", "--out", str(out)]) == 130
    assert "interrupted" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []  # neither the report nor its partial folder
