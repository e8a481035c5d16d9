"""Issue 11, "Found by a newcomer" (and two leftovers of its item 10): flags out of range exit 2 with a message,
client errors that say what to do, a demo without its extra, the README's venv and result-dtype notes, the
bench's help and --sizes, no BufferError from shared-memory mappings, a tiny gpg f_norm named as such, and a
first registration step that tells nothing about which shared-memory names exist.

(The start-up lines logged once, not printed as well: tests/test_server_cli.py::test_logs_device_and_address.)
"""
from __future__ import annotations

import gc
import math
import os
import pathlib
import subprocess
import sys
from multiprocessing import shared_memory

import grpc
import numpy as np
import pytest
import torch
from advantage_client import AdvantageClient, AdvantageServiceError
from advantage_server import create_server
from advantage_client._proto.advantage.v1 import advantage_pb2 as pb
from test_server_cli import free_port

ROOT = pathlib.Path(__file__).resolve().parents[1]


# ------------------------------------------------------------------------------ advantage-server flags
@pytest.mark.parametrize("flags, says", [
    (["--port", "70000"], "0 to 65535"),
    (["--port", "-1"], "0 to 65535"),
    (["--port", "65536"], "0 to 65535"),
    (["--port", "http"], "0 to 65535"),
    (["--metrics-port", "70000"], "0 to 65535"),
    (["--health-port", "-3"], "0 to 65535"),
    (["--grace", "-5"], ">= 0"),
    (["--grace", "nan"], ">= 0"),
    (["--stream-idle-timeout", "0"], "> 0"),
    (["--workers", "0"], "positive integer"),
    (["--max-batch-elements", "-1"], "positive integer"),
    (["--max-concurrent-requests", "0"], "positive integer"),
    (["--max-message-mb", "0"], "positive integer"),
    (["--max-stream-mb", "-2"], "positive integer"),
    (["--log-level", "verbose"], "DEBUG, INFO, WARNING or ERROR"),
    (["--device", "gpu"], "auto, cpu, cuda or cuda:N"),
    (["--device", "cuda:x"], "auto, cpu, cuda or cuda:N"),
])
def test_a_flag_out_of_range_exits_2_with_a_message(flags, says, capsys):
    from advantage_server.cli import build_parser

    with pytest.raises(SystemExit) as exc:  # before: parsed (--port 70000 listened on 4464)
        build_parser().parse_args(flags)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert f"argument {flags[0]}" in err and says in err, err
    assert "Traceback" not in err and "mps" not in err  # not torch's list of device types


def test_main_returns_2_for_an_unknown_log_level_instead_of_a_traceback(capsys):
    from advantage_server.cli import main

    assert main(["--port", "0", "--device", "cpu", "--log-level", "verbose"]) == 2  # before: ValueError raised
    assert "choose DEBUG, INFO, WARNING or ERROR" in capsys.readouterr().err


def test_resolve_device_names_the_devices_the_server_runs_on():
    from advantage_server.core import resolve_device

    with pytest.raises(ValueError) as exc:
        resolve_device("gpu")
    assert "auto, cpu, cuda or cuda:N" in str(exc.value) and "mps" not in str(exc.value)


# ------------------------------------------------------------------------------ client errors with a hint
def test_nothing_listening_names_the_target_and_what_to_do():
    target = f"localhost:{free_port()}"
    with AdvantageClient(target, timeout=10.0, retry=False) as client:
        for call in (client.list_estimators,
                     lambda: client.compute("grpo", None, transport="unary", prompt_ids=torch.tensor([0, 0]),
                                            rewards=torch.tensor([1.0, 0.0]), mask=torch.ones(2, 3))):
            with pytest.raises(AdvantageServiceError) as exc:
                call()
            err = exc.value
            assert err.code == grpc.StatusCode.UNAVAILABLE and type(err) is AdvantageServiceError
            assert target in str(err) and "start advantage-server" in str(err), str(err)
            # what to do comes first, gRPC's own text (whose first status word is "UNKNOWN") after it
            assert str(err).startswith(f"no advantage service answered at {target}:"), str(err)
            assert "(gRPC: " in str(err), str(err)


