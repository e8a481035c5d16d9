"""deploy/prometheus/alerts.yaml and deploy/k8s/prometheusrule.yaml: promtool accepts the rules and passes their
unit tests (alerts.test.yaml: each alert fires on its case and stays silent on the near misses), a broken rule
fails those tests, the PrometheusRule carries the same groups, and every series the rules read is one the server
exports (so a renamed metric breaks this test, not the alerts in production).

Needs `promtool` (Debian's `prometheus` package; .ci/run installs it): skipped with that reason where missing."""
from __future__ import annotations

import pathlib
import re
import shutil
import subprocess

import pytest
import torch
import yaml

from advantage_server.metrics import ServerMetrics
from advantage_server.warmup import KernelCollector

ROOT = pathlib.Path(__file__).resolve().parent.parent
RULES_DIR = ROOT / "deploy" / "prometheus"
RULES = RULES_DIR / "alerts.yaml"
RULE_TESTS = RULES_DIR / "alerts.test.yaml"
OPERATOR_RULE = ROOT / "deploy" / "k8s" / "prometheusrule.yaml"
DEPLOYMENT = ROOT / "deploy" / "k8s" / "deployment.yaml"
PROMTOOL = shutil.which("promtool")
needs_promtool = pytest.mark.skipif(PROMTOOL is None, reason="promtool is not installed (apt-get install prometheus)")
#: Series the rules read that come from elsewhere: Prometheus's own scrape health, and kube-state-metrics.
EXTERNAL = {"up", "kube_pod_status_ready"}
ALERTS = {"AdvantageReplicaDown", "AdvantageReplicaNotServing", "AdvantageRefusalsRising",
          "AdvantageDeadlineExceeded", "AdvantageMemoryNearLimit", "AdvantageKernelCompiledAfterServing"}


def rules() -> list[dict]:
    return [rule for group in yaml.safe_load(RULES.read_text())["groups"] for rule in group["rules"]]


def promtool(*args: str, cwd: pathlib.Path = RULES_DIR) -> subprocess.CompletedProcess:
    return subprocess.run([PROMTOOL, *args], cwd=cwd, capture_output=True, text=True, timeout=60)


@needs_promtool
def test_promtool_accepts_the_rules():
    proc = promtool("check", "rules", RULES.name)
    assert proc.returncode == 0 and f"SUCCESS: {len(ALERTS)} rules found" in proc.stdout, proc.stdout + proc.stderr


@needs_promtool
def test_the_local_prometheus_config_is_valid_and_loads_the_rules():
    """deploy/prometheus/prometheus.yml (docs/observability.md's local scrape, issue #37 item 5): promtool accepts it,
    with alerts.yaml found beside it, and it scrapes port 9464, not Prometheus's own 9090."""
    proc = promtool("check", "config", "prometheus.yml")
    assert proc.returncode == 0 and "SUCCESS: 1 rule files found" in proc.stdout, proc.stdout + proc.stderr
    import yaml
    config = yaml.safe_load((RULES_DIR / "prometheus.yml").read_text())
    assert config["scrape_configs"][0]["static_configs"] == [{"targets": ["127.0.0.1:9464"]}]


@needs_promtool
def test_promtool_unit_tests_pass():
    proc = promtool("test", "rules", RULE_TESTS.name)
    assert proc.returncode == 0 and "SUCCESS" in proc.stdout, proc.stdout + proc.stderr


@needs_promtool
@pytest.mark.parametrize("broken", [
    ("> 0.05", "> 0.5"),                  # refusals: 10 % no longer fires
    ("> 0.01", "> 0.001"),                # deadline-exceeded: 0.5 % now fires
    ("0.9 * 17179869184", "0.99 * 17179869184"),  # memory: 16e9 no longer fires
    ("> 600", "> 0"),                     # kernel compiles: the warm-up's now fire
    ("for: 2m", "for: 0m"),               # replica down: a one-scrape blip now fires
])
def test_unit_tests_fail_on_a_broken_rule(tmp_path, broken):
    old, new = broken
    text = RULES.read_text()
    assert old in text
    (tmp_path / RULES.name).write_text(text.replace(old, new, 1))
    shutil.copy(RULE_TESTS, tmp_path / RULE_TESTS.name)
    proc = promtool("test", "rules", RULE_TESTS.name, cwd=tmp_path)
    assert proc.returncode != 0 and "FAILED" in proc.stdout + proc.stderr, proc.stdout + proc.stderr


def test_every_alert_has_a_firing_and_a_silent_unit_test():
    assert {r["alert"] for r in rules()} == ALERTS
    cases = [case for test in yaml.safe_load(RULE_TESTS.read_text())["tests"] for case in test["alert_rule_test"]]
    for alert in ALERTS:
        mine = [c for c in cases if c["alertname"] == alert]
        assert any(c.get("exp_alerts") for c in mine), f"{alert}: no unit test where it fires"
        assert any(not c.get("exp_alerts") for c in mine), f"{alert}: no unit test where it stays silent"
    for rule in rules():
        assert rule["labels"]["severity"] in ("critical", "warning", "info") and rule["annotations"]["summary"]


def test_the_operator_rule_carries_the_same_groups(tmp_path):
    doc = yaml.safe_load(OPERATOR_RULE.read_text())
    assert doc["apiVersion"] == "monitoring.coreos.com/v1" and doc["kind"] == "PrometheusRule"
    assert doc["metadata"]["name"] == "advantage-service" and set(doc["spec"]) == {"groups"}
    assert doc["spec"]["groups"] == yaml.safe_load(RULES.read_text())["groups"]
    if PROMTOOL:  # the operator hands spec.groups to Prometheus as a rules file
        (tmp_path / "operator.yaml").write_text(yaml.safe_dump({"groups": doc["spec"]["groups"]}))
        proc = promtool("check", "rules", "operator.yaml", cwd=tmp_path)
        assert proc.returncode == 0, proc.stdout + proc.stderr


def exported_series() -> set[str]:
    """The sample names a server's /metrics has (the CPU device; the collectors are the server's own)."""
    metrics = ServerMetrics(torch.device("cpu"))
    metrics.registry.register(KernelCollector())
    metrics.requests.labels("ComputeAdvantage", "grpo", "OK").inc()
    metrics.in_flight.labels("ComputeAdvantage").set(0)
    return {sample.name for family in metrics.registry.collect() for sample in family.samples}


def test_the_rules_read_only_series_the_server_exports():
    exported = exported_series()
    for rule in rules():
        names = set(re.findall(r"([a-zA-Z_:][a-zA-Z0-9_:]*)\{", rule["expr"]))  # every series has a selector
        assert names, rule["alert"]
        unknown = names - exported - EXTERNAL
        assert not unknown, f"{rule['alert']} reads {unknown}, which the server does not export"


def test_the_memory_threshold_is_90_percent_of_the_deployments_limit():
    deployment = yaml.safe_load(DEPLOYMENT.read_text())
    limit = deployment["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"]["memory"]
    assert limit.endswith("Gi")
    rule = next(r for r in rules() if r["alert"] == "AdvantageMemoryNearLimit")
    assert f"> 0.9 * {int(limit[:-2]) * 2 ** 30}" in rule["expr"] and limit in rule["annotations"]["summary"]
