"""Runnable demos of the advantage service: ``advantage-demo cartpole`` and ``advantage-demo lm``."""
from __future__ import annotations

import sys

USAGE = """usage: advantage-demo DEMO [options]

demos:
  cartpole   PPO on gymnasium CartPole-v1 with the service's GAE (needs the demo extra: gymnasium)
  lm         a small transformer learns multi-digit addition with the service's group estimators
             (GRPO, RLOO, REINFORCE++-baseline, GDPO, GRPO pass@k, OPD)

advantage-demo DEMO --help lists a demo's options."""


def main(argv: list[str] | None = None) -> int:
    """``advantage-demo DEMO [options]``: run the named demo (imported only when asked for, so that ``lm``
    needs no gymnasium); returns the exit code."""
    argv = sys.argv[1:] if argv is None else list(argv)
    demo = argv[0] if argv else None
    if demo == "cartpole":
        from advantage_server.demo.cartpole import main as run
        return run(argv)
    if demo == "lm":
        from advantage_server.demo.lm import main as run
        return run(argv)
    if demo in ("-h", "--help"):
        print(USAGE)
        return 0
    print(USAGE, file=sys.stderr)
    if demo is not None:
        print(f"advantage-demo: unknown demo {demo!r}", file=sys.stderr)
    return 2
