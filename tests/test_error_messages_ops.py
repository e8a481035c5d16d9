"""Issue 29, item 7: the operators' and newcomers' error messages name the problem and the fix.

1. ``output_dtype``: the client accepts exactly the dtypes the server returns results in (float32, float64,
   bfloat16, float16) and refuses any other before sending, naming those four (before: it listed bool, int32,
   int64 and uint8 as valid, and the server then refused them);
2. an unknown estimator name gets a "did you mean" (``GAE``, ``reinforce++``, ``ppo`` -> ``gae``), client side
   and in the server's INVALID_ARGUMENT text;
3. ``advantage-demo lm --compare grpo,foo`` blames ``--compare`` (before: ``--estimator``);
4. ``advantage-demo lm --semantics verl2`` is refused before the warm start (before: after 25-60 s of it);
5. ``RemotePPOActor`` with AReaL installed but one of its dependencies missing names that module (before:
   "needs AReaL (pip install areal==1.0.4)");
6. ``advantage-healthcheck`` against a port nobody listens on says no server is reachable there and what to
   check (before: gRPC's raw text);
7. ``wait_for_ready=True`` with no server ends in "no advantage service answered at TARGET" (before: a plain
   "Deadline Exceeded" blaming the call's timeout);
8. a target with a path after the port (``localhost:50051/``) is refused when the client is made, with the
   target to give instead (before: at the first call).

Real behaviour throughout: real servers on ephemeral loopback ports, ports nobody listens on, the real CLIs;
item 5 imports a stand-in ``areal`` package whose ``areal.trainer.ppo.actor`` imports a missing module, in a
subprocess.
"""
from __future__ import annotations

import asyncio
import os
import pathlib
import socket
import subprocess
import sys
import time

import grpc
import numpy as np
import pytest
import torch

from advantage_client import AdvantageClient, AdvantageServiceError, AsyncAdvantageClient, WireError, wire
from advantage_client.channel import TargetError
from advantage_client.client import build_request
from advantage_client.nemo import RemoteAdvantageEstimator
from advantage_client.proto import advantage_pb2 as pb
from advantage_client.proto import advantage_pb2_grpc as pb_grpc
from advantage_server.cli import healthcheck_main
from advantage_server.core import AdvantageCore
from advantage_server.demo import lm
from advantage_server.errors import InvalidInput

ROOT = pathlib.Path(__file__).resolve().parents[1]
GROUP = dict(prompt_ids=np.zeros(4, np.int64), rewards=np.array([1.0, 0.0, 1.0, 0.0], np.float32),
             mask=np.ones((4, 3), np.float32))
# grpo's defaults (NeMo RL's): leave-one-out baseline over the group's std (ddof 1), on every token of the row
EXPECTED_GROUP = np.repeat(np.array([2, -2, 2, -2])[:, None] / 3 / np.sqrt(1 / 3), 3, axis=1)


