"""Observability: Prometheus metrics scraped after real calls, request ids echoed in trailing metadata, and JSON
logs carrying them, from an in-process server and from the real `advantage-server` process."""
from __future__ import annotations

import dataclasses
import json
import os
import re
import threading
import time
import urllib.request

import grpc
import numpy as np
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from advantage_client import AdvantageClient, AdvantageServiceError
from advantage_client._proto.advantage.v1 import advantage_pb2 as pb
from advantage_client._proto.advantage.v1 import advantage_pb2_grpc as pb_grpc
from advantage_client.client import build_request
from advantage_server import create_server
from advantage_server.estimators import REGISTRY
from advantage_server.metrics import estimator_fields, oneof_field_number

from test_server_cli import free_port, start_server

SERVICE = pb.DESCRIPTOR.services_by_name["AdvantageService"]


def scrape(port: int) -> dict[str, dict[tuple, float]]:
    """``{sample name: {sorted label items: value}}`` from ``GET /metrics``."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    out: dict[str, dict[tuple, float]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out.setdefault(sample.name, {})[tuple(sorted(sample.labels.items()))] = sample.value
    return out


def value(samples: dict, name: str, **labels) -> float:
    return samples.get(name, {}).get(tuple(sorted(labels.items())), 0.0)


def grpo_request(batch: int = 4, seed: int = 0) -> pb.ComputeAdvantageRequest:
    rng = np.random.default_rng(seed)
    return build_request("grpo", None, prompt_ids=np.repeat(np.arange(batch // 2), 2),
                         rewards=rng.normal(size=batch).astype(np.float32),
                         mask=np.ones((batch, 5), np.float32))


def bad_gae_request() -> pb.ComputeAdvantageRequest:  # no `values`: INVALID_ARGUMENT
    return build_request("gae", None, rewards=np.ones(2, np.float32), mask=np.ones((2, 3), np.float32))


@pytest.fixture()
def metered():
    srv = create_server("127.0.0.1", 0, device="cpu", metrics_port=0).start()
    try:
        yield srv
    finally:
        srv.stop(grace=1.0)


def test_counts_latency_and_bytes_after_real_calls(metered):
    with grpc.insecure_channel(metered.address) as channel:
        stub = pb_grpc.AdvantageServiceStub(channel)
        ok_requests = [grpo_request(4 + 2 * i, seed=i) for i in range(3)]
        replies = [stub.ComputeAdvantage(r, timeout=30) for r in ok_requests]
        for _ in range(2):
            with pytest.raises(grpc.RpcError) as err:
                stub.ComputeAdvantage(bad_gae_request(), timeout=30)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        with pytest.raises(grpc.RpcError) as err:  # no estimator chosen
            stub.ComputeAdvantage(pb.ComputeAdvantageRequest(), timeout=30)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        with pytest.raises(grpc.RpcError) as err:  # bytes that are not a message
            channel.unary_unary(f"/{SERVICE.full_name}/ComputeAdvantage")(b"\xff\xff\xff", timeout=30)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        stub.ListEstimators(pb.ListEstimatorsRequest(), timeout=30)
    m = scrape(metered.metrics.port)

    def requests(estimator, code, method="ComputeAdvantage"):
        return value(m, "advantage_requests_total", method=method, estimator=estimator, code=code)

    assert requests("grpo", "OK") == 3
    assert requests("gae", "INVALID_ARGUMENT") == 2
    assert requests("none", "INVALID_ARGUMENT") == 1        # the empty request: no estimator chosen
    assert requests("invalid", "INVALID_ARGUMENT") == 1     # not a protobuf message
    assert requests("none", "OK", method="ListEstimators") == 1
    assert value(m, "advantage_request_duration_seconds_count", method="ComputeAdvantage", estimator="grpo") == 3
    assert 0 < value(m, "advantage_request_duration_seconds_sum", method="ComputeAdvantage", estimator="grpo") < 30
    sizes = dict(method="ComputeAdvantage", estimator="grpo")
    assert value(m, "advantage_request_size_bytes_count", **sizes) == 3
    assert value(m, "advantage_request_size_bytes_sum", **sizes) == sum(r.ByteSize() for r in ok_requests)
    assert value(m, "advantage_response_size_bytes_count", **sizes) == 3
    assert value(m, "advantage_response_size_bytes_sum", **sizes) == sum(r.ByteSize() for r in replies)
    assert value(m, "advantage_request_size_bytes_sum", method="ComputeAdvantage", estimator="invalid") == 3
    assert value(m, "advantage_response_size_bytes_count", method="ComputeAdvantage", estimator="gae") == 0
    assert value(m, "advantage_requests_in_flight", method="ComputeAdvantage") == 0
    assert value(m, "advantage_device_memory_bytes", device="cpu", kind="resident") > 1e6
    assert "process_resident_memory_bytes" in m


def test_in_flight_gauge_counts_calls_in_progress(metered, monkeypatch):
    release, entered = threading.Event(), threading.Semaphore(0)
    spec = REGISTRY["grpo"]

    def blocking(cfg, batch):
        entered.release()
        release.wait(30)
        return spec.fn(cfg, batch)

    monkeypatch.setitem(REGISTRY, "grpo", dataclasses.replace(spec, fn=blocking))
    with AdvantageClient(metered.address, timeout=30.0) as client:
        calls = [threading.Thread(target=client.compute, args=("grpo",),
                                  kwargs=dict(prompt_ids=[0, 0], rewards=np.ones(2, np.float32),
                                              mask=np.ones((2, 2), np.float32))) for _ in range(2)]
        for call in calls:
            call.start()
        try:
            assert entered.acquire(timeout=30) and entered.acquire(timeout=30)
            assert value(scrape(metered.metrics.port), "advantage_requests_in_flight", method="ComputeAdvantage") == 2
        finally:
            release.set()
            for call in calls:
                call.join(30)
    m = scrape(metered.metrics.port)
    assert value(m, "advantage_requests_in_flight", method="ComputeAdvantage") == 0
    assert value(m, "advantage_requests_total", method="ComputeAdvantage", estimator="grpo", code="OK") == 2


def test_refused_calls_are_counted_with_their_status(monkeypatch):
    """Counted before the refusal's status is sent: a client that reads the metrics right after its refusal finds
    it (the count came after the status, and a loaded machine's scrape missed it; the counting slowed by 0.3 s
    here makes that certain)."""
    from advantage_server import metrics as metrics_mod
    child = metrics_mod._child
    monkeypatch.setattr(metrics_mod, "_child", lambda *a: (time.sleep(0.1), child(*a))[1])
    srv = create_server("127.0.0.1", 0, device="cpu", metrics_port=0, auth_token="s3cret").start()
    try:
        with AdvantageClient(srv.address, timeout=10.0) as client:  # no token
            with pytest.raises(AdvantageServiceError) as err:
                client.compute("raw_reward", rewards=np.ones(2, np.float32), mask=np.ones((2, 2), np.float32))
        assert err.value.code == grpc.StatusCode.UNAUTHENTICATED
        m = scrape(srv.metrics.port)
        # refused before its body is read (issue 11, item 2): the estimator is not known, so "none"
        assert value(m, "advantage_requests_total", method="ComputeAdvantage", estimator="none",
                     code="UNAUTHENTICATED") == 1
        assert value(m, "advantage_request_size_bytes_sum", method="ComputeAdvantage", estimator="none") == 0
    finally:
        srv.stop(grace=1.0)


# ------------------------------------------------------------------------------------------------ request ids
def trailing(call_metadata) -> dict[str, list]:
    out: dict[str, list] = {}
    for key, val in call_metadata or ():
        out.setdefault(key, []).append(val)
    return out


def test_request_id_is_echoed_on_success_and_on_error(target):
    with grpc.insecure_channel(target) as channel:
        stub = pb_grpc.AdvantageServiceStub(channel)
        _, call = stub.ComputeAdvantage.with_call(grpo_request(), metadata=[("x-request-id", "trainer-7/step-42")],
                                                  timeout=30)
        assert trailing(call.trailing_metadata())["x-request-id"] == ["trainer-7/step-42"]
        with pytest.raises(grpc.RpcError) as err:
            stub.ComputeAdvantage(bad_gae_request(), metadata=[("x-request-id", "bad-1")], timeout=30)
        meta = trailing(err.value.trailing_metadata())
        assert meta["x-request-id"] == ["bad-1"]
        assert "grpc-status-details-bin" in meta, "the BadRequest details must survive the echo"
        _, call = stub.ListEstimators.with_call(pb.ListEstimatorsRequest(), timeout=30)
        generated = trailing(call.trailing_metadata())["x-request-id"]
        assert len(generated) == 1 and re.fullmatch(r"[0-9a-f]{32}", generated[0])
        _, call = stub.ComputeAdvantage.with_call(grpo_request(), metadata=[("x-request-id", "x" * 200)], timeout=30)
        assert trailing(call.trailing_metadata())["x-request-id"] != ["x" * 200]  # too long: replaced


def test_client_error_keeps_field_violations_with_request_id(client):
    with pytest.raises(AdvantageServiceError) as err:
        client.compute("gae", rewards=np.ones(2, np.float32), mask=np.ones((2, 3), np.float32))
    assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert any("values" in field for field, _ in err.value.field_violations)


def test_estimator_label_matches_protobuf_parsing():
    fields = estimator_fields(SERVICE)["ComputeAdvantage"]
    assert set(REGISTRY) <= set(fields.values())
    numbers = frozenset(fields)
    for name in fields.values():
        req = build_request(name, None, mask=np.ones((3, 4), np.float32), rewards=np.ones(3, np.float32))
        req.output_dtype = pb.DTYPE_FLOAT64
        data = req.SerializeToString()
        assert fields[oneof_field_number(data, numbers)] == pb.ComputeAdvantageRequest.FromString(data).WhichOneof(
            "estimator")
    assert oneof_field_number(b"", numbers) is None
    for garbage in (b"\xff\xff\xff", b"\x52\x10abc", b"\x0b"):
        with pytest.raises(ValueError):
            oneof_field_number(garbage, numbers)


# ------------------------------------------------------------------------------ the real process: flags, JSON logs
def test_cli_json_logs_and_metrics_port(tmp_path):
    metrics_port = free_port()
    srv = start_server(tmp_path, "json", "--log-format", "json", "--log-level", "DEBUG",
                       "--metrics-port", str(metrics_port))
    try:
        assert f"metrics on port {metrics_port}" in srv.stderr
        with grpc.insecure_channel(srv.address) as channel:
            stub = pb_grpc.AdvantageServiceStub(channel)
            stub.ComputeAdvantage(grpo_request(), metadata=[("x-request-id", "json-log-1")], timeout=30)
            with pytest.raises(grpc.RpcError):
                stub.ComputeAdvantage(bad_gae_request(), metadata=[("x-request-id", "json-log-2")], timeout=30)
        m = scrape(metrics_port)
        assert value(m, "advantage_requests_total", method="ComputeAdvantage", estimator="grpo", code="OK") == 1
        assert value(m, "advantage_requests_total", method="ComputeAdvantage", estimator="gae",
                     code="INVALID_ARGUMENT") == 1
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and "json-log-2" not in srv.stderr:
            time.sleep(0.05)
    finally:
        srv.proc.terminate()
        srv.wait(timeout=30)
        srv.close()
    records = [json.loads(line) for line in srv.stderr.splitlines() if line.strip()]  # every line is JSON
    assert all({"time", "level", "logger", "message"} <= set(r) for r in records)
    by_id = {r["request_id"]: r for r in records if "request_id" in r}
    assert by_id["json-log-1"]["estimator"] == "grpo" and "OK" in by_id["json-log-1"]["message"]
    assert by_id["json-log-2"]["method"] == "ComputeAdvantage"
    assert "INVALID_ARGUMENT" in by_id["json-log-2"]["message"]
    assert any("listening on" in r["message"] for r in records)


def test_metrics_port_in_use_is_an_error(tmp_path):
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        with pytest.raises(RuntimeError, match="metrics port"):
            create_server("127.0.0.1", 0, device="cpu", metrics_port=taken.getsockname()[1])


def test_json_log_records_carry_the_call_context():
    import io
    import logging

    from advantage_server import logs

    stream = io.StringIO()
    handler = logs.configure("INFO", "json", stream)
    try:
        log = logging.getLogger("advantage_server.test")
        log.info("outside a call")
        token = logs.CALL.set({"request_id": "r-1", "method": "ComputeAdvantage", "estimator": "gae"})
        try:
            log.warning("inside %s", "a call", extra={"shape": [2, 3]})
            try:
                raise ValueError("boom")
            except ValueError:
                log.exception("failed")
        finally:
            logs.CALL.reset(token)
        with pytest.raises(ValueError, match="--log-format"):
            logs.configure("INFO", "xml")
    finally:
        logging.getLogger().removeHandler(handler)
    outside, inside, failed = (json.loads(line) for line in stream.getvalue().splitlines())
    assert outside["message"] == "outside a call" and "request_id" not in outside
    assert inside["message"] == "inside a call" and inside["level"] == "WARNING"
    assert (inside["request_id"], inside["method"], inside["estimator"]) == ("r-1", "ComputeAdvantage", "gae")
    assert inside["shape"] == "[2, 3]" and inside["time"].endswith("Z")
    assert failed["request_id"] == "r-1" and "ValueError: boom" in failed["exception"]


def test_cpu_memory_gauge_counts_mapped_shared_memory_apart_from_resident():
    """A client's shared-memory region mapped and touched by the server is ``kind="shared_memory"``, not the
    server's resident memory (before: /proc/self/statm's resident set, which counts those pages too)."""
    import mmap
    from advantage_server.metrics import DeviceMemoryCollector
    collector = DeviceMemoryCollector(torch.device("cpu"))

    def kinds() -> dict[str, float]:
        return {s.labels["kind"]: s.value for family in collector.collect() for s in family.samples}

    before = kinds()
    assert set(before) == {"resident", "shared_memory"} and before["resident"] > 1e6
    size = 64 << 20
    fd = os.memfd_create("metrics-test")
    try:
        os.ftruncate(fd, size)
        with mmap.mmap(fd, size) as region:
            for offset in range(0, size, mmap.PAGESIZE):
                region[offset] = 1  # touch every page
            during = kinds()
    finally:
        os.close(fd)
    assert during["shared_memory"] - before["shared_memory"] >= size * 0.95, (before, during)
    assert during["resident"] - before["resident"] < 8 << 20, (before, during)
