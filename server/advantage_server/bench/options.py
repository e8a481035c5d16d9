"""``advantage-bench``'s flags and the constants they name: no torch, numba or client import, so that a bad flag
and ``--help`` are answered at once (:func:`advantage_server.bench.main` parses them before it imports
:mod:`.run`). :mod:`.run`, :mod:`.groups` and :mod:`.workloads` re-export the constants.
"""
from __future__ import annotations

import argparse

from advantage_server.cli import FlagParser  # two-line errors, did you mean (no torch: cli imports none)

DESCRIPTION = """``advantage-bench``: the estimator kernels against the published reference code, the vectorized peer
and the memory floor; concurrency; server memory per request; end to end over gRPC on loopback."""
DEFAULT_SIZES = "256x1024x8,1024x4096x16,512x8192x8"
DEFAULT_GROUP_SIZES = "65536x1x8,65536x64x8,65536x256x8"
QUICK_SIZES = "64x256x8,256x1024x8"
QUICK_GROUP_SIZES = "8192x16x8"
GROUP_ESTIMATORS = ("grpo", "gdpo", "reinforce_plus_plus", "opd")
SECTIONS = ("kernel", "concurrency", "memory", "e2e", "groups", "cold-start", "adversarial")
#: sections run only when named in --sections (cold-start: three server starts, one compiling for ~20 s;
#: adversarial: a server, attackers and a network namespace, ~9 min with its default 5 rounds: 9 rows of 4 s windows
#: attacked and alone, 2 s apart)
OPT_IN_SECTIONS = ("cold-start", "adversarial")
#: adversarial section: the attacks of the default run (issue #35's target), and the opt-in ones
#: (``--adversarial-attacks``: a heavy legitimate host); :mod:`.adversarial` defines each
ADVERSARIAL_ATTACKS = ("slow-loris", "slow-loris-fresh", "stalled-uploader", "watch-flood", "tokenless-flood",
                       "shm-churn", "unread-results", "idle-connections")
ADVERSARIAL_HEAVY = ("bulk-requests",)


def attack_list(text: str) -> tuple[str, ...]:
    """``--adversarial-attacks``: comma-separated names of :data:`ADVERSARIAL_ATTACKS` and
    :data:`ADVERSARIAL_HEAVY` (``all``: the default run's; ``none``: no attack, the control row alone, which every
    run begins with); an unknown one is an argparse error naming them."""
    names = tuple(n.strip() for n in text.split(",") if n.strip())
    known = ADVERSARIAL_ATTACKS + ADVERSARIAL_HEAVY
    unknown = [n for n in names if n not in known and n not in ("all", "none")]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"{', '.join(unknown) or repr(text)}: not an attack; choose from all, "
                                         f"{', '.join(known)} (comma-separated), or none (the control row alone)")
    return tuple(dict.fromkeys(a for n in names if n != "none"
                               for a in (ADVERSARIAL_ATTACKS if n == "all" else (n,))))


#: estimator -> its config (the estimator's defaults, NeMo RL semantics)
CONFIGS: dict[str, dict] = {
    "gae": {"gae_gamma": 1.0, "gae_lambda": 0.95},
    "grpo": {},
    "gdpo": {},
    "reinforce_plus_plus": {},
    "opd": {},
}
ESTIMATORS = tuple(CONFIGS)
#: groups section: T values of the one group per call, and numbers of concurrent callers
DEFAULT_TOKENS = (1024, 8192)
QUICK_TOKENS = (1024,)
DEFAULT_CALLERS = (1, 4, 16, 64)
QUICK_CALLERS = (1, 16)


