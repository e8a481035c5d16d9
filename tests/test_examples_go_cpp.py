"""examples/go and examples/cpp: each is built from proto/ (stubs generated at test time, into a temporary
directory, by examples/*/build.sh), the one-call example prints the advantages the Python client gets for the
same request, and the golden runner passes every NeMo RL golden case against a real server with a bearer token
(and fails on a wrong value). The README's Go and C++ blocks are these files, and its grpcurl lines run against
a real server.

Toolchains: Debian 12's packages, which .ci/run installs (golang-go, protoc-gen-go, protoc-gen-go-grpc,
golang-google-grpc-dev, golang-github-golang-protobuf-1-5-dev; g++, libgrpc++-dev, protobuf-compiler-grpc).
Each language is skipped, with the reason, where its toolchain is missing. grpcurl is not packaged for Debian 12:
its test runs only where a grpcurl is on PATH."""
from __future__ import annotations

import json
import os
import pathlib
import re
import shlex
import shutil
import subprocess

import numpy as np
import pytest

from advantage_client import AdvantageClient
from advantage_server import create_server

from conftest import GOLDEN, golden_cases

ROOT = pathlib.Path(__file__).resolve().parent.parent
README = ROOT / "README.md"  # or the docs/ page its "From other languages" moved to
GO_EXAMPLE, CPP_EXAMPLE = ROOT / "examples" / "go", ROOT / "examples" / "cpp"
TOKEN = "go-cpp-example-token"
GO_PACKAGES = pathlib.Path("/usr/share/gocode/src")


def missing(*tools: str, paths: tuple[pathlib.Path, ...] = ()) -> str | None:
    absent = [t for t in tools if shutil.which(t) is None] + [str(p) for p in paths if not p.exists()]
    return f"not installed: {', '.join(absent)} (.ci/run's apt-get line installs them)" if absent else None


GO_MISSING = missing("go", "protoc", "protoc-gen-go", "protoc-gen-go-grpc",
                     paths=(GO_PACKAGES / "google.golang.org" / "grpc", GO_PACKAGES / "google.golang.org" / "protobuf"))
CPP_MISSING = missing("g++", "pkg-config", "protoc", "grpc_cpp_plugin",
                      paths=(pathlib.Path("/usr/include/grpcpp/grpcpp.h"),))
GRPCURL = shutil.which("grpcurl")
STEP_INPUTS = dict(prompt_ids=np.array([0, 0, 1, 1]), rewards=np.array([1, 0, 0.5, 0.5], np.float32),
                   mask=np.ones((4, 3), np.float32))


def other_languages() -> str:
    """The README's "From other languages" section: in README.md, or in the docs/ page it moved to (the one
    markdown file that shows examples/go/build.sh), from that heading to the next of its level."""
    pages = [p for p in [README, *sorted((ROOT / "docs").rglob("*.md"))] if "examples/go/build.sh" in p.read_text()]
    assert len(pages) == 1, f"the Go example's build line should be shown once, in one page: {pages}"
    text = pages[0].read_text()
    heading = re.search(r"^(#+) From other languages\s*$", text, re.M | re.I)
    if heading is None:
        return text
    end = re.search(rf"^#{{1,{len(heading[1])}}} ", text[heading.end():], re.M)
    return text[heading.start():heading.end() + end.start()] if end else text[heading.start():]


def block(language: str) -> str:
    blocks = re.findall(rf"^```{language}\n(.*?)^```$", other_languages(), re.S | re.M)
    assert len(blocks) == 1, f"README's From other languages: {len(blocks)} ```{language} blocks"
    return blocks[0]


def test_readme_shows_the_go_and_cpp_examples_that_are_built_and_run():
    assert block("go") == (GO_EXAMPLE / "step" / "main.go").read_text()
    assert block("cpp") == (CPP_EXAMPLE / "step.cc").read_text()
    section = other_languages()
    assert "examples/go/build.sh" in section and "examples/cpp/build.sh" in section


