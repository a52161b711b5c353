"""The `sluice` console script: `sluice serve [flags]` and `sluice bench ...`.

`serve` takes exactly the flags `config.cli.build_serve_parser` generates from the
settings schema (SGLang's names). `bench` is registered by `bench.cli` when that
package is present.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence

from config import SettingsError
from config.cli import build_serve_parser, settings_from_args


def _serve(ns: argparse.Namespace) -> int:
    from app.logs import configure_logging
    from app.server import run

    try:
        engine_settings, server_settings = settings_from_args(ns)
    except (SettingsError, OSError, ValueError) as exc:
        print(f"sluice serve: error: {exc}", file=sys.stderr)
        return 2
    configure_logging(server_settings.log_level)
    if engine_settings.node_rank > 0:  # tensor-parallel ranks only; node 0 serves HTTP
        from runtime.distributed.launcher import run_worker_node

        return run_worker_node(engine_settings)
    try:
        return run(engine_settings, server_settings)
    except OSError as exc:  # e.g. the port is taken: fail before loading anything
        print(f"sluice serve: error: cannot listen on {server_settings.host}:{server_settings.port}: {exc}", file=sys.stderr)
        return 1


def _prepare(ns: argparse.Namespace) -> int:
    """Do once what the first `serve` would: convert the embedded GGUF and build the
    CPU kernel, so a later start only loads (make install and the image run this)."""
    from app.logs import configure_logging
    from kernels.cpu import load_paged_decode
    from runtime.model_executor.model_loader import gguf_source, prepare_model_dir
    from runtime.model_executor.weight_utils import gguf_tensor_table

    configure_logging("info")
    model_dir = prepare_model_dir(None, "auto")
    source = gguf_source(model_dir)
    if source is not None:  # the GGUF header's tensor table, which `serve` reads instead of the header
        gguf_tensor_table(source)
    print(f"model: {model_dir}")
    print(f"CPU paged-decode kernel: {'ready' if load_paged_decode() is not None else 'unavailable (torch fallback)'}")
    return 0


def _bench_unavailable(reason: str) -> Callable[[argparse.Namespace], int]:
    def run(ns: argparse.Namespace) -> int:
        print(f"sluice bench: unavailable ({reason})", file=sys.stderr)
        return 2

    return run


def _add_bench(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """`bench` comes from bench.cli; a missing or broken bench never breaks `serve`."""
    try:
        from bench.cli import register

        register(subparsers)
        return
    except ImportError as exc:
        reason = f"the bench package is not installed in this build: {exc}"
    except Exception as exc:  # noqa: BLE001 - a broken tool module must not take `serve` down
        reason = f"bench failed to load: {type(exc).__name__}: {exc}"
    bench = subparsers.choices.get("bench") or subparsers.add_parser("bench", help="Benchmarks (unavailable).")
    bench.add_argument("bench_args", nargs=argparse.REMAINDER)
    bench.set_defaults(func=_bench_unavailable(reason))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="sluice", description="sluice: an LLM inference server.")
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="{serve,prepare,bench}")
    serve = subparsers.add_parser("serve", help="Serve a model over an OpenAI-compatible HTTP API.")
    build_serve_parser(serve)
    serve.set_defaults(func=_serve)
    prepare = subparsers.add_parser("prepare", help="Convert the embedded model and build the CPU kernel once.")
    prepare.set_defaults(func=_prepare)
    _add_bench(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    ns = parser.parse_args(argv)
    func = ns.func
    return int(func(ns) or 0)


if __name__ == "__main__":
    sys.exit(main())
