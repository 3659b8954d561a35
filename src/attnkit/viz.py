"""Pictures of attention: mask patterns, attention maps, and the charts of the demo and the
benchmarks, written to PNG with matplotlib (the ``viz`` extra: ``pip install 'attnkit[viz]'``).

matplotlib is imported when a function draws, never at ``import attnkit.viz``; without it every
drawing function raises ImportError saying how to install it. Figures use the non-interactive
Agg canvas (no display needed) and are closed after saving.

    >>> from attnkit import masks
    >>> from attnkit.viz import plot_mask, mask_gallery           # doctest: +SKIP
    >>> plot_mask(masks.SlidingWindow(3), 12, 12, path="window.png")  # doctest: +SKIP
    >>> mask_gallery("masks.png")                                  # doctest: +SKIP
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Mapping, Sequence

import torch
from torch import Tensor

from ._checks import shape_of
from . import masks as M

__all__ = ["require_matplotlib", "mask_examples", "plot_mask", "mask_gallery", "plot_attention", "plot_bars",
           "plot_scatter", "plot_lines", "plot_benchmark"]

_INSTALL = "pip install 'attnkit[viz]'  (or: pip install matplotlib)"


def require_matplotlib():
    """``matplotlib.pyplot`` on the Agg canvas, or ImportError naming the install command."""
    try:
        import matplotlib
    except ImportError:
        raise ImportError(f"attnkit.viz draws with matplotlib, which is not installed: {_INSTALL}") from None
    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt
    return plt


def _save(fig, path) -> Path:
    """Write ``fig`` to ``path`` (".png" added when it has no suffix); returns the file written."""
    plt = require_matplotlib()
    path = Path(path)
    if path.is_dir():
        plt.close(fig)
        raise ValueError(f"{path} is a folder; give a file name (e.g. {path / 'attention.png'})")
    if not path.suffix:
        path = path.with_suffix(".png")
    kinds = fig.canvas.get_supported_filetypes()
    if path.suffix[1:].lower() not in kinds:
        plt.close(fig)
        raise ValueError(f"cannot write {path}: image formats are {', '.join(sorted(kinds))}")
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return path


# ---------------------------------------------------------------------------- masks


def mask_examples(size: int = 16) -> dict[str, tuple[M.Mask, int, int, str]]:
    """The mask kinds of the gallery: name -> (mask, Sq, Sk, one-line meaning), at ``size``."""
    if not isinstance(size, int) or size < 8:
        raise ValueError(f"size must be an int >= 8, got {size!r}")
    n, q = size, max(2, size // 3)
    docs = [n // 3, n // 3, n - 2 * (n // 3)]
    return {
        "causal": (M.Causal(), n, n, "Causal(): each token sees itself and the past"),
        "causal_chunk": (M.Causal(), q, n, f"Causal(), Sq={q} < Sk={n}: bottom-right (chunked prefill, decode)"),
        "causal_top_left": (M.Causal("top_left"), q, n, "Causal('top_left'): torch's is_causal"),
        "sliding_window": (M.SlidingWindow(3), n, n, "SlidingWindow(3): the last 4 tokens (Mistral-style)"),
        "local_bidirectional": (M.SlidingWindow(2, 2), n, n, "SlidingWindow(2, 2): a band, both directions"),
        "prefix_lm": (M.PrefixLM(n // 3), n, n, f"PrefixLM({n // 3}): bidirectional prefix, causal after"),
        "document_causal": (M.Document(docs) & M.Causal(), n, n, f"Document({docs}) & Causal(): packed sequences"),
        "left_padded_causal": (M.KeyPadding(torch.tensor([n - 4]), side="left") & M.Causal(), n, n,
                               "KeyPadding(side='left') & Causal(): 4 padding keys ignored"),
    }


def _draw_mask(ax, mask: M.Mask, q_len: int, kv_len: int, batch_index: int, title: str | None):
    allowed = mask.materialize(max(batch_index + 1, 1), q_len, kv_len)
    grid = allowed[min(batch_index, allowed.shape[0] - 1), 0].float().numpy()
    ax.imshow(grid, cmap="Blues", vmin=0, vmax=1.25, interpolation="nearest", aspect="auto")
    ax.set_xticks([])
    ax.set_yticks([])
    ax.set_xlabel(f"key (Sk={kv_len})", fontsize=7)
    ax.set_ylabel(f"query (Sq={q_len})", fontsize=7)
    if title:
        ax.set_title(title, fontsize=8)


def plot_mask(mask: M.Mask, q_len: int, kv_len: int, *, batch_index: int = 0, title: str | None = None,
              path=None, ax=None):
    """Draw which keys each query may attend to (dark = attend) for a (Sq, Sk) call; saves to
    ``path`` when given (returns it), else draws on ``ax`` (or a new figure) and returns the axes."""
    if not isinstance(mask, M.Mask):
        raise TypeError(f"mask must be an attnkit.masks.Mask, got {type(mask).__name__}")
    for name, v in (("q_len", q_len), ("kv_len", kv_len)):
        if not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be a positive int, got {v!r}")
    mask.check(batch_index + 1, 1, q_len, kv_len)
    plt = require_matplotlib()
    fig = None
    if ax is None:
        fig, ax = plt.subplots(figsize=(3.2, 3.2 * min(max(q_len / kv_len, 0.3), 1.5)))
    _draw_mask(ax, mask, q_len, kv_len, batch_index, title if title is not None else repr(mask))
    if path is not None:
        return _save(ax.figure, path)
    return ax


def mask_gallery(path, *, size: int = 16) -> Path:
    """One PNG with every kind of :func:`mask_examples`, titled with its meaning."""
    ex = mask_examples(size)
    plt = require_matplotlib()
    cols = 4
    rows = math.ceil(len(ex) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(3.3 * cols, 3.3 * rows))
    for ax, (name, (mask, q, k, meaning)) in zip(axes.flat, ex.items()):
        _draw_mask(ax, mask, q, k, 0, meaning.replace(": ", ":\n", 1))
    for ax in list(axes.flat)[len(ex):]:
        ax.axis("off")
    fig.suptitle("attnkit.masks (dark = may attend)", fontsize=11)
    fig.tight_layout()
    return _save(fig, path)


# ---------------------------------------------------------------------------- attention maps


def plot_attention(weights: Tensor, path, *, tokens: Sequence[str] | None = None, title: str | None = None,
                   head_titles: Sequence[str] | None = None, highlight: Sequence[tuple[int, int]] = ()) -> Path:
    """Attention maps as heatmaps: ``weights`` (Sq, Sk) for one map or (H, Sq, Sk) for a grid of
    heads (rows are queries, columns keys; each row sums to 1). ``tokens`` labels the axes when
    Sq == Sk (self-attention); ``highlight`` marks (query, key) cells with a red outline."""
    if not isinstance(weights, Tensor) or weights.dim() not in (2, 3):
        raise ValueError(f"weights must be a (Sq, Sk) or (H, Sq, Sk) tensor, got shape "
                         f"{shape_of(weights)}")
    w = weights.detach().float().cpu()
    w = w[None] if w.dim() == 2 else w
    H, Sq, Sk = w.shape
    if tokens is not None and len(tokens) != Sk:
        raise ValueError(f"tokens has {len(tokens)} labels for {Sk} keys")
    if head_titles is not None and len(head_titles) != H:
        raise ValueError(f"head_titles has {len(head_titles)} entries for {H} heads")
    plt = require_matplotlib()
    cols = min(H, 4)
    rows = math.ceil(H / cols)
    side = 2.2 + 0.12 * min(max(Sq, Sk), 48)
    fig, axes = plt.subplots(rows, cols, figsize=(side * cols, side * rows), squeeze=False)
    for h, ax in enumerate(axes.flat):
        if h >= H:
            ax.axis("off")
            continue
        im = ax.imshow(w[h].numpy(), cmap="viridis", vmin=0, vmax=max(float(w[h].max()), 1e-6),
                       interpolation="nearest", aspect="auto")
        for qi, kj in highlight:
            ax.add_patch(plt.Rectangle((kj - 0.5, qi - 0.5), 1, 1, fill=False, edgecolor="red", linewidth=1.2))
        if tokens is not None and Sk <= 64:
            ax.set_xticks(range(Sk))
            ax.set_xticklabels(tokens, rotation=90, fontsize=6)
            if Sq == Sk:
                ax.set_yticks(range(Sq))
                ax.set_yticklabels(tokens, fontsize=6)
        ax.set_xlabel("key", fontsize=8)
        ax.set_ylabel("query", fontsize=8)
        if head_titles is not None:
            ax.set_title(head_titles[h], fontsize=9)
        fig.colorbar(im, ax=ax, fraction=0.046, pad=0.04)
    if title:
        fig.suptitle(title, fontsize=11)
    fig.tight_layout()
    return _save(fig, path)


# ---------------------------------------------------------------------------- charts


def plot_bars(groups: Sequence[str], series: Mapping[str, Sequence[float]], path, *, ylabel: str = "",
              title: str = "", log: bool = False, fmt: str = "{:.0f}") -> Path:
    """Grouped bar chart: one group per entry of ``groups``, one bar per series, values printed
    on the bars."""
    if not groups or not series:
        raise ValueError("plot_bars needs at least one group and one series")
    for name, vals in series.items():
        if len(vals) != len(groups):
            raise ValueError(f"series {name!r} has {len(vals)} values for {len(groups)} groups")
    plt = require_matplotlib()
    n = len(series)
    width = 0.8 / n
    fig, ax = plt.subplots(figsize=(max(5.0, 1.1 * len(groups) * n + 2), 3.8))
    for i, (name, vals) in enumerate(series.items()):
        xs = [g + (i - (n - 1) / 2) * width for g in range(len(groups))]
        bars = ax.bar(xs, vals, width, label=name)
        for b, v in zip(bars, vals):
            if v and math.isfinite(v):
                ax.annotate(fmt.format(v), (b.get_x() + b.get_width() / 2, b.get_height()), ha="center",
                            va="bottom", fontsize=7)
    ax.set_xticks(range(len(groups)))
    ax.set_xticklabels(groups)
    ax.set_ylabel(ylabel)
    if log:
        ax.set_yscale("log")
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=8)
    ax.grid(axis="y", alpha=0.3)
    return _save(fig, path)


def plot_scatter(points: Sequence[tuple], path, *, xlabel: str = "", ylabel: str = "", title: str = "",
                 logx: bool = False, ylim: tuple[float, float] | None = None) -> Path:
    """Labelled points ``(x, y, label)``, e.g. accuracy against KV-cache bytes per token; with a
    fourth entry ``(x, y, label, series)`` points are coloured by series (with a legend beside the
    axes) and the points of one label are joined across series.

    Labels never cover one another: points of a series that coincide share one label ("MHA int8 /
    MLA"), and each label takes the first place around its point where it overlaps no label,
    point or the axes' edge (:func:`_place_labels`)."""
    if not points:
        raise ValueError("plot_scatter needs at least one point")
    if any(len(p) not in (3, 4) for p in points):
        raise ValueError("each point must be (x, y, label) or (x, y, label, series)")
    plt = require_matplotlib()
    fig, ax = plt.subplots(figsize=(6.4, 4.4))
    series: dict = {}
    for p in points:
        series.setdefault(p[3] if len(p) == 4 else None, []).append(p[:3])
    markers = "os^Dv<>"
    for i, (name, pts) in enumerate(series.items()):
        ax.scatter([p[0] for p in pts], [p[1] for p in pts], s=60, marker=markers[i % len(markers)], label=name,
                   zorder=3)
    if len(series) > 1:
        labels = dict.fromkeys(p[2] for p in points)
        for label in labels:
            pts = [p for p in points if p[2] == label]
            ax.plot([p[0] for p in pts], [p[1] for p in pts], color="gray", alpha=0.3, linewidth=0.8)
        ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.margins(x=0.08)  # room for the labels of the outermost points
    if logx:
        from matplotlib.ticker import FuncFormatter, NullFormatter
        ax.set_xscale("log")
        ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
        ax.xaxis.set_minor_formatter(NullFormatter())
    if ylim is not None:
        ax.set_ylim(*ylim)
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    merged: dict = {}  # (series, x, y) -> labels of the points drawn there
    for name, pts in series.items():
        for x, y, label in pts:
            merged.setdefault((name, x, y), []).append(str(label))
    _place_labels(fig, ax, [(x, y, " / ".join(dict.fromkeys(ls))) for (_, x, y), ls in merged.items()])
    return _save(fig, path)


def _place_labels(fig, ax, items: Sequence[tuple], fontsize: int = 8) -> None:
    """Annotate each ``(x, y, text)`` beside its point at the first of a few offsets (right, left,
    below, above, then further out) where the text's box overlaps no label placed before it, no
    point's marker and stays inside the axes; when none is free, the offset overlapping least. A
    label placed away from its point gets a thin line to it. Points are taken from the top down,
    so crowded rows fill outward."""
    renderer = fig.canvas.get_renderer()
    ax.autoscale_view()
    to_px = ax.transData.transform
    pad = 3 * fig.dpi / 72  # clearance around markers and labels: 3 points
    marker_r = 0.5 * math.sqrt(60) * fig.dpi / 72 + pad  # scatter's s=60 (points^2) as a radius in pixels
    markers = []
    for x, y, _ in items:
        px, py = to_px((x, y))
        markers.append((px - marker_r, py - marker_r, px + marker_r, py + marker_r))
    placed: list[tuple] = []
    frame = ax.get_window_extent(renderer)
    # beside the point first (no leader line), then further out in rings
    offsets = [(6, 3, "left"), (-6, 3, "right"), (6, -11, "left"), (-6, -11, "right")]
    for dx in (6, 24, 48):
        for dy in (15, -23, 27, -35, 39, -47) if dx == 6 else (3, -11, 15, -23, 27, -35, 39, -47):
            offsets += [(dx, dy, "left"), (-dx, dy, "right")]

    def overlap(a, b) -> float:
        w = min(a[2], b[2]) - max(a[0], b[0])
        h = min(a[3], b[3]) - max(a[1], b[1])
        return w * h if w > 0 and h > 0 else 0.0

    leader = dict(arrowstyle="-", color="0.45", linewidth=0.6, shrinkA=0, shrinkB=4)
    for n in sorted(range(len(items)), key=lambda n: (-items[n][1], items[n][0])):
        x, y, text = items[n]
        obstacles = placed + markers[:n] + markers[n + 1:]  # its own marker is where the label points
        best = None
        for i, (dx, dy, ha) in enumerate(offsets):
            ann = ax.annotate(text, (x, y), textcoords="offset points", xytext=(dx, dy), ha=ha, fontsize=fontsize)
            e = ann.get_window_extent(renderer)  # the text alone (a leader line is added once placed)
            ann.remove()
            box = (e.x0 - pad, e.y0 - pad, e.x1 + pad, e.y1 + pad)
            cost = sum(overlap(box, o) for o in obstacles)
            outside = box[0] < frame.x0 or box[2] > frame.x1 or box[1] < frame.y0 or box[3] > frame.y1
            cost += 1e6 if outside else 0.0
            if best is None or cost < best[0]:
                best = (cost, i, box)
            if cost == 0:
                break
        _, i, box = best
        dx, dy, ha = offsets[i]
        ax.annotate(text, (x, y), textcoords="offset points", xytext=(dx, dy), ha=ha, fontsize=fontsize,
                    arrowprops=leader if i >= 4 else None)
        placed.append(box)


def plot_lines(series: Mapping[str, Sequence[float]], path, *, xlabel: str = "", ylabel: str = "", title: str = "",
               smooth: int = 1) -> Path:
    """One line per series (e.g. training loss per step), optionally a running mean over
    ``smooth`` points."""
    if not series:
        raise ValueError("plot_lines needs at least one series")
    if not isinstance(smooth, int) or smooth < 1:
        raise ValueError(f"smooth must be an int >= 1, got {smooth!r}")
    plt = require_matplotlib()
    fig, ax = plt.subplots(figsize=(5.6, 3.6))
    for name, ys in series.items():
        y = torch.tensor([float(v) for v in ys])
        if smooth > 1 and y.numel() >= smooth:
            y = y.unfold(0, smooth, 1).mean(-1)
            x = range(smooth - 1, smooth - 1 + y.numel())
        else:
            x = range(y.numel())
        ax.plot(list(x), y.tolist(), label=name, linewidth=1.2)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    return _save(fig, path)


# ............................................................ benchmark result files

#: Integer fields that identify a row (shown in its label), with how to print them.
_LABEL_INTS = {"batch": "batch {}", "B": "B={}", "S": "S={}", "context": "context {}", "prompt": "prompt {}",
               "new_tokens": "{} new", "n_seq": "{} seqs", "heads": "{} heads", "head_dim": "D={}",
               "block_size": "block {}"}
#: Text fields that are results rather than what a row measures.
_LABEL_SKIP = {"best_eager", "single_backend", "auto_kernel"}
#: Metric families: (suffix, unit factor), one chart panel per family a table has.
_FAMILIES = [
    ("time", "ms (lower is better)", (("_ms", 1.0), ("_s", 1e3))),
    ("throughput", "tokens / s (higher is better)", (("_tok_s", 1.0),)),
    ("bandwidth", "GB / s (higher is better)", (("_GBps", 1.0),)),
    ("memory", "MiB (lower is better)", (("_MiB", 1.0), ("_mb", 1.0), ("_bytes", 2.0 ** -20))),
]
#: Series names spelled out where the column name is terse.
_SERIES_NAMES = {"hf": "HF generate", "floor": "weights-only bound", "hf sdpa": "HF sdpa", "hf eager": "HF eager",
                 "torch sdpa": "torch SDPA", "textbook": "textbook (eager matmul-softmax)"}
#: Columns left off the charts (kept in the tables): CPU time beside wall time, one-off compile
#: time, RSS and backward-only peaks beside the peak.
_SKIP_SUFFIXES = ("_cpu_s", "compile_s", "_rss_MiB", "_backward_peak_MiB")


def _metric(key: str):
    """(family index, factor, series name) of a result column, or None if it is not plotted."""
    if key.endswith(_SKIP_SUFFIXES):
        return None
    for i, (_, _, suffixes) in enumerate(_FAMILIES):
        for suffix, factor in suffixes:
            if key.endswith(suffix) and not (suffix == "_s" and key.endswith("_tok_s")):
                name = key[: -len(suffix)].replace("_", " ")
                name = _SERIES_NAMES.get(name, name)
                return i, factor, _re_sub(r"^ring(\d+)", r"ring P=\1", name)
    return None


def _re_sub(pattern: str, repl: str, text: str) -> str:
    import re
    return re.sub(pattern, repl, text)


#: Text fields printed with their name (their value alone would be ambiguous).
_LABEL_NAMED = {"backend": "backend: {}", "latent": "latent {}", "engine": "engine: {}"}


def _row_label(row: dict) -> str:
    """What a row measures: its first text field on one line, the other text fields and the
    identifying sizes on the next (``prefill causal`` / ``B1 H8 S512 D64 · fp32 · backend: sdpa``)."""
    parts = []
    for k, v in row.items():
        if isinstance(v, str) and k not in _LABEL_SKIP:
            parts.append(_LABEL_NAMED.get(k, "{}").format(v))
        elif k in _LABEL_INTS and isinstance(v, (int, float)) and not isinstance(v, bool):
            parts.append(_LABEL_INTS[k].format(int(v) if float(v).is_integer() else v))
    if len(parts) <= 2:
        return " · ".join(parts)
    return parts[0] + "\n" + " · ".join(parts[1:])


def _tables(res: dict) -> list[tuple[str, list[dict]]]:
    """Every table of a result file: lists of row dicts (``rows``, or named tables such as the
    gpu suite's), and single dicts holding metrics (paged's ``memory``) as one-row tables."""
    out = []
    for name, val in res.items():
        title = "" if name == "rows" else name.replace("_", " ")
        if isinstance(val, list) and val and all(isinstance(r, dict) for r in val):
            out.append((title, val))
        elif isinstance(val, dict) and any(_metric(k) for k in val):
            out.append((title, [val]))
    return out


def _context_line(res: dict, suite: str) -> str:
    """The chart's subtitle: fixed shapes and configuration, the machine, quick or full."""
    import textwrap
    bits = []
    for key in ("config", "dims", "shape", "heads", "model"):
        v = res.get(key)
        if isinstance(v, dict):
            bits.append(", ".join(str(x) if k == "arch" else f"{k} {x}" for k, x in v.items() if x is not None))
        elif isinstance(v, (str, int)):
            bits.append(f"{key} {v}")
    if "block_size" in res:
        bits.append(f"block size {res['block_size']}")
    m = res.get("machine") or {}
    if m:
        cpu = m.get("gpu") or m.get("cpu", "?")
        isa = f", {m['isa']}" if m.get("isa") else ""
        bits.append(f"{cpu}{isa}, {m.get('cores', '?')} cores, {m.get('torch_threads', '?')} torch threads, "
                    f"torch {m.get('torch', '?')}")
    if res.get("quick"):
        bits.append("--quick run (tiny sizes: a smoke test, not a measurement)")
    return "\n".join(textwrap.fill(b, 120) for b in bits)


def _fmt_value(v: float) -> str:
    a = abs(v)
    return f"{v:.0f}" if a >= 100 else (f"{v:.1f}" if a >= 10 else (f"{v:.2f}" if a >= 0.01 else f"{v:.2g}"))


def _hbars(ax, labels: list[str], series: dict[str, list[float]], xlabel: str, title: str) -> None:
    """Horizontal grouped bars: labels on the y axis (any length, never overprinted), one bar
    per series in each group, each bar's value at its end; log x when values span > 50x."""
    n, G = len(series), len(labels)
    h = 0.8 / n
    finite = [v for vals in series.values() for v in vals if v is not None and math.isfinite(v) and v > 0]
    log = bool(finite) and max(finite) / min(finite) > 50
    for i, (name, vals) in enumerate(series.items()):
        ys = [g + (i - (n - 1) / 2) * h for g in range(G)]
        shown = [v if v is not None and math.isfinite(v) and v > 0 else 0.0 for v in vals]
        ax.barh(ys, shown, h, label=name)
        for y, v in zip(ys, vals):
            if v is not None and math.isfinite(v) and v > 0:
                ax.annotate(_fmt_value(v), (v, y), xytext=(3, 0), textcoords="offset points", va="center",
                            fontsize=7)
            else:  # a contender that did not run (too slow at this size, or failed)
                ax.annotate("n/a", (0.0, y), xycoords=("axes fraction", "data"), xytext=(3, 0),
                            textcoords="offset points", va="center", fontsize=7, color="gray")
    ax.set_yticks(range(G))
    ax.set_yticklabels(labels, fontsize=8)
    ax.set_ylim(G - 0.5, -0.5)  # first row on top
    if log:
        ax.set_xscale("log")
    if finite:  # room for the value labels
        ax.set_xlim(right=max(finite) * (4.0 if log else 1.22))
    ax.set_xlabel(xlabel + (" (log scale)" if log else ""), fontsize=8)
    ax.set_title(title, fontsize=9, loc="left")
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)
    ax.grid(axis="x", alpha=0.3)