def free_port() -> int:
    """A loopback port nobody listens on (bound, then released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ------------------------------------------------------------------------------------------ 1. output_dtype
def test_client_output_dtypes_are_exactly_what_the_server_returns(target):
    """For every ``DType`` value: the client takes it as ``output_dtype`` if and only if the server does."""
    stub = pb_grpc.AdvantageServiceStub(grpc.insecure_channel(target))
    client_ok, server_ok = set(), set()
    for code in pb.DType.values():
        if code == pb.DTYPE_UNSPECIFIED:
            continue
        try:
            wire.output_dtype_code(code)
            client_ok.add(code)
        except WireError:
            pass
        request = build_request("grpo", None, **GROUP)
        request.output_dtype = code  # sent as is, past the client's check
        try:
            stub.ComputeAdvantage(request, timeout=30)
            server_ok.add(code)
        except grpc.RpcError as err:
            assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, err
            # the server's text names what it got and the four it returns
            assert pb.DType.Name(code) in err.details(), err.details()
            for name in ("DTYPE_FLOAT32", "DTYPE_FLOAT64", "DTYPE_BFLOAT16", "DTYPE_FLOAT16"):
                assert name in err.details(), err.details()
    assert server_ok == {pb.DTYPE_FLOAT32, pb.DTYPE_FLOAT64, pb.DTYPE_BFLOAT16, pb.DTYPE_FLOAT16}
    assert client_ok == server_ok
    assert [wire.DTYPE_NAMES[c] for c in sorted(server_ok)] == list(wire.OUTPUT_DTYPES)


@pytest.mark.parametrize("dtype", ["int8", "int32", "int64", "bool", "uint8", torch.int32, np.uint8,
                                   pb.DTYPE_BOOL, "complex64"])
def test_a_non_float_output_dtype_is_refused_before_sending_naming_the_four(dtype):
    # nobody listens on the target: a request that were sent would end UNAVAILABLE, not in a WireError
    with AdvantageClient(f"127.0.0.1:{free_port()}", timeout=5.0, retry=False) as client:
        for transport in ("unary", "stream"):
            with pytest.raises(WireError) as exc:
                client.compute("grpo", None, output_dtype=dtype, transport=transport, **GROUP)
            text = str(exc.value)
            assert exc.value.field == "output_dtype"
            assert "float32 (the default), float64, bfloat16 or float16" in text, text
            assert "'float32', 'float64', 'bfloat16', 'float16'" in text and "cast the result" in text, text
            # before: "use one of ['bfloat16', 'bool', 'float16', 'float32', 'float64', 'int32', 'int64', 'uint8']"
            for name in ("'bool'", "'int32'", "'int64'", "'uint8'"):
                assert name not in text.split(" is not a dtype")[1], text


def test_the_four_output_dtypes_return_results_in_that_dtype(client):
    for name, want in (("float32", torch.float32), ("float64", torch.float64), ("bfloat16", torch.bfloat16),
                       ("float16", torch.float16), (torch.float64, torch.float64), (np.float16, torch.float16)):
        got = client.compute("grpo", None, output_dtype=name, transport="unary", **GROUP).advantages
        assert got.dtype == want, (name, got.dtype)
        np.testing.assert_allclose(got.float().numpy(), EXPECTED_GROUP, rtol=1e-2)


# ------------------------------------------------------------------------------------------ 2. "did you mean"
@pytest.mark.parametrize("name, suggestion", [
    ("GAE", "Did you mean 'gae' (names are case-sensitive)?"),
    ("reinforce++", "Did you mean 'reinforce_plus_plus'?"),
    ("REINFORCE++ baseline", "Did you mean 'reinforce_plus_plus_baseline'?"),
    ("ppo", "Did you mean 'gae' (PPO's advantage estimator is GAE)?"),
    ("grpo_pass@k", "Did you mean 'grpo_passk'?"),
    ("rloo_vectorized", "Did you mean 'rloo' (verl's name; advantage_client.verl maps it)?"),
    ("dr_grpo", "Did you mean 'grpo' (OpenRLHF's name"),
    ("grp", "Did you mean 'grpo' or 'gpg'?"),
])
def test_unknown_estimator_names_get_a_suggestion_client_and_server_side(name, suggestion):
    names = ", ".join(sorted(wire.ESTIMATOR_FIELDS))
    # the client, before sending (nobody listens at the target)
    with AdvantageClient(f"127.0.0.1:{free_port()}", timeout=5.0, retry=False) as client:
        with pytest.raises(WireError) as exc:
            client.compute(name, None, **GROUP)
    assert exc.value.field == "estimator"
    assert str(exc.value).startswith(f"estimator: unknown estimator {name!r}. "), str(exc.value)
    assert suggestion in str(exc.value) and str(exc.value).endswith(f"Choose one of {names}"), str(exc.value)
    # NeMo RL's drop-in
    with pytest.raises(ValueError) as exc:
        RemoteAdvantageEstimator(f"127.0.0.1:{free_port()}", name)
    assert suggestion in str(exc.value), str(exc.value)
    # the server's core (its INVALID_ARGUMENT text: one BadRequest violation on "estimator")
    with pytest.raises(InvalidInput) as exc:
        AdvantageCore("cpu").run(name, None, {k: torch.as_tensor(v) for k, v in GROUP.items()})
    assert exc.value.violations[0][0] == "estimator"
    assert suggestion in exc.value.violations[0][1] and exc.value.violations[0][1].endswith(names)


def test_a_name_close_to_nothing_gets_no_suggestion_and_the_list():
    text = wire.unknown_estimator("xyzzy", wire.ESTIMATOR_FIELDS)
    assert "Did you mean" not in text and text.startswith("unknown estimator 'xyzzy'. Choose one of areal, gae")


def test_config_enum_and_field_names_get_a_suggestion():
    with pytest.raises(WireError) as exc:
        wire.config_message("grpo", {"semantics": "verl2"})
    assert exc.value.field == "config.semantics" and str(exc.value).endswith("Did you mean 'verl'?"), exc.value
    with pytest.raises(WireError) as exc:
        wire.config_message("gae", {"gae_lamda": 0.9})
    assert "Did you mean 'gae_lambda'" in str(exc.value), exc.value


# ------------------------------------------------------------------------------------------ 3, 4. the LM demo
@pytest.fixture
def no_training(monkeypatch):
    """The demo's server connection and warm start, replaced by ones that fail the test if reached: a bad
    option must be refused before either (the warm start takes 25-60 s)."""
    reached = []

    def forbidden(*args, **kwargs):
        reached.append(args)
        raise AssertionError("reached the warm start / server connection with a bad option")
    monkeypatch.setattr(lm, "connect", forbidden)
    monkeypatch.setattr(lm, "warm_start", forbidden)
    return reached


@pytest.mark.parametrize("argv, want", [
    (["--compare", "grpo,foo"], ["--compare 'grpo,foo': 'foo' is not an estimator this demo runs",
                                 "Choose from grpo, rloo, reinforce_plus_plus_baseline"]),
    (["--compare", "grpo,reinforce++"], ["--compare 'grpo,reinforce++': 'reinforce++'",
                                         "Did you mean 'reinforce_plus_plus'?"]),
    (["--compare", "grpo,,rloo"], ["--compare 'grpo,,rloo' has an empty name", "e.g. --compare grpo,rloo"]),
    (["--semantics", "verl2"], ["--semantics 'verl2' with grpo", "Did you mean 'verl'?"]),
    (["--compare", "grpo,gdpo", "--semantics", "trl"], ["--semantics 'trl' with gdpo",
                                                         "use nemo_rl or verl"]),
    (["--compare", "grpo,opd", "--semantics", "verl"], ["--semantics 'verl': opd has one semantics only; drop "
                                                         "--semantics (or run opd apart from --compare)"]),
    (["--estimator", "GRPO"], ["--estimator 'GRPO' is not an estimator this demo runs. Did you mean 'grpo'"]),
])
def test_demo_refuses_bad_names_up_front_blaming_the_right_flag(argv, want, capsys, no_training):
    t0 = time.perf_counter()
    assert lm.main(["lm", *argv, "--max-steps", "1", "--quiet"]) == 2
    err = capsys.readouterr().err
    for text in want:
        assert text in err, err
    if "--compare" in argv and "--semantics" not in argv:
        assert "--estimator" not in err, err  # before: "--estimator 'foo': choose one of ..."
    assert no_training == []
    assert time.perf_counter() - t0 < 20  # no warm start (generous: a busy 2-core machine)


def test_demo_valid_semantics_pass_the_up_front_check():
    # what the server accepts passes (no false refusal): verl for grpo and rloo, skyrl for maxrl
    for estimator, semantics in (("grpo", "verl"), ("rloo", "verl"), ("maxrl", "skyrl"), ("gdpo", "nemo_rl")):
        lm.check_config(lm.LMConfig(estimator=estimator, semantics=semantics))
    assert lm.compared_estimators(lm.LMConfig(compare=" grpo , rloo")) == ["grpo", "rloo"]


# ------------------------------------------------------------------------------------------ 5. AReaL's imports
STAND_IN = """
import advantage_client.areal as m
try:
    m.RemotePPOActor
