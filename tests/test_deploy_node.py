"""examples/node: the Node.js client (@grpc/grpc-js + @grpc/proto-loader on the published .proto) passes the NeMo RL
golden cases against a real server, with a bearer token and the request id echoed, and fails on a wrong value.

Needs `node` (skipped only where it is missing) and the example's packages: `make setup` runs `npm ci` there; this
test runs it itself when node_modules is missing."""
from __future__ import annotations

import json
import os
import pathlib
import shutil
import subprocess

import pytest

from advantage_server import create_server

from conftest import GOLDEN, golden_cases

ROOT = pathlib.Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "node"
NODE = shutil.which("node")
pytestmark = pytest.mark.skipif(NODE is None, reason="node is not installed")
TOKEN = "node-example-token"


@pytest.fixture(scope="module")
def node_modules():
    if not (EXAMPLE / "node_modules" / "@grpc" / "grpc-js").is_dir():
        npm = shutil.which("npm")
        assert npm, "examples/node needs its packages: run `npm ci` in examples/node (make setup does)"
        proc = subprocess.run([npm, "ci", "--ignore-scripts", "--no-audit", "--no-fund"], cwd=EXAMPLE,
                              capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, f"npm ci failed:\n{proc.stdout}\n{proc.stderr}"
    return EXAMPLE / "node_modules"


@pytest.fixture(scope="module")
def token_server(tmp_path_factory):
    srv = create_server("127.0.0.1", 0, device=os.environ.get("ADVANTAGE_TEST_DEVICE", "cpu"), auth_token=TOKEN)
    srv.start()
    token_file = tmp_path_factory.mktemp("node") / "token"
    token_file.write_text(TOKEN + "\n")
    yield srv, token_file
    srv.stop(grace=1.0)


def golden_js(target: str, token_file: pathlib.Path, golden_dir: pathlib.Path, *extra: str):
    return subprocess.run([NODE, "golden.js", "--target", target, "--token-file", str(token_file), *extra],
                          cwd=EXAMPLE, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "ADVANTAGE_GOLDEN_DIR": str(golden_dir)})


def test_node_client_passes_the_nemo_golden_cases(node_modules, token_server):
    srv, token_file = token_server
    cases = golden_cases("nemo-rl")
    assert cases, f"no golden cases under {GOLDEN}"
    proc = golden_js(srv.address, token_file, GOLDEN)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"node golden: {len(cases)} passed, 0 failed" in proc.stdout, proc.stdout
    estimators = {json.loads(p.read_text())["estimator"] for p in cases}
    assert estimators == {"grpo", "gdpo", "reinforce_plus_plus", "raw_reward", "gae", "opd"}


def test_node_client_reports_a_wrong_value(node_modules, token_server, tmp_path):
    srv, token_file = token_server
    source = GOLDEN / "nemo-rl" / "nemo-rl-gae-kl-k1-holes.json"
    case = json.loads(source.read_text())
    case.pop("expected_f64", None)
    case["expected"]["returns"][1][3] += 0.01
    (tmp_path / "nemo-rl").mkdir()
    (tmp_path / "nemo-rl" / source.name).write_text(json.dumps(case))
    proc = golden_js(srv.address, token_file, tmp_path)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert f"FAIL {case['id']}: returns" in proc.stdout and "0 passed, 1 failed" in proc.stdout, proc.stdout


def test_node_client_without_the_token_is_refused(node_modules, token_server, tmp_path):
    srv, _ = token_server
    wrong = tmp_path / "wrong"
    wrong.write_text("not-the-token")
    proc = golden_js(srv.address, wrong, GOLDEN, "--cases", "nemo-rl-opd-tiny1")
    assert proc.returncode != 0
    assert "UNAUTHENTICATED" in proc.stdout + proc.stderr or "gRPC status 16" in proc.stdout + proc.stderr, \
        proc.stdout + proc.stderr