def test_unavailable_hints_match_what_went_wrong():
    """Nothing listening or no such host: what to do leads; a TLS client against a plaintext server: gRPC's
    handshake error leads and the hint says TLS, not "start advantage-server" (the server is running)."""
    server = create_server("127.0.0.1", 0, device="cpu").start()
    try:
        with AdvantageClient(server.address, timeout=10.0, retry=False, tls=True) as client:
            with pytest.raises(AdvantageServiceError) as exc:
                client.list_estimators()
        text = str(exc.value)
        assert exc.value.code == grpc.StatusCode.UNAVAILABLE
        assert "handshake" in text.lower().split("(the tls handshake")[0], text  # gRPC's own words first
        assert f"the TLS handshake with {server.address} failed" in text and "plaintext server" in text, text
        assert "start advantage-server" not in text, text
    finally:
        server.stop(0)
    for bad in ("localhost:abc", "localhost:50051/"):  # not "start advantage-server": the target is malformed,
        with pytest.raises(ValueError) as exc:  # refused when the client is made (tests/test_error_messages_ops.py)
            AdvantageClient(bad, timeout=10.0, retry=False)
        assert str(exc.value).startswith(f"target {bad!r}"), str(exc.value)
        assert "'localhost:50051'" in str(exc.value), str(exc.value)
    with AdvantageClient("no-such-host.invalid:50051", timeout=10.0, retry=False) as client:
        with pytest.raises(AdvantageServiceError) as exc:
            client.list_estimators()
    text = str(exc.value)  # a resolver's "not found" was told "start advantage-server there" (a fresh-clone try)
    if "not found" in text.split("(gRPC:")[-1].lower():  # the resolver said the name does not exist
        assert text.startswith("the host name in 'no-such-host.invalid:50051' resolves to no address"), text
    else:  # no answer from a resolver at all (a machine without DNS): nothing there, as for a refused connection
        assert text.startswith("no advantage service answered at no-such-host.invalid:50051:"), text


@pytest.mark.parametrize("target", ["http://localhost:50051", "https://localhost:50051/", "grpc://10.0.0.1:50051",
                                    ["http://10.0.0.1:50051", "10.0.0.2:50051"]])
def test_a_url_is_refused_at_construction_saying_to_drop_the_scheme(target):
    with pytest.raises(ValueError) as exc:  # before: "Misformatted domain name" at the first call
        AdvantageClient(target)
    assert "drop the" in str(exc.value) and "scheme" in str(exc.value)
    assert "localhost:50051" in str(exc.value) or "10.0.0.1:50051" in str(exc.value)


def test_a_too_short_deadline_mentions_timeout(target):
    # a call that takes milliseconds (8 MiB up, GAE, 8 MiB down): gRPC's deadline timer is coarser than 1 us, so a
    # [4, 64] call on loopback finished within it about 1 time in 3
    B, T = 256, 4096
    with AdvantageClient(target, timeout=1e-6) as client:
        with pytest.raises(AdvantageServiceError) as exc:
            client.compute("gae", None, transport="unary", rewards=torch.ones(B, T), mask=torch.ones(B, T),
                           values=torch.zeros(B, T))
    assert exc.value.code == grpc.StatusCode.DEADLINE_EXCEEDED and not isinstance(exc.value, ValueError)
    assert "timeout=" in str(exc.value), str(exc.value)


@pytest.mark.parametrize("timeout", [-1, 0, 0.0, math.nan, math.inf, "30", True])
def test_a_bad_timeout_is_refused_at_construction(timeout):
    with pytest.raises(ValueError, match="timeout="):
        AdvantageClient("127.0.0.1:1", timeout=timeout)


@pytest.mark.parametrize("timeout", [None, 30, 0.5, np.float32(2.0)])
def test_good_timeouts_are_kept(timeout):
    with AdvantageClient("127.0.0.1:1", timeout=timeout) as client:
        assert client.timeout == timeout


