"""The ``attnkit`` command. ``attnkit info``: versions, device, and every backend's availability."""

from __future__ import annotations

import argparse
import platform
import sys

import torch


def _device_line() -> str:
    if torch.cuda.is_available():
        names = ", ".join(torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count()))
        return f"cuda ({names})"
    return f"cpu ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)"


def cmd_info(args: argparse.Namespace) -> int:
    import attnkit
    from attnkit.backends import auto_order, backend_names, get_backend

    print(f"attnkit {attnkit.__version__}")
    print(f"torch   {torch.__version__}")
    print(f"python  {platform.python_version()}")
    print(f"device  {_device_line()}")
    print("backends (auto order: " + " > ".join(auto_order()) + "):")
    for name in backend_names():
        why = get_backend(name).available()
        auto = "auto" if name in auto_order() else "forced only"
        print(f"  {name:<7} {'available' if why is None else 'unavailable: ' + why} ({auto})")
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="attnkit", description="attnkit: attention mechanisms for PyTorch")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    info = sub.add_parser("info", help="print versions, device and which backends are available")
    info.set_defaults(func=cmd_info)
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
