"""A real Prometheus (loopback, ephemeral port, temporary storage) scrapes a live server's /metrics and loads
deploy/prometheus/alerts.yaml; the queries the alert rules and the HorizontalPodAutoscaler's adapter rule
(deploy/prometheus/prometheus-adapter.yaml) run return the values the calls made: calls held in flight, one refused
at admission (RESOURCE_EXHAUSTED), one past its deadline, OK calls.

Needs the `prometheus` binary (Debian's `prometheus` package; .ci/run installs it): skipped with that reason where
missing."""
from __future__ import annotations

import dataclasses
import json
import pathlib
import shutil
import subprocess
import threading
import time
import urllib.parse
import urllib.request

import grpc
import numpy as np
import pytest
import yaml

from advantage_client import AdvantageClient
from advantage_client._proto.advantage.v1 import advantage_pb2_grpc as pb_grpc
from advantage_client.client import build_request
from advantage_server import create_server
from advantage_server.estimators import REGISTRY

from test_server_cli import free_port

ROOT = pathlib.Path(__file__).resolve().parent.parent
RULES = ROOT / "deploy" / "prometheus" / "alerts.yaml"
ADAPTER = ROOT / "deploy" / "prometheus" / "prometheus-adapter.yaml"
LOCAL_CONFIG = ROOT / "deploy" / "prometheus" / "prometheus.yml"
PROMETHEUS = shutil.which("prometheus")
pytestmark = pytest.mark.skipif(PROMETHEUS is None, reason="prometheus is not installed (apt-get install prometheus)")
JOB = "advantage-service"


class Prometheus:
    def __init__(self, tmp: pathlib.Path, target: str):
        self.port = free_port()
        # deploy/prometheus/prometheus.yml, the local setup docs/observability.md gives, with the live server as its
        # target, its rule file's path made absolute, and a 1 s interval (the test's patience, not the file's 15 s)
        config = yaml.safe_load(LOCAL_CONFIG.read_text())
        assert config["rule_files"] == ["alerts.yaml"] and [j["job_name"] for j in config["scrape_configs"]] == [JOB]
        assert config["scrape_configs"][0]["static_configs"] == [{"targets": ["127.0.0.1:9464"]}]
        config["global"] = {"scrape_interval": "1s", "evaluation_interval": "1s"}
        config["rule_files"] = [str(RULES)]
        config["scrape_configs"][0]["static_configs"] = [{"targets": [target]}]
        (tmp / "prometheus.yml").write_text(yaml.safe_dump(config))
        self.log = (tmp / "prometheus.log").open("wb")
        self.proc = subprocess.Popen(
            [PROMETHEUS, f"--config.file={tmp / 'prometheus.yml'}", f"--storage.tsdb.path={tmp / 'data'}",
             f"--web.listen-address=127.0.0.1:{self.port}", "--web.enable-lifecycle"],
            stdout=self.log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        self.log_path = tmp / "prometheus.log"

    def get(self, path: str, **params) -> dict:
        url = f"http://127.0.0.1:{self.port}{path}" + (f"?{urllib.parse.urlencode(params)}" if params else "")
        with urllib.request.urlopen(url, timeout=10) as response:
            body = json.loads(response.read())
        assert body["status"] == "success", body
        return body["data"]

    def query(self, expr: str) -> list[dict]:
        return self.get("/api/v1/query", query=expr)["result"]

    def wait_for(self, expr: str, check, timeout: float = 30.0) -> list[dict]:
        """Polls ``expr`` until ``check(result)`` holds (Prometheus scrapes every second)."""
        deadline, result = time.monotonic() + timeout, None
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"prometheus exited {self.proc.returncode}:\n{self.log_path.read_text()}")
            try:
                result = self.query(expr)
                if check(result):
                    return result
            except OSError:  # not listening yet
                pass
            time.sleep(0.25)
        raise AssertionError(f"{expr}: {result} after {timeout} s\n{self.log_path.read_text()[-3000:]}")

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)
        self.log.close()


def scalar(result: list[dict]) -> float:
    assert len(result) == 1, result
    return float(result[0]["value"][1])


def rule_expr(alert: str) -> str:
    return next(r["expr"] for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"]
                if r.get("alert") == alert)


def adapter_query(labels: str, group_by: str) -> str:
    """The adapter rule's metricsQuery with its templates filled as prometheus-adapter fills them."""
    rule = yaml.safe_load(ADAPTER.read_text())["rules"][0]
    assert rule["name"]["as"] == "advantage_requests_in_flight"
    series = rule["seriesQuery"].split("{")[0].strip("'")
    return (rule["metricsQuery"].replace("<<.Series>>", series).replace("<<.LabelMatchers>>", labels)
            .replace("<<.GroupBy>>", group_by))


