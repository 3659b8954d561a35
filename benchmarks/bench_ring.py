"""Ring attention (attnkit.distributed) on CPU over gloo: time and memory per rank as S grows.

Causal self-attention, B=1, H=8, D=64, fp32, zigzag sharding; one forward + backward per
measurement. Every process runs ONE torch thread (one core stands for one device):

* ``single``: ``attnkit.attention`` on the whole sequence in one process (SDPA's fused CPU
  kernel; the baseline).
* ``ring P=1``: ``ring_attention`` in a group of one (the same block code, no communication):
  how our pure-torch block math compares with the fused kernel.
* ``ring P=2``: two ranks, each with half the sequence: the context-parallel run.
* ``ring P=4`` (full mode, memory only): four ranks on this machine's cores are oversubscribed,
  so their times are not reported.

What is measured, per process (for the ring, the largest over its ranks):

* ``time``: median wall time of forward + backward (``out.backward(dout)``; ranks start each
  repetition together).
* ``peak``: the largest total size of live tensors during one forward + backward, plus the
  inputs q, k, v and the upstream gradient allocated before it. Tracked by a
  ``TorchDispatchMode`` that records every storage a torch op creates (forward, backward, the
  ring's receive buffers) and its release: exact for tensors, independent of the allocator's
  caching, blind to scratch memory a fused kernel allocates internally (SDPA's per-thread
  buffers: small). Both sides run ``torch.autograd.grad(out, (q, k, v), dout)``, so the
  gradients are counted as they come out of the backward. ``single .backward()`` also gives the
  single process through ``out.backward(dout)`` into leaf tensors: SDPA returns its gradients
  in (B, S, H, D) memory layout and autograd copies each into the leaf's layout, one transient
  full-size tensor more (in a model the gradients flow into the projections and that copy does
  not happen; the ring's gradients are contiguous and never copied).
* ``shards``: the ring's peak in units of one shard-sized tensor (B*H*(S/P)*D*4 bytes), next to
  the bound of the algorithm (see the results file): what a reader compares.
* ``rss``: how far the process's peak resident set (Linux ``VmHWM``, reset before each length
  and contender) rose above its resident set before the runs (a tiny warm-up call first, so
  library initialisation is not counted). It includes allocator caching and fragmentation, and
  memory the allocator kept from earlier lengths is reused without showing: a coarse check of
  ``peak``.

Memory figures are deterministic (they do not depend on other work on the machine); times are
not. ``--memory-only`` measures memory only (and RSS, from one untimed run) and keeps the
timing rows of the previous results file in ``--out``, labelled as such.

    python benchmarks/bench_ring.py                # S = 1k, 2k, 4k, 8k; P = 1, 2 (+ P = 4 memory)
    python benchmarks/bench_ring.py --memory-only  # the same sizes, memory only; keeps old timings
    python benchmarks/bench_ring.py --quick        # S = 256, 512; P = 1, 2 (under 30 s)
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import tempfile
import time
import weakref
from datetime import timedelta
from pathlib import Path

import torch

from _common import RESULTS, bench_main, machine

B, H, D = 1, 8, 64
# The ring's peak in shard-sized tensors, per rank (backward; see _ACCOUNTING): q, k, v, dout,
# out, dq, plus the K/V block in use, the next one (or the incoming dK/dV accumulator) and the
# dK/dV accumulator. Score tiles come on top.
RING_BOUND_SHARDS = 12
SINGLE_IDEAL_FULL = 8  # q, k, v, dout, out, dq, dk, dv: what any exact attention's caller holds at the end


class _LiveTensorBytes:
    """Peak total size of the tensor storages created by torch ops while active (a dispatch mode:
    sees forward, backward and communication buffers; not scratch memory a kernel allocates
    internally). A storage counts from the op that creates it until it is freed."""

    def __init__(self):
        from torch.utils._python_dispatch import TorchDispatchMode
        from torch.utils._pytree import tree_flatten

        tracker = self

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                # Views and in-place results share an input's storage: not a new allocation.
                seen = {t.untyped_storage().data_ptr() for t in tree_flatten((args, kwargs))[0]
                        if isinstance(t, torch.Tensor)}
                for t in tree_flatten(out)[0]:
                    if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in seen:
                        tracker._add(t.untyped_storage())
                return out

        self.mode, self.live, self.current, self.peak = Mode(), {}, 0, 0

    def _add(self, storage) -> None:
        key, n = storage.data_ptr(), storage.nbytes()
        if n == 0 or key in self.live:
            return
        self.live[key] = n
        self.current += n
        self.peak = max(self.peak, self.current)
        weakref.finalize(storage, self._free, key)

    def _free(self, key) -> None:
        self.current -= self.live.pop(key, 0)


def _peak_bytes(fn) -> int:
    """Largest sum of live tensor bytes created while ``fn`` runs."""
    tracker = _LiveTensorBytes()
    with tracker.mode:
        fn()
    return tracker.peak


def _status_kib(field: str) -> int | None:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1])
    except OSError:
        pass
    return None


def _rss_window():
    """Start measuring RSS growth; returns a function giving the growth in bytes since the start.

    Linux: resets this process's peak RSS (``/proc/self/clear_refs``) and reads ``VmHWM - VmRSS
    at the start``. Elsewhere (or where the reset is refused), the high-water mark of
    ``getrusage`` over its value at the start (monotone: only a new peak shows)."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        start = _status_kib("VmRSS")
        if start is not None:
            return lambda: max(0, _status_kib("VmHWM") - start) * 1024
    except OSError:
        pass
    start = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    return lambda: (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - start) * 1024