def build_parser() -> argparse.ArgumentParser:
    # Each help text states its default once (no ArgumentDefaultsHelpFormatter: most defaults depend on --quick
    # or --sizes, and it would print "(default: None)" after them).
    ap = FlagParser(prog="advantage-bench", description=DESCRIPTION)
    ap.add_argument("--quick", action="store_true", help=f"small sizes ({QUICK_SIZES}; groups {QUICK_GROUP_SIZES}), "
                    "3 repeats, no transport-size row: under a minute")
    ap.add_argument("--sizes", default=None,
                    help=f"BxTxG list for every estimator and every section (default {DEFAULT_SIZES}; quick "
                         f"{QUICK_SIZES}); given alone, it is the only sizes run: no group sizes (unless "
                         "--group-sizes) and no transport-size row (unless --transport-mib)")
    ap.add_argument("--group-sizes", default=None,
                    help=f"BxTxG list for the group estimators and OPD only (default {DEFAULT_GROUP_SIZES}; quick "
                         f"{QUICK_GROUP_SIZES}; none when --sizes is given)")
    ap.add_argument("--estimators", default=",".join(ESTIMATORS),
                    help=f"comma-separated estimators to measure (default all: {','.join(ESTIMATORS)})")
    ap.add_argument("--sections", default=",".join(s for s in SECTIONS if s not in OPT_IN_SECTIONS),
                    help="comma-separated sections to run (default all but "
                         f"{','.join(OPT_IN_SECTIONS)}: {','.join(SECTIONS)})")
    ap.add_argument("--repeats", type=int, default=None, help="timed runs per kernel row (default 9; quick 3)")
    ap.add_argument("--ref-repeats", type=int, default=3,
                    help="timed runs per reference-loop row (default 3; quick at most 2)")
    ap.add_argument("--ref-budget", type=float, default=10.0,
                    help="seconds of timed runs per reference row, at least 1 run (default 10; quick at most 2)")
    ap.add_argument("--no-refs", action="store_true", help="skip the slow reference loops")
    ap.add_argument("--group-refs", choices=("first", "all", "none"), default="first",
                    help="reference loops at the group sizes: the first one only (the default: each run takes "
                         "tens of seconds at B = 65536), all, or none")
    ap.add_argument("--callers", type=int, default=8, help="concurrent in-process callers (default 8)")
    ap.add_argument("--concurrency-seconds", type=float, default=None,
                    help="seconds of work per concurrency measurement (default 2; quick 0.5)")
    ap.add_argument("--transports", default=None, help="e2e transport rows by name (default: all registered)")
    ap.add_argument("--transport-mib", type=int, default=None,
                    help="extra e2e row with a GAE request of about this many MiB, 0 = none (default 256; "
                         "0 with --quick or --sizes)")
    ap.add_argument("--big-mib", type=int, default=0,
                    help="instead of the other e2e rows, one GAE request of about this many MiB through "
                         "grpc-stream only (float32 mask and values, as big as the response), timed once with "
                         "both processes' peak RSS; e.g. --sections e2e --estimators gae --big-mib 4096 "
                         "(default 0 = off)")
    ap.add_argument("--torch-threads", type=int, default=None,
                    help="torch.set_num_threads before measuring (default: torch's own choice)")
    ap.add_argument("--device", default="cpu",
                    help="where the kernel section runs: cpu (the default), or cuda / cuda:N (inputs created on "
                         "the GPU, CUDA-synchronised timing, the floor a device-to-device copy of the same bytes; "
                         "kernel section only; see scripts/gpu_bench.sh)")
    ap.add_argument("--thp", action="store_true",
                    help="run with THP_MEM_ALLOC_ENABLE=1 (torch backs allocations >= 2 MiB with transparent huge "
                         "pages: far fewer page faults for fresh outputs > 32 MiB, which glibc always maps anew); "
                         "the bench re-executes itself so the setting reaches torch, its server and its probes")
    def ints(values: tuple[int, ...]) -> str:
        return ",".join(map(str, values))
    ap.add_argument("--group-tokens", default=None,
                    help="groups section: T values of the one group of 16 per call (default "
                         f"{ints(DEFAULT_TOKENS)}; quick {ints(QUICK_TOKENS)})")
    ap.add_argument("--group-callers", default=None,
                    help="groups section: numbers of concurrent callers (default "
                         f"{ints(DEFAULT_CALLERS)}; quick {ints(QUICK_CALLERS)})")
    ap.add_argument("--group-seconds", type=float, default=None,
                    help="groups section: about this many seconds of calls per row and caller count "
                         "(default 1; quick 0.25)")
    ap.add_argument("--adversarial-clients", type=int, default=4,
                    help="adversarial section: legitimate AdvantageClient objects per place (default 4)")
    ap.add_argument("--adversarial-seconds", type=float, default=None,
                    help="adversarial section: seconds per window, each attack one window without and one with "
                         "(default 4; quick 2)")
    ap.add_argument("--adversarial-rounds", type=int, default=None,
                    help="adversarial section: times the sequence of windows runs; each figure pools the calls of "
                         "every round and the table shows each round's own (default 5; quick 1)")
    ap.add_argument("--adversarial-attacks", type=attack_list, default=ADVERSARIAL_ATTACKS, metavar="LIST",
                    help="adversarial section: the attacks to run, comma-separated (default all: "
                         f"{', '.join(ADVERSARIAL_ATTACKS)}; opt-in: {', '.join(ADVERSARIAL_HEAVY)}, a heavy "
                         "legitimate host sending valid 16 MiB requests; none: the control row alone, which "
                         "always runs first)")
    ap.add_argument("--adversarial-pin", action=argparse.BooleanOptionalAction, default=True,
                    help="adversarial section: run the attacker on the last CPU and the server and the legitimate "
                         "clients on the others, so the attacker brings its own CPU as one on another machine does "
                         "and the fraction measures what its traffic costs the server (default on; needs 2 CPUs or "
                         "more; --no-adversarial-pin: everything shares every CPU, and on a small machine the "
                         "attacker's own CPU then takes from the clients)")
    ap.add_argument("--json", default=None, metavar="FILE", help="also write the report as JSON to FILE")
    ap.add_argument("--plot", default=None, metavar="PNG",
                    help="also plot the table to this PNG (one bar chart per section; needs matplotlib)")
    return ap