def test_prometheus_scrapes_a_live_server_and_the_rules_and_hpa_queries_read_it(tmp_path, monkeypatch):
    spec = REGISTRY["grpo"]
    entered, release = threading.Semaphore(0), threading.Event()

    def held(cfg, batch):  # the calls stay in flight until released
        entered.release()
        release.wait(60)
        return spec.fn(cfg, batch)

    monkeypatch.setitem(REGISTRY, "grpo", dataclasses.replace(spec, fn=held))
    srv = create_server("127.0.0.1", 0, device="cpu", metrics_port=0, max_concurrent_requests=2).start()
    prom = Prometheus(tmp_path, f"127.0.0.1:{srv.metrics.port}")
    instance = f"127.0.0.1:{srv.metrics.port}"
    request = build_request("grpo", None, prompt_ids=np.array([0, 0, 1, 1]),
                            rewards=np.array([1, 0, 0.5, 0.5], np.float32), mask=np.ones((4, 3), np.float32))

    def call(outcomes: dict, name: str, timeout: float) -> None:  # one attempt: a plain stub, no retry policy
        with grpc.insecure_channel(srv.address) as channel:
            try:
                outcomes[name] = pb_grpc.AdvantageServiceStub(channel).ComputeAdvantage(request, timeout=timeout)
            except grpc.RpcError as exc:
                outcomes[name] = exc.code()

    def round_of_calls(in_flight_checks) -> dict:
        """Two calls held in flight (one with a 2 s deadline), a third refused at admission, then released:
        one OK, one DEADLINE_EXCEEDED, one RESOURCE_EXHAUSTED. ``in_flight_checks()`` runs while two are held."""
        outcomes: dict = {}
        release.clear()
        threads = [threading.Thread(target=call, args=(outcomes, "ok", 60.0)),
                   threading.Thread(target=call, args=(outcomes, "late", 2.0))]
        for thread in threads:
            thread.start()
        try:
            assert entered.acquire(timeout=30) and entered.acquire(timeout=30)
            call(outcomes, "refused", 30.0)  # both places taken
            in_flight_checks()
            threads[1].join(30)  # its deadline passes while it is held
            # the server's copy of the deadline ends a little after the client's: past both, the server counts
            # DEADLINE_EXCEEDED (released in between, the call would count as CANCELLED: the client left)
            time.sleep(0.5)
        finally:
            release.set()
            for thread in threads:
                thread.join(60)
        assert outcomes["refused"] == grpc.StatusCode.RESOURCE_EXHAUSTED, outcomes
        assert outcomes["late"] == grpc.StatusCode.DEADLINE_EXCEEDED, outcomes
        assert not isinstance(outcomes["ok"], grpc.StatusCode), outcomes
        assert list(outcomes["ok"].advantages.shape) == [4, 3], outcomes
        return outcomes

    def hpa_metric() -> None:
        # the HPA's metric: one series per method, summed per pod (here per instance) as the adapter must
        per_method = prom.wait_for(f'advantage_requests_in_flight{{job="{JOB}"}}',
                                   lambda r: sum(float(s["value"][1]) for s in r) == 2.0)
        assert {s["metric"]["method"] for s in per_method} >= {"ComputeAdvantage", "ListEstimators"}
        assert scalar(prom.query(f'sum(advantage_requests_in_flight{{job="{JOB}"}})')) == 2.0
        adapter = prom.query(adapter_query(f'job="{JOB}"', "instance"))
        assert scalar(adapter) == 2.0 and adapter[0]["metric"] == {"instance": instance}

    def counts(total: float) -> dict[str, float]:
        codes = prom.wait_for(f'sum by (code) (advantage_requests_total{{job="{JOB}", method="ComputeAdvantage"}})',
                              lambda r: sum(float(s["value"][1]) for s in r) == total)
        return {s["metric"]["code"]: float(s["value"][1]) for s in codes}

    try:
        with AdvantageClient(srv.address, timeout=30.0) as client:
            assert client.list_estimators()  # a ListEstimators series of the in-flight gauge too
        assert scalar(prom.wait_for(f'up{{job="{JOB}"}}', lambda r: len(r) == 1 and scalar(r) == 1.0)) == 1.0
        round_of_calls(hpa_metric)
        # a counter's first sample gives rate() nothing: the second round is what the rates see
        assert counts(3.0) == {"OK": 1.0, "RESOURCE_EXHAUSTED": 1.0, "DEADLINE_EXCEEDED": 1.0}
        round_of_calls(lambda: None)
        assert counts(6.0) == {"OK": 2.0, "RESOURCE_EXHAUSTED": 2.0, "DEADLINE_EXCEEDED": 2.0}
        assert scalar(prom.query(f'sum(advantage_requests_in_flight{{job="{JOB}"}})')) == 0.0
        rate = prom.wait_for(f'sum(rate(advantage_requests_total{{job="{JOB}"}}[1m]))', lambda r: r and scalar(r) > 0)
        assert 0 < scalar(rate) < 1.0  # 3 calls in the last seconds, over a minute's window at most

        # the alert rules' own expressions on the live series: 1 in 3 of the second round's calls each (above
        # both thresholds)
        for alert in ("AdvantageRefusalsRising", "AdvantageDeadlineExceeded"):
            ratio = prom.wait_for(rule_expr(alert).rsplit(">", 1)[0], lambda r: len(r) == 1)
            assert ratio[0]["metric"] == {"instance": instance, "job": JOB}
            assert 0.25 < scalar(ratio) < 0.4, alert  # 1/3, give or take rate()'s extrapolation per series
        memory = prom.query(rule_expr("AdvantageMemoryNearLimit").rsplit(">", 1)[0])
        assert 50e6 < scalar(memory) < 0.9 * 16 * 2 ** 30  # the server's own resident memory
        assert 0 < scalar(prom.query(f'time() - process_start_time_seconds{{job="{JOB}"}}')) < 3600
        assert scalar(prom.query(f'advantage_kernel_signatures{{job="{JOB}"}}')) >= 0

        # Prometheus loaded every rule and evaluates it without error; the refusal and deadline alerts are
        # pending (their `for:` has not passed), the others silent
        loaded = [r for g in prom.get("/api/v1/rules")["groups"] for r in g["rules"]]
        assert len(loaded) == 6 and all(r["health"] == "ok" for r in loaded), loaded
        alerts = prom.wait_for("ALERTS", lambda r: len(r) >= 2)
        assert {(a["metric"]["alertname"], a["metric"]["alertstate"]) for a in alerts} == \
            {("AdvantageRefusalsRising", "pending"), ("AdvantageDeadlineExceeded", "pending")}
    finally:
        release.set()
        prom.stop()
        srv.stop(grace=1.0)