def _inputs(S: int):
    g = torch.Generator().manual_seed(S)
    return [torch.randn(B, H, S, D, generator=g) for _ in range(4)]  # q, k, v, dout


def _worker(rank: int, world: int, init: str, out_dir: str, lengths: list[int], reps: int, timing: bool):
    """``timing``: time ``reps`` repetitions after a warm-up (else one untimed run, for RSS)."""
    torch.set_num_threads(1)
    import torch.distributed as dist

    import attnkit
    from attnkit.distributed import ring_attention, shard_sequence

    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=600))
    # Warm both paths up on a tiny input: the first call of anything maps code and initialises
    # libraries (tens of MiB of RSS that have nothing to do with the sequence).
    q, k, v, dout = _local_inputs(8 * world, rank, world)
    ring_attention(q, k, v, causal=True).backward(dout)
    attnkit.attention(q, k, v, causal=True).backward(dout)
    runs = 1 + (reps if timing else 0)  # the first run warms up (connections, allocator)
    rows = []
    # Pass 1: times and RSS growth, no tracking.
    for S in lengths:
        q, k, v, dout = _local_inputs(S, rank, world)
        row = {"S": S, "world": world}
        if world == 1:  # the single-process baseline first, in this same one-thread process
            row["single_backend"] = attnkit.describe_call(q, k, v, causal=True)
            rss = _rss_window()
            times = [_timed(lambda: attnkit.attention(q, k, v, causal=True).backward(dout), q, k, v)
                     for _ in range(runs)][1:]
            row["single_s"], row["single_cpu_s"] = _medians(times)
            row["single_rss"] = rss()
        _clear(q, k, v)
        rss = _rss_window()
        times = []
        for _ in range(runs):
            dist.barrier()
            times.append(_timed(lambda: ring_attention(q, k, v, causal=True).backward(dout), q, k, v))
        row["ring_s"], row["ring_cpu_s"] = _medians(times[1:])
        row["ring_rss"] = rss()
        rows.append(row)
        del q, k, v, dout
    # Pass 2: peak of live tensor bytes, gradients as autograd.grad returns them (and, as a
    # check, through .backward() into the leaves).
    for row in rows:
        q, k, v, dout = _local_inputs(row["S"], rank, world)
        inputs_bytes = sum(t.numel() * t.element_size() for t in (q, k, v, dout))
        grads = lambda f: lambda: torch.autograd.grad(f(q, k, v, causal=True), (q, k, v), dout)  # noqa: E731
        backward = lambda f: lambda: f(q, k, v, causal=True).backward(dout)  # noqa: E731
        dist.barrier()
        row["ring_peak"] = inputs_bytes + _peak_bytes(grads(ring_attention))
        dist.barrier()
        row["ring_backward_peak"] = inputs_bytes + _peak_bytes(backward(ring_attention))
        _clear(q, k, v)
        if world == 1:
            row["single_peak"] = inputs_bytes + _peak_bytes(grads(attnkit.attention))
            row["single_backward_peak"] = inputs_bytes + _peak_bytes(backward(attnkit.attention))
            _clear(q, k, v)
        del q, k, v, dout
    # The ring is exact: this rank's shard of the output and gradients equals the single process
    # (checked last, so the full-sequence tensors do not raise the RSS figures).
    S = lengths[0]
    q, k, v, dout = _local_inputs(S, rank, world)
    out = ring_attention(q, k, v, causal=True)
    out.backward(dout)
    qf, kf, vf, doutf = _inputs(S)
    for t in (qf, kf, vf):
        t.requires_grad_()
    ref = attnkit.attention(qf, kf, vf, causal=True)
    ref.backward(doutf)
    for got, want in ((out, ref), (q.grad, qf.grad), (k.grad, kf.grad), (v.grad, vf.grad)):
        torch.testing.assert_close(got, shard_sequence(want.detach(), 2, rank=rank, world_size=world))
    Path(out_dir, f"w{world}_r{rank}.json").write_text(json.dumps(rows))
    dist.barrier()
    dist.destroy_process_group()


