"""The ``attnkit`` command.

* ``attnkit info``: versions, device, every backend's availability, and which engine the CPU
  decode backends run (native or torch, and why).
* ``attnkit demo``: train MHA / GQA / MQA / MLA decoders on associative recall, measure them,
  write a report with figures (:mod:`attnkit.demo`).
* ``attnkit bench``: run the benchmark suites of a source checkout's ``benchmarks/`` folder and
  write their tables and plots.
* ``attnkit viz``: mask patterns and attention maps to PNG.
* ``attnkit kv``: KV-cache bytes per token, per layer and per model, for attention variants.
* ``attnkit generate``: text in, text out with a checkpoint folder's tokenizer (streamed).
"""

from __future__ import annotations

import argparse
import platform
import subprocess
import sys
import time
from pathlib import Path

import torch

from ._checks import positive_int


class CLIError(Exception):
    """A bad option or a missing prerequisite: printed as ``attnkit <command>: error: ...``, exit 2."""


def _device_line() -> str:
    if torch.cuda.is_available():
        names = ", ".join(torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count()))
        return f"cuda ({names})"
    return f"cpu ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)"


# ---------------------------------------------------------------------------- info


def _sdpa_kernel_lines() -> list[str]:
    """Which SDPA kernel torch picks for attnkit's representative calls on each device: causal
    self-attention, causal chunked prefill (Sq < Sk) and key padding, B=2 H=8 S=256 D=64, fp32
    on CPU and bf16 (fp16 without bf16 support) on CUDA; plus CUDA's SDPA kernel switches."""
    from attnkit import describe_call
    from attnkit.masks import KeyPadding

    B, H, S, D = 2, 8, 256, 64
    devices = [("cpu", torch.float32)]
    if torch.cuda.is_available():
        devices.append(("cuda", torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16))
    lines = [f"sdpa kernels (torch's choice for attnkit's calls, B={B} H={H} S={S} D={D}):"]
    for dev, dtype in devices:
        x = torch.zeros(B, H, S, D, device=dev, dtype=dtype)
        chunk = x[:, :, : S // 4]
        cases = [("causal", x, dict(causal=True)),
                 (f"causal Sq={S // 4}<Sk", chunk, dict(causal=True)),
                 ("padded", x, dict(mask=KeyPadding(torch.tensor([S, S // 2]))))]
        for label, q, kwargs in cases:
            try:
                name = describe_call(q, x, x, backend="sdpa", detail=True, **kwargs)
            except Exception as e:  # report, never fail `attnkit info`
                name = f"error: {type(e).__name__}: {e}"
            dt = str(dtype).removeprefix("torch.")
            lines.append(f"  {dev:<4} {dt:<8} {label:<16} {name}")
        if dev == "cuda":
            switches = [f"{n}={getattr(torch.backends.cuda, n + '_sdp_enabled')()}"
                        for n in ("flash", "mem_efficient", "cudnn") if hasattr(torch.backends.cuda, n + "_sdp_enabled")]
            lines.append("  cuda sdp enabled: " + " ".join(switches))
    return lines


def _native_lines(build: bool) -> list[str]:
    """The native CPU kernel's section: which engine runs decode/paged calls and why, the cache,
    the compiler and, after a failed build, its last lines (:func:`attnkit.native.report`).
    ``build``: compile the kernel now if it is not built (what the first such call would do)."""
    import warnings

    from attnkit import native

    with warnings.catch_warnings():  # the report below says the same, with the compiler's output
        warnings.simplefilter("ignore", RuntimeWarning)
        lines = native.report(build=build)
    return ["native CPU kernel (split-K decode/paged, RoPE, RMSNorm):"] + [f"  {line}" for line in lines]


def _implementation_note(build: bool) -> str:
    from attnkit import native

    state = native.status(build=build)
    if state.startswith("torch"):
        return "implementation torch (auto: only calls SDPA cannot fuse)"
    return f"implementation {state}"


def _auto_note(name: str, backend, available: bool) -> str:
    """Whether ``backend="auto"`` picks the backend on this machine's devices: "auto", "forced
    only", or per device where auto considers it on some device types only (the registry's
    ``auto_devices``), e.g. "forced only on CPU" for flex on a machine without CUDA."""
    from attnkit.backends import auto_order

    if name not in auto_order():
        return "forced only"
    devices = getattr(backend, "auto_devices", None)  # optional in the backend protocol, as the registry reads it
    if devices is None or not available:
        return "auto"
    here = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    auto = [d.upper() for d in here if d in devices]
    forced = [d.upper() for d in here if d not in devices]
    if not forced:
        return "auto"
    return "; ".join(([f"auto on {', '.join(auto)}"] if auto else []) + [f"forced only on {', '.join(forced)}"])


def cmd_info(args: argparse.Namespace) -> int:
    import attnkit
    from attnkit.backends import auto_order, backend_names, get_backend

    print(f"attnkit {attnkit.__version__}")
    print(f"torch   {torch.__version__}")
    print(f"python  {platform.python_version()}")
    print(f"device  {_device_line()}")
    # Asked first: a build announces itself on stderr, before the tables that depend on it.
    build = not getattr(args, "no_build", False)
    native_lines = _native_lines(build=build)
    print("backends (auto order: " + " > ".join(auto_order()) + "):")
    for name in backend_names():
        backend = get_backend(name)
        why = backend.available()
        impl = f", {_implementation_note(build)}" if name in ("decode", "paged") and why is None else ""
        print(f"  {name:<7} {'available' if why is None else 'unavailable: ' + why}{impl} "
              f"({_auto_note(name, backend, why is None)})")
    for line in native_lines:
        print(line)
    for line in _sdpa_kernel_lines():
        print(line)
    return 0


# ---------------------------------------------------------------------------- demo


def cmd_demo(args: argparse.Namespace) -> int:
    from attnkit.demo import DemoError, run_demo

    try:
        run_demo(args)
    except DemoError as e:
        raise CLIError(str(e)) from None
    except KeyboardInterrupt:
        print("\nattnkit demo: interrupted; no report was written", file=sys.stderr)
        return 130
    return 0


# ---------------------------------------------------------------------------- bench


def benchmarks_dir(given: Path | None = None) -> Path:
    """The ``benchmarks/`` folder of the source checkout attnkit runs from (or ``given``)."""
    import attnkit
    d = given if given is not None else Path(attnkit.__file__).resolve().parents[2] / "benchmarks"
    if not (d / "_common.py").is_file():
        where = f"--dir {given}" if given is not None else f"{d} (next to the attnkit sources)"
        raise CLIError(f"no benchmark suites at {where}: `attnkit bench` runs the scripts of a source "
                       f"checkout's benchmarks/ folder, which an installed wheel does not ship. Clone the "
                       f"repository, `pip install -e '.[bench,viz]'` there, and run it again (or pass --dir).")
    return d


def bench_suites(d: Path) -> dict[str, Path]:
    return {p.stem.removeprefix("bench_"): p for p in sorted(d.glob("bench_*.py"))}


def _first_doc_line(path: Path) -> str:
    import ast
    try:
        doc = ast.get_docstring(ast.parse(path.read_text())) or ""
    except SyntaxError:
        return "(unreadable)"
    return doc.strip().splitlines()[0] if doc.strip() else ""


#: Exit status of a benchmark script that cannot run on this machine (e.g. bench_gpu.py without
#: CUDA): reported as skipped, not failed (the automake convention).
SKIPPED = 77


def _plot(table: Path, png: Path) -> str:
    try:
        from attnkit.viz import plot_benchmark
        return f"chart: {plot_benchmark(table, png)}"
    except ImportError as e:
        return f"chart skipped: {e}"
    except ValueError as e:
        return f"no chart: {e}"


def cmd_bench(args: argparse.Namespace) -> int:
    import os
    import tempfile
    d = benchmarks_dir(args.dir)
    suites = bench_suites(d)
    if not suites:
        raise CLIError(f"{d} has no bench_*.py scripts")
    if args.list:
        for name, path in suites.items():
            print(f"{name:<12} {_first_doc_line(path)}")
        return 0
    chosen = args.suites or list(suites)
    unknown = [s for s in chosen if s not in suites]
    if unknown:
        raise CLIError(f"unknown suite(s) {unknown}; available: {', '.join(suites)}")
    out = (args.out or d / "results").resolve()
    if args.plots_only:  # redraw charts from the result files already there; nothing is timed
        drawn = 0
        for name in chosen:
            stem = f"{name}_quick" if args.quick else name
            table = out / f"{stem}.json"
            if table.is_file():
                print(f"== {name}: {_plot(table, out / f'{stem}.png')}")
                drawn += 1
            else:
                print(f"== {name}: no {table.name} in {out}")
        return 0 if drawn else 1
    failed, skipped = [], []
    for name in chosen:
        cmd = [sys.executable, str(suites[name]), "--out", str(out)] + (["--quick"] if args.quick else [])
        print(f"== {name}: {' '.join(cmd)}", flush=True)
        t0 = time.perf_counter()
        with tempfile.TemporaryDirectory() as tmp:
            note = Path(tmp) / "skip-reason"
            rc = subprocess.run(cmd, cwd=d, env={**os.environ, "ATTNKIT_BENCH_SKIP_FILE": str(note)}).returncode
            reason = note.read_text().strip() if note.is_file() else "this machine lacks what it measures"
        if rc == SKIPPED:
            print(f"== {name}: skipped: {reason}", flush=True)
            skipped.append(name)
            continue
        print(f"== {name}: {'ok' if rc == 0 else f'FAILED (exit {rc})'} in {time.perf_counter() - t0:.0f} s", flush=True)
        if rc:
            failed.append(name)
            continue
        stem = f"{name}_quick" if args.quick else name
        table, png = out / f"{stem}.json", out / f"{stem}.png"
        # Scripts draw their own chart; draw it here for one that did not (or left an older one).
        if not args.no_plots and table.is_file() and (not png.is_file() or png.stat().st_mtime < table.stat().st_mtime):
            print(f"   {_plot(table, png)}")
    if skipped:
        print(f"skipped suites: {', '.join(skipped)}")
    if failed:
        print(f"failed suites: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


# ---------------------------------------------------------------------------- viz


def cmd_viz_masks(args: argparse.Namespace) -> int:
    from attnkit.viz import mask_examples, mask_gallery, plot_mask, require_matplotlib
    try:
        require_matplotlib()
        examples = mask_examples(args.size)
    except (ImportError, ValueError) as e:
        raise CLIError(str(e)) from None
    kinds = args.kind or list(examples)
    unknown = [k for k in kinds if k not in examples]
    if unknown:
        raise CLIError(f"unknown mask kind(s) {unknown}; kinds: {', '.join(examples)}")
    out = args.out
    if out.exists() and not out.is_dir():
        raise CLIError(f"--out {out} is a file; give a folder")
    out.mkdir(parents=True, exist_ok=True)
    if not args.kind:
        print(mask_gallery(out / "mask_gallery.png", size=args.size))
    for k in kinds:
        mask, q, kv, meaning = examples[k]
        print(plot_mask(mask, q, kv, title=meaning, path=out / f"mask_{k}.png"))
    return 0


def _parse_ids(text: str) -> list[int]:
    try:
        ids = [int(t) for t in text.replace(",", " ").split()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"token ids must be integers separated by spaces or commas, got {text!r}")
    if not ids:
        raise argparse.ArgumentTypeError("give at least one token id")
    return ids


def cmd_viz_attention(args: argparse.Namespace) -> int:
    from attnkit.models import load_pretrained
    from attnkit.viz import plot_attention, require_matplotlib
    try:
        require_matplotlib()
        model = load_pretrained(args.checkpoint, dtype=torch.float32)
    except (ImportError, FileNotFoundError, ValueError) as e:
        raise CLIError(str(e)) from None
    V, L = model.config.vocab_size, model.config.num_layers
    bad = [i for i in args.ids if not 0 <= i < V]
    if bad:
        raise CLIError(f"token ids {bad} are outside the vocabulary [0, {V})")
    if not -L <= args.layer < L:
        raise CLIError(f"--layer {args.layer} out of range for {L} layers (use 0..{L - 1} or -1 for the last)")
    layer = args.layer % L
    with torch.inference_mode():
        _, weights = model(torch.tensor([args.ids]), need_weights=True)
    w = weights[layer][0]  # (H, S, S)
    if args.head is not None:
        if not 0 <= args.head < w.shape[0]:
            raise CLIError(f"--head {args.head} out of range for {w.shape[0]} heads")
        w, titles = w[args.head:args.head + 1], [f"head {args.head}"]
    else:
        titles = [f"head {h}" for h in range(w.shape[0])]
    try:
        path = plot_attention(w, args.out, tokens=[str(i) for i in args.ids], head_titles=titles,
                              title=f"{Path(args.checkpoint).name}: layer {layer} attention")
    except ValueError as e:  # --out names a folder or an unknown image format
        raise CLIError(f"--out: {e}") from None
    print(path)
    return 0


# ---------------------------------------------------------------------------- kv


def cmd_kv(args: argparse.Namespace) -> int:
    from attnkit.sizing import run_kv
    for name in ("batch", "layers"):
        v = getattr(args, name)
        if v is not None and v < 1:
            raise CLIError(f"--{name} must be >= 1, got {v}")
    try:
        return run_kv(args)
    except (ValueError, TypeError) as e:
        raise CLIError(str(e)) from None


# ---------------------------------------------------------------------------- generate


def _fmt_bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"


def cmd_generate(args: argparse.Namespace) -> int:
    from attnkit.models.text import TextGenerator, TokenizerNotFound
    if args.temperature < 0:
        raise CLIError(f"--temperature must be >= 0, got {args.temperature}")
    if args.top_p is not None and not 0 < args.top_p <= 1:
        raise CLIError(f"--top-p must be in (0, 1], got {args.top_p}")
    dtype = {"auto": None, "fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
    try:
        gen = TextGenerator(args.folder, dtype=dtype)
        pieces = gen.stream(args.prompt, args.max_new_tokens, chat=args.chat, temperature=args.temperature,
                            top_k=args.top_k, top_p=args.top_p, cache=args.cache, seed=args.seed,
                            kv_dtype=args.kv_dtype)
        for piece in pieces:
            sys.stdout.write(piece)
            sys.stdout.flush()
    except (TokenizerNotFound, FileNotFoundError, ImportError, ValueError, TypeError) as e:
        raise CLIError(str(e)) from None
    except KeyboardInterrupt:
        print("\nattnkit generate: interrupted", file=sys.stderr)
        return 130
    s = gen.stats
    sys.stdout.write("\n")
    print(f"[{s.new_tokens} new tokens ({s.finish_reason}) after a {s.prompt_tokens}-token prompt; "
          f"first token {s.first_token_seconds * 1e3:.0f} ms, then {s.tokens_per_second:.1f} tokens/s; "
          f"KV cache {_fmt_bytes(s.kv_cache_bytes)} ({gen.model.kv_bytes_per_token(kv_dtype=args.kv_dtype)} "
          f"bytes/token, cache={args.cache}{'' if args.kv_dtype is None else ', kv_dtype=' + args.kv_dtype})]",
          file=sys.stderr)
    return 0


# ---------------------------------------------------------------------------- parser


def _positive_int(text: str) -> int:
    """argparse ``type=``: :func:`attnkit._checks.positive_int` of the text, as argparse's error."""
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    try:
        return positive_int("value", v)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {v}") from None


def _kv_dtype_spellings() -> str:
    """What ``--kv-dtype`` takes, as a user types it."""
    from attnkit.kvquant import QUANTIZED_DTYPES, dtype_name
    names = [dtype_name(d) for d in QUANTIZED_DTYPES]
    return ", ".join(["none"] + [f"{n} (or fp8)" if n == "fp8_e4m3" else n for n in names])


def _kv_dtype(text: str) -> str | None:
    """argparse ``type=`` of ``--kv-dtype``: "none" (the model's dtype, None) or a spelling
    :func:`attnkit.kvquant.kv_storage_dtype` takes, returned as the short name ("int8", "fp8_e4m3")."""
    from attnkit.kvquant import dtype_name, kv_storage_dtype
    if text.strip().lower() == "none":
        return None
    try:
        return dtype_name(kv_storage_dtype(text))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected one of {_kv_dtype_spellings()}, got {text!r}") from None


def _nonneg_int(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {text!r}")
    if v < 0:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {v}")
    return v


def build_parser() -> argparse.ArgumentParser:
    import attnkit
    p = argparse.ArgumentParser(prog="attnkit", description="attnkit: attention mechanisms for PyTorch")
    p.add_argument("--version", action="version", version=f"attnkit {attnkit.__version__} (torch {torch.__version__})")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    info = sub.add_parser("info", help="print versions, device, which backends are available and which engine "
                                       "the CPU decode backends run (compiling the native kernel if not built)")
    info.add_argument("--no-build", action="store_true",
                      help="report the native CPU kernel without compiling it")
    info.set_defaults(func=cmd_info)

    from attnkit.demo import add_demo_arguments
    demo = sub.add_parser("demo", help="train MHA/GQA/MQA/MLA decoders on associative recall and compare them",
                          description="Train one small decoder per attention variant (MHA, GQA, MQA, MLA at matched "
                                      "parameter budgets) on a generated multi-query associative recall task; "
                                      "measure recall accuracy, prefill latency, decode tokens/s and KV-cache bytes "
                                      "per token; write a report (markdown, JSON, PNG figures) into a new folder and "
                                      "print the summary table. Needs nothing but attnkit (figures: the viz extra).")
    add_demo_arguments(demo)
    demo.set_defaults(func=cmd_demo)

    bench = sub.add_parser("bench", help="run the benchmark suites of benchmarks/ and write their tables and plots",
                           description="Run benchmarks/bench_<suite>.py scripts of a source checkout (all by "
                                       "default), each writing <suite>.md/.json and its chart <suite>.png "
                                       "(matplotlib). A suite this machine cannot run (no GPU, no transformers, "
                                       "no triton) is reported as 'skipped: needs ...' and does not fail the run.")
    bench.add_argument("suites", nargs="*", metavar="SUITE", help="suites to run (default: all; see --list)")
    bench.add_argument("--quick", action="store_true", help="small sizes (seconds), as CI runs them")
    bench.add_argument("--out", type=Path, default=None, help="folder for tables and plots (default: benchmarks/results)")
    bench.add_argument("--list", action="store_true", help="list the suites and exit")
    bench.add_argument("--no-plots", action="store_true", help="tables only")
    bench.add_argument("--plots-only", action="store_true",
                       help="redraw <suite>.png from the result files in --out (with --quick: the _quick ones); "
                            "runs nothing")
    bench.add_argument("--dir", type=Path, default=None, help="the benchmarks folder (default: the checkout's)")
    bench.set_defaults(func=cmd_bench)

    viz = sub.add_parser("viz", help="draw mask patterns and attention maps to PNG (needs matplotlib)",
                         description="Mask patterns and attention maps to PNG (pip install 'attnkit[viz]').")
    vsub = viz.add_subparsers(dest="viz_command", metavar="WHAT")
    vm = vsub.add_parser("masks", help="the mask gallery and one PNG per mask kind")
    vm.add_argument("--out", type=Path, default=Path("attnkit-masks"), help="output folder (default: attnkit-masks)")
    vm.add_argument("--size", type=int, default=16, help="sequence length of the examples (>= 8; default 16)")
    vm.add_argument("--kind", action="append", help="only this kind (repeatable); default: all and the gallery")
    vm.set_defaults(func=cmd_viz_masks)
    va = vsub.add_parser("attention", help="attention maps of a Hugging Face checkpoint on given token ids")
    va.add_argument("checkpoint", help="a save_pretrained folder (Llama family or dense DeepSeek-V3)")
    va.add_argument("--ids", type=_parse_ids, required=True, help="token ids, e.g. '1 15 27 3'")
    va.add_argument("--layer", type=int, default=-1, help="layer index (negative: from the end; default -1)")
    va.add_argument("--head", type=int, default=None, help="one head (default: every head of the layer)")
    va.add_argument("--out", type=Path, default=Path("attention.png"), help="PNG file (default: attention.png)")
    va.set_defaults(func=cmd_viz_attention)
    viz.set_defaults(func=lambda a: (viz.print_help(), 2)[1])

    from attnkit.sizing import add_kv_arguments
    kv = sub.add_parser("kv", help="KV-cache bytes per token (per layer and per model) for MHA/GQA/MQA/MLA/DSA",
                        description="KV-cache sizes of attention variants: presets of real models or your own "
                                    "specs, e.g. `attnkit kv deepseek-v3 llama-3-8b gqa:heads=32,num_kv_heads=8,"
                                    "head_dim=128,layers=32 --context 128k`; `--select 2048` adds what a decode "
                                    "step reads per layer with a sparse selection of 2048 keys per query, beside "
                                    "the dense read (a DeepSeek-V3.2 layer, `deepseek-v3.2` or `mla:..,index=128`, "
                                    "also caches and reads every key of its indexer).")
    add_kv_arguments(kv)
    kv.set_defaults(func=cmd_kv)

    gen = sub.add_parser("generate", help="generate text from a checkpoint folder with its own tokenizer (streamed)",
                         description="Load FOLDER (a save_pretrained checkpoint: config.json, weights, tokenizer) "
                                     "with attnkit.models.Decoder.from_pretrained and the folder's tokenizer "
                                     "(transformers, or tokenizer.json with pip install 'attnkit[text]'); stream "
                                     "the continuation of --prompt to stdout, then tokens/s and KV-cache bytes to "
                                     "stderr. Nothing is downloaded.")
    gen.add_argument("folder", type=Path, help="checkpoint folder (config.json + safetensors + tokenizer files)")
    gen.add_argument("--prompt", required=True, help="the prompt text")
    gen.add_argument("--max-new-tokens", type=_nonneg_int, default=64, help="new tokens at most (default 64)")
    gen.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default); > 0 samples")
    gen.add_argument("--top-p", type=float, default=None, help="nucleus sampling mass (with --temperature > 0)")
    gen.add_argument("--top-k", type=_positive_int, default=None, help="sample among the k likeliest tokens")
    gen.add_argument("--cache", choices=["dynamic", "static", "paged"], default="dynamic",
                     help="KV cache kind (default dynamic)")
    gen.add_argument("--kv-dtype", type=_kv_dtype, default=None,
                     help=f"store the KV cache quantized: one of {_kv_dtype_spellings()} (fp32 scale per row; "
                          f"default none: the model's dtype)")
    gen.add_argument("--seed", type=int, default=None, help="seed for sampling (same seed, same text)")
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the folder's chat template (one user turn)")
    gen.add_argument("--dtype", choices=["auto", "fp32", "bf16", "fp16"], default="auto",
                     help="model dtype (default: the checkpoint's)")
    gen.set_defaults(func=cmd_generate)
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return args.func(args)
    except CLIError as e:
        print(f"attnkit {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
