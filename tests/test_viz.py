"""attnkit.viz: every drawing writes a PNG; bad inputs and a missing matplotlib give clear errors."""

from __future__ import annotations

import json
import sys

import pytest
import torch

from attnkit import masks
from attnkit import viz

pytest.importorskip("matplotlib")
PNG = b"\x89PNG\r\n\x1a\n"


def _png(path):
    data = path.read_bytes()
    assert data.startswith(PNG) and len(data) > 500
    return data


def test_mask_examples_are_the_masks_they_name():
    ex = viz.mask_examples(12)
    causal, q, k, _ = ex["causal"]
    assert torch.equal(causal.materialize(1, q, k)[0, 0], torch.ones(12, 12, dtype=torch.bool).tril())
    win = ex["sliding_window"][0].materialize(1, 12, 12)[0, 0]
    assert win.sum(-1).tolist() == [1, 2, 3] + [4] * 9
    pad = ex["left_padded_causal"][0].materialize(1, 12, 12)[0, 0]
    assert not pad[:, :4].any() and pad[4:, 4:].equal(torch.ones(8, 8, dtype=torch.bool).tril())
    assert ex["causal_chunk"][1:3] == (4, 12)
    with pytest.raises(ValueError, match="size must be an int >= 8"):
        viz.mask_examples(4)


def test_mask_pictures(tmp_path):
    _png(viz.mask_gallery(tmp_path / "g.png"))
    _png(viz.plot_mask(masks.SlidingWindow(2) & masks.Causal(), 9, 9, path=tmp_path / "m.png"))
    _png(viz.plot_mask(masks.KeyPadding(torch.tensor([3, 5])), 4, 6, batch_index=1, path=tmp_path / "b.png"))
    with pytest.raises(TypeError, match="attnkit.masks.Mask"):
        viz.plot_mask(torch.ones(3, 3, dtype=torch.bool), 3, 3)
    with pytest.raises(ValueError, match="q_len must be a positive int"):
        viz.plot_mask(masks.Causal(), 0, 3)
    with pytest.raises(ValueError):  # the mask's own check: 2 lengths for a batch of 4
        viz.plot_mask(masks.KeyPadding(torch.tensor([3, 5])), 4, 6, batch_index=3)


def test_attention_maps(tmp_path):
    w = torch.rand(3, 5, 5).tril().softmax(-1)
    _png(viz.plot_attention(w, tmp_path / "a.png", tokens=list("abcde"), head_titles=["x", "y", "z"],
                            highlight=[(4, 1)], title="t"))
    _png(viz.plot_attention(w[0], tmp_path / "one.png"))
    with pytest.raises(ValueError, match=r"\(Sq, Sk\) or \(H, Sq, Sk\)"):
        viz.plot_attention(torch.rand(5), tmp_path / "x.png")
    with pytest.raises(ValueError, match="tokens has 2 labels for 5 keys"):
        viz.plot_attention(w, tmp_path / "x.png", tokens=["a", "b"])
    written = viz.plot_attention(w, tmp_path / "noext")  # the path returned is the file written
    assert written == tmp_path / "noext.png" and written.is_file()
    with pytest.raises(ValueError, match="is a folder"):
        viz.plot_attention(w, tmp_path)
    with pytest.raises(ValueError, match="image formats are"):
        viz.plot_attention(w, tmp_path / "x.bak")


def test_charts(tmp_path):
    _png(viz.plot_bars(["b1", "b8"], {"hf": [100, 700], "ours": [300, 2000]}, tmp_path / "bars.png", log=True))
    _png(viz.plot_scatter([(1, 0.5, "A"), (2, 0.9, "B")], tmp_path / "s.png"))
    _png(viz.plot_scatter([(1, 0.5, "A", "x"), (2, 0.9, "B", "x"), (1, 0.2, "A", "y")], tmp_path / "s2.png"))
    _png(viz.plot_lines({"a": [3, 2, 1, 0.5] * 10}, tmp_path / "l.png", smooth=4))
    with pytest.raises(ValueError, match="series 'hf' has 1 values for 2 groups"):
        viz.plot_bars(["b1", "b8"], {"hf": [1]}, tmp_path / "x.png")
    with pytest.raises(ValueError, match="at least one point"):
        viz.plot_scatter([], tmp_path / "x.png")