def _medians(times: list[tuple[float, float]]) -> tuple[float | None, float | None]:
    """(median wall, median CPU) seconds, or (None, None) when nothing was timed."""
    if not times:
        return None, None
    return statistics.median(t[0] for t in times), statistics.median(t[1] for t in times)


def _local_inputs(S: int, rank: int, world: int):
    from attnkit.distributed import shard_sequence

    q, k, v, dout = (shard_sequence(t, 2, rank=rank, world_size=world).contiguous() for t in _inputs(S))
    return q.requires_grad_(), k.requires_grad_(), v.requires_grad_(), dout


def _clear(*leaves) -> None:
    for t in leaves:
        t.grad = None


def _timed(fn, *leaves) -> tuple[float, float]:
    """(wall seconds, CPU seconds of this process: its compute and gloo's threads) of ``fn()``."""
    _clear(*leaves)
    t0, c0 = time.perf_counter(), time.process_time()
    fn()
    return time.perf_counter() - t0, time.process_time() - c0


def _spawn(world: int, lengths: list[int], reps: int, timing: bool) -> list[list[dict]]:
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as d:
        args = (world, os.path.join(d, "init"), d, lengths, reps, timing)
        if world == 1:  # no process to start: run the group of one here (saves seconds of start-up)
            _worker(0, *args)
        else:
            mp.start_processes(_worker, args=args, nprocs=world, start_method="spawn")
        return [json.loads(Path(d, f"w{world}_r{r}.json").read_text()) for r in range(world)]


_TIMING_KEYS = ("single_s", "single_cpu_s", "ring1_s", "ring1_cpu_s", "ring2_s", "ring2_cpu_s", "ring4_s",
                "ring4_cpu_s")


def run(quick: bool, memory_only: bool = False, previous: dict | None = None) -> dict:
    """``memory_only``: no timing; the timing rows of ``previous`` (an earlier result of this
    script, if given) are carried over and labelled as such."""
    lengths = [256, 512] if quick else [1024, 2048, 4096, 8192]
    reps = 1 if quick else 3
    worlds = [(1, not memory_only), (2, not memory_only)] + ([] if quick else [(4, False)])
    per_world = {w: _spawn(w, lengths, reps, timing) for w, timing in worlds}
    rows = []
    for i, S in enumerate(lengths):
        single = per_world[1][0][i]
        row = {"S": S, "single_backend": single["single_backend"], "single_s": single["single_s"],
               "single_cpu_s": single["single_cpu_s"], "single_peak_MiB": single["single_peak"] / 2**20,
               "single_backward_peak_MiB": single["single_backward_peak"] / 2**20,
               "ring1_s": single["ring_s"], "ring1_cpu_s": single["ring_cpu_s"],
               "ring1_peak_MiB": single["ring_peak"] / 2**20,
               "ring1_backward_peak_MiB": single["ring_backward_peak"] / 2**20}
        for w, _ in worlds[1:]:
            ranks = [r[i] for r in per_world[w]]
            for key in ("s", "cpu_s"):
                row[f"ring{w}_{key}"] = max(r[f"ring_{key}"] for r in ranks) if ranks[0]["ring_s"] is not None else None
            row[f"ring{w}_peak_MiB"] = max(r["ring_peak"] for r in ranks) / 2**20
            row[f"ring{w}_backward_peak_MiB"] = max(r["ring_backward_peak"] for r in ranks) / 2**20
            row[f"ring{w}_rss_MiB"] = max(r["ring_rss"] for r in ranks) / 2**20
        row["single_rss_MiB"] = single["single_rss"] / 2**20
        rows.append(row)
    res = {"machine": machine(), "quick": quick, "shape": {"B": B, "H": H, "D": D, "dtype": "fp32", "causal": True,
                                                           "sharding": "zigzag"},
           "worlds": [w for w, _ in worlds], "rows": rows, "timing_from": "this run"}
    if memory_only:
        res["timing_from"] = "not measured"
        old = {r["S"]: r for r in (previous or {}).get("rows", [])}
        if old and all(S in old and old[S].get("single_s") is not None for S in lengths):
            for row in rows:
                row.update({key: old[row["S"]].get(key) for key in _TIMING_KEYS})
            res["timing_from"] = (previous.get("timing_from") if previous.get("timing_from") not in (None, "this run")
                                  else "the previous full run (carried over by --memory-only, not re-measured)")
            res["timing_machine"] = previous.get("timing_machine", previous.get("machine"))
    return res


