"""Peak server memory for one request, in a fresh process (nothing freed earlier to hide allocations):
``python -m advantage_server.bench.memprobe ESTIMATOR B T G`` builds the request message as the client
would, then runs ``AdvantageCore.compute`` on it (decode, validate, compute, encode the response) and
prints one JSON line: the request payload bytes and the peak RSS above the RSS before the call."""
from __future__ import annotations

import json
import sys


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    estimator, B, T, G = argv[0], int(argv[1]), int(argv[2]), int(argv[3])
    from advantage_client.client import build_request
    from advantage_server.bench import workloads
    from advantage_server.bench.measure import peak_bytes, reset_peak, rss_bytes
    from advantage_server.core import AdvantageCore

    core = AdvantageCore("cpu")
    config, tensors = workloads.inputs(estimator, B, T, G, seed=1)
    # warm up on a small batch (numba kernels loaded, allocator primed) so the peak is the batch's own
    small_config, small = workloads.inputs(estimator, 8, 16, min(G, 4), seed=2)
    core.compute(build_request(estimator, small_config, None, None, **small))
    request = build_request(estimator, config, None, None, **tensors)
    payload = sum(len(t.data) for t in request.inputs.values())
    del tensors
    before = rss_bytes()
    ok = reset_peak()
    reply = core.compute(request)
    peak = peak_bytes()
    response = len(reply.advantages.data) + (len(reply.returns.data) if reply.HasField("returns") else 0)
    print(json.dumps({"payload": payload, "response": response, "extra": (peak - before) if ok else None}))


if __name__ == "__main__":
    main()
