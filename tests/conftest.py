"""Shared fixtures: one real server on an ephemeral loopback port, and clients connected to it."""
from __future__ import annotations

import json
import math
import os
import pathlib

import numpy as np
import pytest

from advantage_client import AdvantageClient
from advantage_server import create_server

ROOT = pathlib.Path(__file__).resolve().parent.parent

# The `advantage-server` processes the suite starts (and Ray replicas) report SERVING without compiling every
# kernel first (about 2-5 s with numba's cache filled, 30 s and more with it empty, per start): the suite's
# own servers compile on first use instead. tests/test_warmup.py turns warm-up back on where it is the subject.
os.environ.setdefault("ADVANTAGE_WARMUP", "0")
# Every Ray cluster the suite starts (tests/test_ray.py's `ray start --head`, a `ray.init()` that starts one, and the
# processes either starts) stays on 127.0.0.1. On Linux Ray otherwise swaps 127.0.0.1 (and `localhost`) for the
# address it would give other nodes, the host's own (ray._private.services.resolve_ip_for_localhost), and its
# processes talk over that; a test's traffic stays on loopback or in network namespaces it makes itself. Set here,
# before any test module imports Ray (its constants read the variable at import); tests/test_ray.py's
# test_the_cluster_stays_on_loopback fails without it. tests/installed/ sets it in each module that starts Ray.
os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
#: The golden vectors live in the repository (tests/golden/, copied from the references' runs; format in its
#: README). ADVANTAGE_GOLDEN_DIR points the suite at another copy (e.g. a newer drop of the same format).
GOLDEN = pathlib.Path(os.environ.get("ADVANTAGE_GOLDEN_DIR", ROOT / "tests" / "golden"))


@pytest.fixture(scope="session")
def server():
    srv = create_server("127.0.0.1", 0, device=os.environ.get("ADVANTAGE_TEST_DEVICE", "cpu")).start()
    yield srv
    srv.stop(grace=1.0)


@pytest.fixture
def make_server():
    """Factory for extra in-process servers with their own options (limits, TLS, token), stopped after the test."""
    servers = []

    def make(**kwargs):
        srv = create_server("127.0.0.1", 0, device="cpu", **kwargs).start()
        servers.append(srv)
        return srv
    yield make
    for srv in servers:
        srv.stop(grace=2.0)


@pytest.fixture(scope="session")
def target(server) -> str:
    return server.address


@pytest.fixture(scope="session")
def client(target):
    with AdvantageClient(target, timeout=30.0) as c:
        yield c


def _decode(value):
    if isinstance(value, str) and value in ("NaN", "Infinity", "-Infinity"):
        return {"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf}[value]
    if isinstance(value, list):
        return [_decode(v) for v in value]
    if isinstance(value, dict):
        return {k: _decode(v) for k, v in value.items()}
    return value


class GoldenDataMissing(RuntimeError):
    """Raised at collection when a golden suite would collect no case: an empty or missing golden directory
    is an error of the run (pytest exits non-zero), never a suite that silently passes with nothing in it."""


def golden_cases(source: str) -> list[pathlib.Path]:
    """The golden case files of ``source`` (``nemo-rl``, ``verl``), sorted by name.

    Raises GoldenDataMissing when there are none, so that every module that parametrizes over them fails
    to collect (tests/test_golden_data.py proves it on an emptied copy)."""
    cases = sorted((GOLDEN / source).glob("*.json"))
    if not cases:
        raise GoldenDataMissing(f"no golden cases in {GOLDEN / source}: the golden vectors live in the repository "
                                "(tests/golden/); restore them (git checkout -- tests/golden) or point "
                                "ADVANTAGE_GOLDEN_DIR at a copy")
    return cases


def load_case(path: pathlib.Path) -> dict:
    return _decode(json.loads(path.read_text()))


def assert_close_to_golden(got, case: dict, key: str) -> None:
    """Element-wise |got - exp| <= 1e-5 + 1e-4 |exp| over the whole tensor, against `expected` or,
    where the case has it, `expected_f64`. Positions where the reference is non-finite are skipped
    (the reference divided by zero there), but ours must be finite."""
    got = np.asarray(got, dtype=np.float64)
    assert np.isfinite(got).all(), f"{key}: non-finite output"
    failures = []
    for variant in ("expected", "expected_f64"):
        if variant not in case or case[variant].get(key) is None:
            continue
        exp = np.asarray(case[variant][key], dtype=np.float64)
        assert got.shape == exp.shape, f"{key}: shape {got.shape} != {exp.shape}"
        ok = ~np.isfinite(exp) | (np.abs(got - exp) <= 1e-5 + 1e-4 * np.abs(exp))
        if ok.all():
            return
        bad = np.argwhere(~ok)[:5].tolist()
        failures.append(f"{variant}: {int((~ok).sum())} positions differ, e.g. {bad}: "
                        f"got {[got[tuple(i)] for i in bad]} want {[exp[tuple(i)] for i in bad]}")
    raise AssertionError(f"{case['id']} {key}: " + " | ".join(failures))


def pytest_configure(config):
    """TRL's released trainer modules for the differential tests (tests/references/trl_ref.py: imported against
    stubs of transformers and accelerate), imported before any test module imports the real transformers: after
    the real one (tests/test_trl_trainer.py, or a module collected earlier), its leftover modules make the stubbed
    import fail (``No module named 'huggingface_hub.utils._telemetry'``), whatever the order pytest-xdist gives a
    worker's files. About 1.5 s per process, where TRL is installed."""
    import importlib.util
    if importlib.util.find_spec("trl") is not None:
        from references import trl_ref
        for trainer in ("grpo", "rloo"):
            trl_ref.load(trainer)


def pytest_terminal_summary(terminalreporter):
    """One ``differential batches tried: <name>: <n>`` line per differential test (tests/references/counts.py)."""
    from references.counts import TRIED
    for name in sorted(TRIED):
        terminalreporter.write_line(f"differential batches tried: {name}: {TRIED[name]}")


def pytest_sessionfinish(session):
    """Under pytest-xdist (``make test``'s three workers) a worker hands its counts to the controller, which prints
    the summary (:func:`pytest_testnodedown` adds them up)."""
    workeroutput = getattr(session.config, "workeroutput", None)
    if workeroutput is not None:
        from references.counts import TRIED
        workeroutput["differential_batches_tried"] = dict(TRIED)


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error):
    """pytest-xdist's controller: add a finished worker's differential counts to this process's."""
    from references.counts import TRIED
    for name, n in getattr(node, "workeroutput", {}).get("differential_batches_tried", {}).items():
        TRIED[name] += n