def _shard_MiB(S: int, world: int) -> float:
    return B * H * (S // world) * D * 4 / 2**20


def to_markdown(res: dict) -> str:
    m = res["machine"]
    worlds = res["worlds"][1:]
    rows = res["rows"]
    timing_from = res.get("timing_from", "this run")
    timed = [w for w in worlds if rows[0].get(f"ring{w}_s") is not None]
    lines = [f"Machine: {m['cpu']}, {m['cores']} cores, torch {m['torch']}, attnkit {m['attnkit']}. "
             "Causal self-attention, B=1, H=8, D=64, fp32, zigzag sharding, forward + backward, one torch "
             "thread per process (per rank). single = attnkit.attention on the whole sequence (backend "
             f"{rows[0]['single_backend']}); ring P=1 = ring_attention in a group of one (the same block "
             "code, no communication).", ""]
    if rows[0].get("single_s") is None:
        lines += ["Time: not measured (--memory-only, and no earlier timings to carry over).", ""]
    else:
        lines += ["Time: medians, wall (slowest rank) and CPU time of the process (per rank: its compute plus "
                  "gloo's threads; unlike wall time, not inflated when other work shares the cores)."
                  + ("" if timing_from == "this run" else
                     f" **From {timing_from}**: taken with the code of that run, on "
                     f"{(res.get('timing_machine') or m)['cpu']}; the memory tables below are from this run."), "",
                  "| S | single ms | single CPU ms | ring P=1 ms | ring P=1 CPU ms | "
                  + " | ".join(f"ring P={w} ms | ring P={w} CPU ms/rank | P={w} speed-up vs single" for w in timed)
                  + " |", "|" + "---:|" * (5 + 3 * len(timed))]
        for r in rows:
            cells = [str(r["S"])] + [f"{r[key] * 1e3:.0f}"
                                     for key in ("single_s", "single_cpu_s", "ring1_s", "ring1_cpu_s")]
            for w in timed:
                cells += [f"{r[f'ring{w}_s'] * 1e3:.0f}", f"{r[f'ring{w}_cpu_s'] * 1e3:.0f}",
                          f"{r['single_s'] / r[f'ring{w}_s']:.2f}x"]
            lines.append("| " + " | ".join(cells) + " |")
        lines.append("")
    same = all(abs(r[f"ring{w}_backward_peak_MiB"] - r[f"ring{w}_peak_MiB"]) < 0.05 for r in rows for w in [1] + worlds)
    lines += ["Memory: peak = largest live tensor bytes during forward + backward (every storage torch ops create, "
              "tracked by a dispatch mode; deterministic) plus the inputs q, k, v, dout; largest rank. Gradients "
              "as `torch.autograd.grad` returns them. `single .backward()`: the single process through "
              "`out.backward(dout)` into leaf tensors, which adds one transient full-size copy (SDPA's gradients "
              "come in (B, S, H, D) layout and autograd copies each into the leaf's layout; in a model they flow "
              "into the projections uncopied), so the fair baseline is `single`: 8 full-size tensors (q, k, v, "
              "dout, out, dq, dk, dv). The ring's peak is the same either way"
              + ("" if same else " (NOT in this run: see the JSON)") + ". shards = peak per rank in units of one "
              "shard-sized tensor (B*H*(S/P)*D*4 bytes); ideal 1/P of the single process = 8 shards; the bound of "
              "this ring = 12 shards (accounting below)."
              + (" P=4 runs four ranks on this machine's cores (oversubscribed): memory only."
                 if 4 in worlds and 4 not in timed else ""), "",
              "| S | single peak MiB | single .backward() peak MiB | ring P=1 peak MiB | "
              + " | ".join(f"ring P={w} peak/rank MiB | P={w} / single | P={w} shards (ideal 8, bound 12)"
                           for w in worlds) + " |",
              "|" + "---:|" * (4 + 3 * len(worlds))]
    for r in rows:
        cells = [str(r["S"]), f"{r['single_peak_MiB']:.1f}", f"{r['single_backward_peak_MiB']:.1f}",
                 f"{r['ring1_peak_MiB']:.1f}"]
        for w in worlds:
            cells += [f"{r[f'ring{w}_peak_MiB']:.1f}", f"{r[f'ring{w}_peak_MiB'] / r['single_peak_MiB']:.2f}",
                      f"{r[f'ring{w}_peak_MiB'] / _shard_MiB(r['S'], w):.2f}"]
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", "RSS growth = peak resident set (VmHWM, reset per run) over the resident set before it; coarse "
              "(allocator caching), from the first pass (`.backward()`).", "",
              "| S | single RSS growth MiB | " + " | ".join(f"ring P={w} RSS growth/rank MiB" for w in worlds) + " |",
              "|" + "---:|" * (2 + len(worlds))]
    for r in rows:
        lines.append("| " + " | ".join([str(r["S"]), f"{r['single_rss_MiB']:.0f}"]
                                       + [f"{r[f'ring{w}_rss_MiB']:.0f}" for w in worlds]) + " |")
    lines += ["", _ACCOUNTING.format(p2=RING_BOUND_SHARDS / (SINGLE_IDEAL_FULL * 2),
                                     p4=RING_BOUND_SHARDS / (SINGLE_IDEAL_FULL * 4))]
    return "\n".join(lines) + "\n"


