"""Plumbing shared by the benchmark scripts: interleaved timing, the machine's read bandwidth (a
plain sum), the machine's description (CPU model and vector ISA), skipping a suite that cannot run
here, and the command line that writes a result table (markdown + JSON) and its chart (PNG)."""

from __future__ import annotations

import argparse
import contextlib
import importlib
import importlib.util
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

import torch

import attnkit
from attnkit._sysinfo import cpu_isa, cpu_name

RESULTS = Path(__file__).parent / "results"


@contextlib.contextmanager
def torch_threads(n: int):
    """torch's intra-op threads set to ``n`` for the block, restored after (a benchmark's own runs)."""
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def timed(fn: Callable[[], object]) -> Callable[[], float]:
    """Wrap ``fn`` so that calling it returns its wall time in seconds."""
    def run() -> float:
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0
    return run


def interleaved_samples(fns: dict[str, Callable[[], float]], reps: int, warmup: int = 0) -> dict[str, list[float]]:
    """Each contender's seconds, one per repetition. Each repetition runs every contender once, in
    alternating order (whoever runs right after a memory-hungry peer pays for it). Contenders
    return their own seconds (see :func:`timed`), so one may time only part of its work."""
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    samples: dict[str, list[float]] = {name: [] for name in fns}
    for rep in range(reps):
        for name, fn in (list(fns.items()) if rep % 2 == 0 else list(fns.items())[::-1]):
            samples[name].append(fn())
    return samples


def medians(samples: dict[str, list[float]]) -> dict[str, float]:
    """Each contender's median of :func:`interleaved_samples`."""
    return {name: statistics.median(s) for name, s in samples.items()}


def interleaved_medians(fns: dict[str, Callable[[], float]], reps: int, warmup: int = 0) -> dict[str, float]:
    """Median of each contender's seconds over :func:`interleaved_samples`."""
    return medians(interleaved_samples(fns, reps, warmup))


def paired_speedup(samples: dict[str, list[float]], base: str, name: str) -> float:
    """How many times faster ``name`` runs than ``base``: the median over repetitions of their
    ratio within the repetition. Calls of one repetition run back to back, so a machine whose
    speed drifts during the run (a shared VM) moves both; the ratio still moves between runs
    where the drift is slower than one (benchmarks/README.md)."""
    return statistics.median(b / x for b, x in zip(samples[base], samples[name]))


def read_probe(nbytes: int) -> Callable[[], object]:
    """A plain read of ``nbytes`` (a sum over an fp32 buffer): the machine's read bandwidth on a
    working set of that size, to time side by side with the contenders that stream it."""
    buf = torch.ones(max(1, nbytes // 4), dtype=torch.float32)
    return lambda: buf.sum()


def machine() -> dict:
    return {"cpu": cpu_name(), "isa": cpu_isa(), "cores": os.cpu_count(), "torch_threads": torch.get_num_threads(),
            "torch": torch.__version__, "attnkit": attnkit.__version__, "python": platform.python_version(),
            "platform": platform.platform()}


#: Exit status of a suite that cannot run here: ``attnkit bench`` reports it as skipped (the
#: automake convention) and goes on.
SKIPPED = 77


def skip(reason: str) -> None:
    """Stop this benchmark as skipped and exit with :data:`SKIPPED`: under ``attnkit bench``
    (``$ATTNKIT_BENCH_SKIP_FILE`` set) the reason goes to that file and the command prints it
    once; run alone, the script prints ``skipped: <reason>``."""
    note = os.environ.get("ATTNKIT_BENCH_SKIP_FILE")
    if note:
        Path(note).write_text(reason)
    else:
        print(f"skipped: {reason}", file=sys.stderr, flush=True)
    sys.exit(SKIPPED)


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a broken or blocked install counts as missing
        return False


def require(module: str, pip: str) -> None:
    """Skip this benchmark unless ``module`` can be imported; the reason names ``pip install``."""
    if not _installed(module):
        skip(f"needs {module} (pip install {pip})")
    try:
        importlib.import_module(module)
    except ImportError as e:
        skip(f"needs a working {module} (pip install {pip}): {e}")


def plot(json_path: Path) -> str:
    """Draw ``<stem>.png`` next to a result file (:func:`attnkit.viz.plot_benchmark`); returns
    what happened, in one line (matplotlib is optional: without it the chart is skipped)."""
    try:
        from attnkit.viz import plot_benchmark
        return f"wrote {plot_benchmark(json_path)}"
    except ImportError as e:
        return f"chart skipped: {e}"
    except ValueError as e:
        return f"no chart: {e}"


def bench_main(argv, doc: str, name: str, run: Callable[[bool], dict], to_markdown: Callable[[dict], str]) -> int:
    """``--quick`` / ``--out`` command line: run, print the table, write ``name[_quick].{md,json,png}``."""
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="small sizes, for a smoke test")
    p.add_argument("--out", type=Path, default=RESULTS, help="folder for the tables (default: benchmarks/results)")
    args = p.parse_args(argv)
    res = run(args.quick)
    md = to_markdown(res)
    args.out.mkdir(parents=True, exist_ok=True)
    stem = f"{name}_quick" if args.quick else name
    (args.out / f"{stem}.json").write_text(json.dumps(res, indent=2))
    (args.out / f"{stem}.md").write_text(md)
    print(md)
    print(f"wrote {args.out / (stem + '.md')} and .json")
    print(plot(args.out / f"{stem}.json"))
    return 0
