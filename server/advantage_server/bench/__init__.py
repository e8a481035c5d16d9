"""``advantage-bench``: how fast the estimators run against the published reference code, the peer and the
memory floor; concurrency; server memory; end to end over gRPC on loopback (pluggable transport rows).

Run ``advantage-bench --help``; ``advantage-bench --quick`` finishes in under a minute. Modules:
:mod:`.run` (the command and its table), :mod:`.references` (the reference loops and the peer),
:mod:`.workloads` (inputs and floor bytes), :mod:`.measure` (timing, bandwidth, RSS),
:mod:`.transports` (the e2e rows; add yours there), :mod:`.serve` and :mod:`.memprobe` (helper processes).
"""
from __future__ import annotations


def main(argv=None) -> None:
    """The ``advantage-bench`` command (exit status 0; :func:`advantage_server.bench.run.main` returns the report).

    The flags are parsed first (:mod:`.options`, no torch): a bad one exits 2, and ``--help`` exits 0, at once."""
    from advantage_server.bench.options import build_parser

    build_parser().parse_args(argv)
    from advantage_server.bench.run import main as _main
    _main(argv)


__all__ = ["main"]