_ACCOUNTING = """\
Accounting, in shards (one shard = one (B, H, S/P, D) fp32 tensor; the single process's tensors are P shards each).
The single process ends holding q, k, v, dout, out, dq, dk, dv: 8 full-size tensors = 8P shards, and that is
its whole peak (SDPA's workspace is per-thread and small). 1/P of it is 8 shards per rank. A ring cannot reach
that: while the blocks of other ranks are processed it holds, per rank,

| buffer | shards | computing on a block of another rank (P >= 3) | dK/dV hop |
|---|---:|:---:|:---:|
| q, k, v, dout (its shards; inputs) | 4 | yes | yes |
| out (saved for backward: delta = rowsum(dout * out)) | 1 | yes | yes |
| dq (fp32 accumulator; it becomes the gradient) | 1 | yes | yes |
| the K/V block being used (another rank's) | 2 | yes | yes |
| the next K/V block, arriving (double buffering) | 2 | yes | - |
| the dK/dV accumulator of the block being used (becomes dk, dv at the end) | 2 | yes | yes (being sent) |
| the dK/dV accumulator of the next block, arriving | 2 | - | yes |
| total | | 12 (+ 2 score tiles, <= 1/4 shard each) | 12 |

so the bound of this algorithm is 12 shards per rank, 12 / (8P) = 1.5/P of the single process: {p2:.2f} at
P=2, {p4:.3f} at P=4. It is a floor for whole-shard point-to-point exchanges: exchanging a pair of shards needs the
sent and the received pair alive together, and the other pair (K/V during the dK/dV hop, the accumulator during
the K/V transfer) cannot be dropped. At P=2 the peak is the first dK/dV hop (12) and compute peaks at 10 + tiles
(the first block is the rank's own, the second has no successor); at P >= 3 compute on a middle block is
12 + 2 tiles, and the tiles are floored at 2^18 elements each (1 MiB), which is 1/4 shard at S=8192, P=4 and
more below it. Measured minus bound = score tiles, per-row statistics (lse, delta: 1/D shard each) and
masks.
"""


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    # The options of bench_main plus --memory-only (parsed here for --help and errors; bench_main
    # parses the rest again).
    pre = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    pre.add_argument("--quick", action="store_true", help="small sizes, for a smoke test")
    pre.add_argument("--out", type=Path, default=RESULTS, help="folder for the tables (default: benchmarks/results)")
    pre.add_argument("--memory-only", action="store_true",
                     help="measure memory only; keep the timing rows of the previous results file in --out")
    known = pre.parse_args(argv)
    if not known.memory_only:
        return bench_main(argv, __doc__, "ring", run, to_markdown)
    previous_file = known.out / ("ring_quick.json" if known.quick else "ring.json")
    previous = json.loads(previous_file.read_text()) if previous_file.exists() else None
    rest = [a for a in argv if a != "--memory-only"]
    return bench_main(rest, __doc__, "ring", lambda quick: run(quick, memory_only=True, previous=previous),
                      to_markdown)


if __name__ == "__main__":
    sys.exit(main())