# ------------------------------------------------------------------------------ the demo without its extra
def test_cartpole_without_gymnasium_names_the_extra_and_exits_2():
    code = ("import sys; sys.modules['gymnasium'] = None\n"  # as if the demo extra were not installed
            "from advantage_server.demo import main\n"
            "sys.exit(main(['cartpole']))\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr
    assert "advantage-service[demo]" in proc.stderr and "Traceback" not in proc.stderr, proc.stderr


# ------------------------------------------------------------------------------ README
def test_readme_says_where_make_installs_and_how_results_are_typed():
    using = (ROOT / "docs" / "python-client.md").read_text()  # the README's "Using it" until issue #29
    assert ".venv/bin/advantage-server" in using and "source .venv/bin/activate" in using
    assert "`make demo` and `make test` install the project into `.venv`" in using
    assert "output_dtype=" in using and "as_numpy=True" in using and "float64" in using


# ------------------------------------------------------------------------------ advantage-bench
def test_bench_help_gives_one_default_per_option_and_help_for_each():
    from advantage_server.bench.run import build_parser

    parser = build_parser()
    for action in parser._actions:
        if not action.option_strings or action.dest == "help":
            continue
        assert action.help, f"{action.option_strings[0]} has no help"
        assert action.help.count("default") <= 1, (action.option_strings, action.help)
    # no ArgumentDefaultsHelpFormatter: it added "(default: ...)" after the help's own default
    text = parser.format_help()
    assert "(default: None)" not in text and "(default: False)" not in text and "(default: cpu)" not in text


def test_bench_sizes_limit_every_section():
    from advantage_server.bench.run import (
        DEFAULT_GROUP_SIZES,
        build_parser,
        parse_sizes,
        plan_sizes,
    )

    sizes, group_sizes, transport_mib = plan_sizes(build_parser().parse_args(["--sizes", "8x32x4"]))
    assert sizes == [(8, 32, 4)] and group_sizes == [] and transport_mib == 0
    sizes, group_sizes, transport_mib = plan_sizes(build_parser().parse_args(
        ["--sizes", "8x32x4", "--group-sizes", "64x4x4", "--transport-mib", "16"]))
    assert group_sizes == [(64, 4, 4)] and transport_mib == 16
    _, group_sizes, transport_mib = plan_sizes(build_parser().parse_args([]))
    assert group_sizes == parse_sizes(DEFAULT_GROUP_SIZES) and transport_mib == 256


# ------------------------------------------------------------------------------ shared-memory mappings
def test_a_region_dropped_with_views_alive_raises_no_buffer_error(monkeypatch):
    """The server's regions were dropped without close() (a server stopped with regions registered, a test's
    server collected) while numpy views of them were alive: SharedMemory.__del__ then printed
    ``BufferError: cannot close exported pointers exist``. (The server no longer maps segments at all, see
    issue 11 item 6: what it reads is its own copy, which outlives the region.)"""
    from advantage_server.transport import Region

    unraisable = []
    monkeypatch.setattr(sys, "unraisablehook", unraisable.append)
    segment = shared_memory.SharedMemory(create=True, size=4096)
    try:
        segment.buf[:4] = b"abcd"
        region = Region(segment.name, 4096, "key")
        view = region.read(0, 4, "test")
        del region
        gc.collect()
        assert bytes(view) == b"abcd"
        del view
        gc.collect()
    finally:
        segment.close()
        segment.unlink()
    assert not [u for u in unraisable if isinstance(u.exc_value, BufferError)], [u.exc_value for u in unraisable]


def test_map_segment_hands_the_mapping_to_its_views():
    from advantage_client.shm import map_segment

    segment = shared_memory.SharedMemory(create=True, size=4096)
    try:
        view = map_segment(segment, 4096)
        part = view[8:16]
        part[:] = 7
        segment.close()  # before: BufferError while a view is alive; now it closes the descriptor only
        assert part.sum() == 56 and view[8] == 7
    finally:
        segment.unlink()


# ------------------------------------------------------------------------------ gpg: a tiny f_norm
@pytest.mark.parametrize("dtype, f_norm", [(torch.float32, 1e-300), (torch.float32, 1e-40), (torch.float64, 1e-320)])
def test_a_tiny_f_norm_is_named(dtype, f_norm):
    from advantage_client.client import build_request
    from advantage_server.core import AdvantageCore
    from advantage_server.errors import InvalidInput

    request = build_request("gpg", {"f_norm": f_norm}, output_dtype=dtype, prompt_ids=torch.tensor([0, 0, 1, 1]),
                            rewards=torch.tensor([1.0, 0.0, 1.0, 2.0], dtype=dtype), mask=torch.ones(4, 3, dtype=dtype))
    with pytest.raises(InvalidInput) as exc:  # before: "inputs: ... input magnitudes are too large"
        AdvantageCore("cpu").compute(request)
    field, text = exc.value.violations[0]
    assert field == "config.f_norm" and "too small" in text and "use f_norm >=" in text, exc.value.violations


def test_a_small_f_norm_that_fits_and_a_tiny_one_on_tied_groups_still_compute():
    from advantage_client.client import build_request
    from advantage_server.core import AdvantageCore

    core = AdvantageCore("cpu")
    ids, mask = torch.tensor([0, 0, 1, 1]), torch.ones(4, 3)
    got = core.compute(build_request("gpg", {"f_norm": 1e-3}, prompt_ids=ids, rewards=torch.tensor([1.0, 0.0, 1.0, 2.0]),
                                     mask=mask))
    assert np.isfinite(np.frombuffer(got.advantages.data, np.float32)).all()
    tied = core.compute(build_request("gpg", {"f_norm": 1e-300}, prompt_ids=ids,
                                      rewards=torch.tensor([1.0, 1.0, 2.0, 2.0]), mask=mask))
    assert not np.frombuffer(tied.advantages.data, np.float32).any()  # 0 / f_norm = 0: nothing overflows


# ------------------------------------------------------------------------------ shared-memory registration
def test_registration_tells_nothing_about_which_names_exist(client):
    """Step 1 answers a challenge for any well-formed name without looking it up; step 2 answers the same
    PERMISSION_DENIED for a name that does not exist as for a segment that does not hold the challenge."""
    segment = shared_memory.SharedMemory(create=True, size=4096)
    missing = f"advantage-no-such-{os.getpid()}-{segment.name.lstrip('/')}"
    try:
        def step1(name: str) -> pb.RegisterSharedMemoryResponse:
            return client._call("RegisterSharedMemory", pb.RegisterSharedMemoryRequest(name=name, byte_size=4096),
                                pb.RegisterSharedMemoryResponse)

        answers = {name: step1(name) for name in (segment.name, missing)}  # before: INVALID_ARGUMENT for missing
        assert all(len(a.challenge) == 32 and not a.region_id for a in answers.values())
        refusals = {}
        for name, answer in answers.items():  # the challenge is not written into the segment
            with pytest.raises(AdvantageServiceError) as exc:
                client._call("RegisterSharedMemory", pb.RegisterSharedMemoryRequest(
                    name=name, byte_size=4096, proof=answer.challenge), pb.RegisterSharedMemoryResponse)
            refusals[name] = exc.value
        assert {e.code for e in refusals.values()} == {grpc.StatusCode.PERMISSION_DENIED}
        assert str(refusals[missing]).replace(missing, "NAME") == str(refusals[segment.name]).replace(segment.name,
                                                                                                   "NAME")
        # the segment's owner, which writes the challenge, still registers it; a byte_size beyond the segment is
        # INVALID_ARGUMENT for it (it proved it writes the segment)
        again = step1(segment.name)
        segment.buf[:len(again.challenge)] = again.challenge
        with pytest.raises(AdvantageServiceError) as exc:
            client._call("RegisterSharedMemory", pb.RegisterSharedMemoryRequest(
                name=segment.name, byte_size=1 << 20, proof=again.challenge), pb.RegisterSharedMemoryResponse)
        assert exc.value.code == grpc.StatusCode.INVALID_ARGUMENT and "byte_size" in str(exc.value)
        again = step1(segment.name)
        segment.buf[:len(again.challenge)] = again.challenge
        reply = client._call("RegisterSharedMemory", pb.RegisterSharedMemoryRequest(
            name=segment.name, byte_size=4096, proof=again.challenge), pb.RegisterSharedMemoryResponse)
        assert reply.region_id and reply.key
        client._call("UnregisterSharedMemory", pb.UnregisterSharedMemoryRequest(region_id=reply.region_id,
                                                                                key=reply.key),
                     pb.UnregisterSharedMemoryResponse)
    finally:
        segment.close()
        segment.unlink()


@pytest.mark.parametrize("bad", [-1, 0, float("nan")])
def test_async_client_checks_its_timeout(bad):
    from advantage_client import AsyncAdvantageClient
    with pytest.raises(ValueError, match="timeout"):
        AsyncAdvantageClient("localhost:50051", timeout=bad)


def test_async_client_unavailable_names_the_target():
    import asyncio
    from advantage_client import AsyncAdvantageClient

    async def call():
        async with AsyncAdvantageClient("127.0.0.1:9", timeout=2) as client:
            await client.list_estimators()
    with pytest.raises(AdvantageServiceError) as exc:
        asyncio.run(call())
    assert exc.value.code == grpc.StatusCode.UNAVAILABLE and "127.0.0.1:9" in str(exc.value)