except ImportError as e:
    print(e)
else:
    raise SystemExit("RemotePPOActor imported")
"""


def _areal_stand_in(root: pathlib.Path, actor_source: str) -> pathlib.Path:
    """A package ``areal`` with ``areal/trainer/ppo/actor.py`` = ``actor_source``, under ``root``."""
    pkg = root / "areal" / "trainer" / "ppo"
    pkg.mkdir(parents=True)
    for d in (root / "areal", root / "areal" / "trainer", pkg):
        (d / "__init__.py").write_text("")
    (pkg / "actor.py").write_text(actor_source)
    return root


def _lookup_message(path: pathlib.Path | None) -> str:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        ([str(path)] if path else []) + [str(ROOT / "client")])}
    code = STAND_IN if path else "import sys\nsys.modules['areal'] = None\n" + STAND_IN
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def test_remote_ppo_actor_names_the_missing_dependency_of_an_installed_areal(tmp_path):
    text = _lookup_message(_areal_stand_in(tmp_path, "import no_such_areal_dependency_xyz\n"))
    assert "AReaL is installed, but a module it imports is not: no module named 'no_such_areal_dependency_xyz'" \
        in text, text
    assert "Install the package that provides 'no_such_areal_dependency_xyz'" in text, text
    assert "is not installed here" not in text, text  # before: "needs AReaL (pip install areal==1.0.4)"


def test_remote_ppo_actor_names_a_dependency_at_another_version(tmp_path):
    # numpy is installed; numpy.no_such_submodule is not: a dependency at a version AReaL does not declare
    text = _lookup_message(_areal_stand_in(tmp_path, "import numpy.no_such_submodule\n"))
    assert "its dependency 'numpy' has no module 'numpy.no_such_submodule'" in text, text
    text = _lookup_message(_areal_stand_in(tmp_path / "b", "from numpy import no_such_name\n"))
    assert "AReaL is installed, but importing it failed: cannot import name 'no_such_name'" in text, text


def test_remote_ppo_actor_without_areal_says_to_install_it(tmp_path):
    text = _lookup_message(None)
    assert "AReaL is not installed here: pip install areal==1.0.4" in text, text
    (tmp_path / "areal").mkdir()
    (tmp_path / "areal" / "__init__.py").write_text("")  # another AReaL: no areal.trainer
    text = _lookup_message(tmp_path)
    assert "the installed AReaL has no module 'areal.trainer'" in text and "areal==1.0.4" in text, text


# ------------------------------------------------------------------------------------------ 6. healthcheck
def test_healthcheck_against_a_dead_port_says_nothing_is_reachable_there(capsys):
    address = f"127.0.0.1:{free_port()}"
    assert healthcheck_main(["--address", address, "--timeout", "5"]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"unhealthy: no server is reachable at {address}: check that advantage-server is "
                          "running"), err
    assert "--address names that host and its gRPC port (default 50051" in err, err
    assert "(gRPC UNAVAILABLE: " in err, err  # gRPC's own text kept, after the hint


def test_healthcheck_against_another_grpc_service_and_unknown_service(make_server, capsys):
    srv = make_server()
    assert healthcheck_main(["--address", srv.address, "--service", "no.such.Service", "--timeout", "10"]) == 1
    err = capsys.readouterr().err
    assert f"the server at {srv.address} knows no service 'no.such.Service'" in err, err
    assert healthcheck_main(["--address", srv.address, "--timeout", "10"]) == 0
    assert capsys.readouterr().out.strip() == "SERVING"


def test_healthcheck_with_mismatched_tls_says_which_side_to_change(make_server, tmp_path, capsys):
    from reliability_support import make_pki
    pki = {k: str(v) for k, v in make_pki(tmp_path).items()}
    plain, tls = make_server(), make_server(tls_cert=pki["server_cert"], tls_key=pki["server_key"])
    assert healthcheck_main(["--address", plain.address, "--tls-ca", pki["ca"], "--timeout", "10"]) == 1
    err = capsys.readouterr().err
    assert f"the server at {plain.address} did not complete a TLS gRPC handshake: the server runs plaintext: " \
           "drop --tls-ca" in err, err
    assert healthcheck_main(["--address", tls.address, "--timeout", "10"]) == 1
    err = capsys.readouterr().err
    assert f"the server at {tls.address} did not complete a plaintext gRPC handshake: a server started with " \
           "--tls-cert needs --tls-ca" in err, err
    assert healthcheck_main(["--address", tls.address, "--tls-ca", pki["ca"], "--timeout", "10"]) == 0
    assert capsys.readouterr().out.strip() == "SERVING"


@pytest.mark.parametrize("address, bare", [("localhost:50051/", "localhost:50051"),
                                           ("http://127.0.0.1:50051", "127.0.0.1:50051")])
def test_healthcheck_refuses_a_path_or_scheme_in_the_address(address, bare, capsys):
    with pytest.raises(SystemExit) as exc:
        healthcheck_main(["--address", address])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert f"--address {address!r} is not host:port: give the address without a scheme or a path, e.g. " \
           f"{bare!r}" in err, err


# ------------------------------------------------------------------------------------------ 7. wait_for_ready
def test_wait_for_ready_with_no_server_says_no_server_answered():
    address = f"127.0.0.1:{free_port()}"
    with AdvantageClient(address, timeout=1.5, wait_for_ready=True) as client:
        for call in (lambda: client.compute("grpo", None, transport="unary", **GROUP),
                     lambda: client.compute("grpo", None, transport="stream", **GROUP),
                     client.list_estimators):
            with pytest.raises(AdvantageServiceError) as exc:
                call()
            assert exc.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
            text = str(exc.value)
            assert text.startswith(f"no advantage service answered at {address} within the call's timeout=1.5 "
                                   "seconds (the client never connected; with wait_for_ready=True"), text
            assert "start advantage-server there" in text and "pass a larger timeout=" in text, text


def test_wait_for_ready_with_no_server_asyncio():
    address = f"127.0.0.1:{free_port()}"

    async def main():
        errors = []
        async with AsyncAdvantageClient(address, timeout=1.5, wait_for_ready=True) as client:
            for transport in ("unary", "stream"):
                with pytest.raises(AdvantageServiceError) as exc:
                    await client.compute("grpo", None, transport=transport, **GROUP)
                errors.append(exc.value)
            with pytest.raises(AdvantageServiceError) as exc:
                await client.list_estimators()
            errors.append(exc.value)
        return errors
    for err in asyncio.run(main()):
        assert err.code == grpc.StatusCode.DEADLINE_EXCEEDED
        assert str(err).startswith(f"no advantage service answered at {address} within"), str(err)


def test_a_slow_call_to_a_running_server_still_blames_the_timeout(target):
    """The same code from a server that is there: the call was slower than its deadline (the old hint)."""
    with AdvantageClient(target, timeout=60.0, wait_for_ready=True) as client:
        client.wait_ready(timeout=30.0)
        B, T = 256, 4096
        with pytest.raises(AdvantageServiceError) as exc:
            client.compute("gae", None, transport="unary", timeout=1e-6, rewards=torch.ones(B, T),
                           mask=torch.ones(B, T), values=torch.zeros(B, T))
    assert exc.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
    assert "took longer than its timeout=1e-06 seconds" in str(exc.value), str(exc.value)
    assert "no advantage service answered" not in str(exc.value)


# ------------------------------------------------------------------------------------------ 8. targets
@pytest.mark.parametrize("bad, fix", [("localhost:50051/", "give 'localhost:50051'"),
                                      ("dns:///advantage.svc:50051/", "give 'dns:///advantage.svc:50051'"),
                                      ("[::1]:50051/x", "give '[::1]:50051'"),
                                      ("localhost:abc", "port 'abc' is not a number"),
                                      ("localhost:99999", "port 99999 is not a TCP port (1-65535)")])
def test_a_malformed_port_is_refused_when_the_client_is_made(bad, fix):
    for make in (lambda: AdvantageClient(bad), lambda: AsyncAdvantageClient(bad)):
        with pytest.raises(TargetError) as exc:  # before: accepted, "Failed to parse port" at the first call
            make()
        assert fix in str(exc.value) and str(exc.value).startswith(f"target {bad!r}"), str(exc.value)


def test_the_target_a_trailing_slash_error_gives_works(server):
    with pytest.raises(TargetError) as exc:
        AdvantageClient(server.address + "/")
    assert f"give {server.address!r}" in str(exc.value), str(exc.value)
    with AdvantageClient(server.address, timeout=60.0) as client:
        got = client.compute("grpo", None, transport="unary", **GROUP)
    np.testing.assert_allclose(got.advantages.numpy(), EXPECTED_GROUP, rtol=1e-5)