@pytest.fixture(scope="module")
def token_server(tmp_path_factory):
    srv = create_server("127.0.0.1", 0, device=os.environ.get("ADVANTAGE_TEST_DEVICE", "cpu"), auth_token=TOKEN)
    srv.start()
    token_file = tmp_path_factory.mktemp("token") / "token"
    token_file.write_text(TOKEN + "\n")
    yield srv, token_file
    srv.stop(grace=1.0)


@pytest.fixture(scope="module")
def python_step(server) -> np.ndarray:
    """What the Python client gets for the step examples' request."""
    with AdvantageClient(server.address, timeout=30.0) as client:
        result = client.compute("grpo", config={"normalize_rewards": True}, **STEP_INPUTS)
    return np.asarray(result.advantages, np.float64)


def build(example: pathlib.Path, out: pathlib.Path) -> None:
    proc = subprocess.run(["bash", str(example / "build.sh"), str(out)], capture_output=True, text=True,
                          timeout=900, env={**os.environ, "GOPROXY": "off"})
    assert proc.returncode == 0, f"{example.name}/build.sh failed:\n{proc.stdout}\n{proc.stderr}"


def run(*argv, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([str(a) for a in argv], capture_output=True, text=True, timeout=timeout)


def wrong_case_dir(tmp_path: pathlib.Path) -> tuple[pathlib.Path, str]:
    """A golden directory with one case whose expected returns are off by 0.01 at one position."""
    source = GOLDEN / "nemo-rl" / "nemo-rl-gae-kl-k1-holes.json"
    case = json.loads(source.read_text())
    case.pop("expected_f64", None)
    case["expected"]["returns"][1][3] += 0.01
    (tmp_path / "wrong" / "nemo-rl").mkdir(parents=True)
    (tmp_path / "wrong" / "nemo-rl" / source.name).write_text(json.dumps(case))
    return tmp_path / "wrong", case["id"]


def step_values(stdout: str) -> tuple[str, list[int], np.ndarray]:
    """'<request id> [4 3] v v v ...' from either step example (Go prints brackets, C++ commas)."""
    match = re.fullmatch(r"\[?(\S+?)\]? \[(\d+)[ ,]+(\d+)\] ?\[?([^\]]*)\]?\s*", stdout)
    assert match, stdout
    return match[1], [int(match[2]), int(match[3])], np.array(match[4].split(), np.float64)


# ------------------------------------------------------------------------------------------------ Go
@pytest.fixture(scope="module")
def go_bin(tmp_path_factory) -> pathlib.Path:
    if GO_MISSING:
        pytest.skip(f"Go example: {GO_MISSING}")
    out = tmp_path_factory.mktemp("go")
    build(GO_EXAMPLE, out)
    return out / "bin"


def test_go_step_example_gets_what_the_python_client_gets(go_bin, server, python_step):
    proc = run(go_bin / "step", "--target", server.address)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    request_id, shape, values = step_values(proc.stdout)
    assert request_id == "step-42" and shape == [4, 3]
    np.testing.assert_allclose(values.reshape(shape), python_step, rtol=1e-6, atol=1e-7)


def test_go_client_passes_the_nemo_golden_cases(go_bin, token_server):
    srv, token_file = token_server
    cases = golden_cases("nemo-rl")
    proc = run(go_bin / "golden", "--target", srv.address, "--golden-dir", GOLDEN, "--token-file", token_file)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"go golden: {len(cases)} passed, 0 failed" in proc.stdout, proc.stdout
    assert proc.stdout.count("\nok   ") + proc.stdout.startswith("ok   ") == len(cases)


def test_go_client_reports_a_wrong_value_and_a_missing_token(go_bin, token_server, tmp_path):
    srv, token_file = token_server
    golden, case_id = wrong_case_dir(tmp_path)
    proc = run(go_bin / "golden", "--target", srv.address, "--golden-dir", golden, "--token-file", token_file)
    assert proc.returncode == 1 and f"FAIL {case_id}: returns" in proc.stdout, proc.stdout + proc.stderr
    assert "go golden: 0 passed, 1 failed" in proc.stdout
    proc = run(go_bin / "golden", "--target", srv.address, "--golden-dir", GOLDEN)
    assert proc.returncode != 0 and "Unauthenticated" in proc.stdout + proc.stderr, proc.stdout + proc.stderr


# ----------------------------------------------------------------------------------------------- C++
@pytest.fixture(scope="module")
def cpp_bin(tmp_path_factory) -> pathlib.Path:
    if CPP_MISSING:
        pytest.skip(f"C++ example: {CPP_MISSING}")
    out = tmp_path_factory.mktemp("cpp")
    build(CPP_EXAMPLE, out)
    return out


def test_cpp_step_example_gets_what_the_python_client_gets(cpp_bin, server, python_step):
    proc = run(cpp_bin / "step", server.address)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    request_id, shape, values = step_values(proc.stdout)
    assert request_id == "step-42" and shape == [4, 3]
    np.testing.assert_allclose(values.reshape(shape), python_step, rtol=1e-5, atol=1e-6)  # printed to 6 digits


def test_cpp_client_passes_the_nemo_golden_cases(cpp_bin, token_server):
    srv, token_file = token_server
    cases = golden_cases("nemo-rl")
    proc = run(cpp_bin / "golden", srv.address, GOLDEN, token_file)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"cpp golden: {len(cases)} passed, 0 failed" in proc.stdout, proc.stdout


def test_cpp_client_reports_a_wrong_value_and_a_missing_token(cpp_bin, token_server, tmp_path):
    srv, token_file = token_server
    golden, case_id = wrong_case_dir(tmp_path)
    proc = run(cpp_bin / "golden", srv.address, golden, token_file)
    assert proc.returncode == 1 and f"FAIL {case_id}: returns" in proc.stdout, proc.stdout + proc.stderr
    assert "cpp golden: 0 passed, 1 failed" in proc.stdout
    proc = run(cpp_bin / "golden", srv.address, GOLDEN)
    assert proc.returncode != 0 and "gRPC status 16" in proc.stdout + proc.stderr, proc.stdout + proc.stderr


# ------------------------------------------------------------------------------------------- grpcurl
def grpcurl_lines() -> list[list[str]]:
    lines = [line for b in re.findall(r"^```bash\n(.*?)^```$", other_languages(), re.S | re.M)
             for line in b.splitlines() if line.startswith("grpcurl ")]
    return [shlex.split(line, comments=True) for line in lines]


def test_readme_grpcurl_lines_are_found():
    commands = grpcurl_lines()
    assert len(commands) == 4 and all("localhost:50051" in c for c in commands), commands


@pytest.mark.skipif(GRPCURL is None, reason="grpcurl is not installed: Debian 12 does not package it (put a grpcurl "
                                            "binary on PATH to run the README's grpcurl lines)")
def test_readme_grpcurl_lines_run_against_a_server(server):
    outputs = []
    for command in grpcurl_lines():
        argv = [GRPCURL if a == "grpcurl" else server.address if a == "localhost:50051" else a for a in command]
        proc = run(*argv, timeout=60)
        assert proc.returncode == 0, f"{command}: {proc.stdout}{proc.stderr}"
        outputs.append(proc.stdout)
    services, service, gae, listed = outputs
    assert "advantage.v1.AdvantageService" in services.split() and "grpc.health.v1.Health" in services.split()
    assert "rpc ComputeAdvantage (" in service
    assert "gae_lambda" in gae and "gae_gamma" in gae
    assert {"grpo", "gae", "opd"} <= {e["name"] for e in json.loads(listed)["estimators"]}