def test_scatter_labels_never_cover_each_other(tmp_path, monkeypatch):
    """Crowded and coinciding points (the demo's recall-1.0 row: MHA int8 and MLA at 320 bytes,
    MQA int8 and MLA int8 at 80 and 88): coinciding points of a series share one label, and no
    two labels overlap."""
    data = {"MHA": (1024, 320), "GQA": (512, 160), "MQA": (256, 80), "MLA": (320, 88)}
    points = []
    for series, recall in (("2 pairs", 1.0), ("4 pairs", 0.5), ("8 pairs", 0.25)):
        for v, (full, int8) in data.items():
            points += [(full, recall, v, series), (int8, recall, f"{v} int8", series)]
    boxes = []

    def keep_boxes(fig, path):
        renderer = fig.canvas.get_renderer()
        boxes.extend((t.get_text(), t.get_window_extent(renderer)) for t in fig.axes[0].texts)
        return save(fig, path)

    save = viz._save
    monkeypatch.setattr(viz, "_save", keep_boxes)
    _png(viz.plot_scatter(points, tmp_path / "crowded.png", ylim=(0, 1.08), logx=True))
    texts = [t for t, _ in boxes]
    assert texts.count("MHA int8 / MLA") == 3 and "MHA int8" not in texts and len(texts) == 3 * 7
    for i, (ta, a) in enumerate(boxes):
        for tb, b in boxes[i + 1:]:
            assert not a.overlaps(b), (ta, tb)


def test_plot_benchmark_from_a_result_table(tmp_path):
    res = {"rows": [{"case": "prefill", "dtype": "fp32", "attnkit_ms": 1.5, "hf_ms": 2.0},
                    {"case": "decode", "dtype": "fp32", "attnkit_ms": 0.2, "hf_ms": 0.9}]}
    (tmp_path / "t.json").write_text(json.dumps(res))
    assert _png(viz.plot_benchmark(tmp_path / "t.json")) and (tmp_path / "t.png").is_file()
    (tmp_path / "bad.json").write_text(json.dumps({"rows": [{"case": "x"}]}))
    with pytest.raises(ValueError, match="no numeric"):
        viz.plot_benchmark(tmp_path / "bad.json")


def test_benchmark_row_labels_name_what_is_measured():
    """Context lengths and shapes are in the labels, so rows that share a dtype stay apart."""
    assert viz._row_label({"dtype": "bf16", "context": 1024, "absorbed_layer_ms": 1.0}) == "bf16 · context 1024"
    assert viz._row_label({"case": "prefill causal", "shape": "B1 H8 S512 D64", "dtype": "fp32", "backend": "sdpa",
                           "best_eager": "x"}) == "prefill causal\nB1 H8 S512 D64 · fp32 · backend: sdpa"
    assert viz._row_label({"S": 4096, "single_backend": "sdpa"}) == "S=4096"
    assert viz._metric("ring2_s") == (0, 1e3, "ring P=2") and viz._metric("hf_tok_s")[0] == 1
    assert viz._metric("ring2_cpu_s") is None and viz._metric("speedup") is None


def test_plot_benchmark_every_table_kind(tmp_path):
    """Named tables (the gpu suite), seconds and memory columns (ring), missing values (n/a)."""
    res = {"machine": {"cpu": "Test CPU", "isa": "AVX2", "cores": 2, "torch_threads": 2, "torch": "2"},
           "quick": True, "shape": {"B": 1, "H": 8},
           "prefill": [{"shape": "B2 H8 S256 D64", "dtype": "bf16", "attnkit_ms": 1.0, "sdpa_flash_ms": None}],
           "paged_decode": [{"batch": 32, "context": 32768, "paged_ms": 2.0, "paged_GBps": 900.0}],
           "rows": [{"S": 1024, "single_s": 0.08, "ring2_s": 0.07, "single_peak_MiB": 16.0, "ring4_s": None}],
           "memory": {"n_seq": 8, "block_size": 16, "paged_bytes": 5603328, "contiguous_bytes": 7946240}}
    (tmp_path / "gpu_quick.json").write_text(json.dumps(res))
    _png(viz.plot_benchmark(tmp_path / "gpu_quick.json"))
    assert [t for t, _ in viz._tables(res)] == ["prefill", "paged decode", "", "memory"]  # not machine / shape
    assert "Test CPU, AVX2" in viz._context_line(res, "gpu") and "--quick" in viz._context_line(res, "gpu")


def test_without_matplotlib_the_error_says_how_to_install(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    with pytest.raises(ImportError, match=r"pip install 'attnkit\[viz\]'"):
        viz.mask_gallery(tmp_path / "g.png")
    assert not (tmp_path / "g.png").exists()