def plot_benchmark(json_path, path=None) -> Path:
    """One chart for a benchmark result file (``benchmarks/results/<suite>.json``), written next
    to it as ``<suite>.png`` unless ``path`` is given.

    Each table of the file (``rows``, or named tables such as the gpu suite's) gets one panel
    per kind of number it holds: times (``*_ms``, ``*_s``), rates (``*_tok_s``), bandwidth
    (``*_GBps``), memory (``*_MiB``, ``*_mb``, ``*_bytes``). Bars are horizontal, one group per
    row labelled by what it measures (its text fields and sizes: shape, dtype, context, batch),
    so labels of any length never overprint; the title carries the suite, the fixed shapes and
    the machine."""
    json_path = Path(json_path)
    res = json.loads(json_path.read_text())
    if not isinstance(res, dict):
        raise ValueError(f"{json_path} is not a benchmark result (a JSON object with 'rows')")
    panels = []
    for table, rows in _tables(res):
        labels = [_row_label(r) or f"row {i}" for i, r in enumerate(rows)]
        fams: dict[int, dict[str, list]] = {}
        for key in rows[0]:
            m = _metric(key)
            if m is None:
                continue
            vals = [r.get(key) for r in rows]
            if not all(v is None or (isinstance(v, (int, float)) and not isinstance(v, bool)) for v in vals):
                continue
            if all(v is None for v in vals):
                continue
            fam, factor, name = m
            fams.setdefault(fam, {})[name] = [None if v is None else float(v) * factor for v in vals]
        for fam, series in sorted(fams.items()):
            kind, unit, _ = _FAMILIES[fam]
            panels.append((labels, series, unit, f"{table}: {kind}" if table and table != kind else kind))
    if not panels:
        raise ValueError(f"{json_path}: no numeric *_ms, *_s, *_tok_s, *_GBps or memory columns to plot")
    plt = require_matplotlib()
    heights = [len(lab) * (0.2 * len(ser) + 0.15 * max(1, max(x.count("\n") + 1 for x in lab))) + 0.8
               for lab, ser, _, _ in panels]
    fig, axes = plt.subplots(len(panels), 1, figsize=(10, sum(heights) + 0.9), layout="constrained",
                             gridspec_kw={"height_ratios": heights}, squeeze=False)
    for ax, (labels, series, unit, title) in zip(axes[:, 0], panels):
        _hbars(ax, labels, series, unit, title)
    suite = json_path.stem.removesuffix("_quick")
    fig.suptitle(f"attnkit benchmark: {suite}\n{_context_line(res, suite)}", fontsize=9, x=0.01, ha="left")
    return _save(fig, path or json_path.with_suffix(".png"))
