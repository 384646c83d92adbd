"""The chart's tests must catch a broken chart, not just a changed one: each mutation below
breaks one thing the processes or the cluster depend on, in a scratch copy of the chart;
test_chart.py's checks of behaviour then run against that copy (CHECKS: without its
goldens) and must fail. A mutation that its checks
let through is a hole in them.
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "deploy" / "helm" / "chunkserve"

# (name, template file, regex, replacement): each regex must match in the file.
MUTATIONS = [
    ("probes on the gRPC port", "_helpers.tpl",
     r"(httpGet:\n    path: /healthz\n    port: )ops", r"\1grpc"),
    ("readiness on /healthz", "_helpers.tpl",
     r"(readinessProbe:\n  httpGet:\n    path: )/readyz", r"\1/healthz"),
    ("monitor scraping the gRPC port", "monitor.yaml", r"- port: ops", "- port: grpc"),
    ("router Service targeting the ops port", "router.yaml",
     r"(port: \{\{ int64 \$r.service.port \}\}\n      targetPort: )grpc", r"\1ops"),
    ("NetworkPolicy without the release's pods", "networkpolicy.yaml",
     r"  ingress:\n    - from:\n        - podSelector:\n            matchLabels:\n"
     r"              \{\{- include \"chunkserve.releaseLabels\" \. \| nindent 14 \}\}\n",
     "  ingress:\n"),
    ("preStop shorter than the DNS refresh", "_helpers.tpl",
     r"int64 \.preStopSleepSeconds \| toString", "1 | toString"),
    ("preStop from the margin", "_helpers.tpl",
     r"int64 \.preStopSleepSeconds \| toString", "int64 .graceMarginSeconds | toString"),
    ("prefill discovers itself as the decode pool", "_pool.tpl",
     r'printf "%s-decode\.%s\.svc', 'printf "%s-prefill.%s.svc'),
    ("hard-coded KEDA address", "_pool.tpl",
     r"serverAddress: \{\{ \.root\.Values\.prometheus\.serverAddress \| quote \}\}",
     'serverAddress: "http://prometheus:9090"'),
    ("decode KV port from the prefill values", "_pool.tpl",
     r"(CHUNKSERVE_KV_PORT\n              value: \{\{ int64 )\$p\.ports\.kv", r"\1$root.Values.prefill.ports.kv"),
    ("PDB forced to 0", "_pool.tpl",
     r"maxUnavailable: \{\{ \$p\.pdb\.maxUnavailable \}\}", "maxUnavailable: 0"),
    ("worker ops port bound to the gRPC port", "_pool.tpl",
     r"(CHUNKSERVE_HTTP_PORT\n              value: \{\{ int64 )\$p\.ports\.ops", r"\1$p.ports.grpc"),
    ("router dials the decode pool on the KV port", "router.yaml",
     r"(-decode\.%s:%d\" \(include \"chunkserve.fullname\" \.\) \$domain \(int64 )\.Values\.decode\.ports\.grpc",
     r"\1.Values.decode.ports.kv"),
    ("KV advertised as 0.0.0.0", "_pool.tpl",
     r'(CHUNKSERVE_KV_ADVERTISE\n              value: )"\$\(POD_IP\)"', r'\1"0.0.0.0"'),
    ("Ingress to the router's gRPC port", "public.yaml", r"name: openai", "name: grpc"),
    ("HTTPRoute to the gRPC Service port", "public.yaml",
     r"port: \{\{ int64 \.Values\.router\.service\.openaiPort \}\}",
     "port: {{ int64 .Values.router.service.port }}"),
    ("scale-in check dropped", "_helpers.tpl",
     r"\{\{- if lt \(int64 \.c\.terminationGracePeriodSeconds\) \$need \}\}", "{{- if false }}"),
]


# test_chart.py's checks of what the chart does, less the goldens (a developer regenerates
# them after any change, so they prove nothing here) and the slow checks of form (lint,
# Kubernetes schemas at two versions, yamllint, live processes), which a valid-looking
# mutation passes anyway.
CHECKS = ("not golden and not lint and not objects_validate and not yamllint and not live "
          "and not env_parses and not config_schema and not schema_accepts and not crd_schemas")


def suite_on(chart: Path, bin_dir: Path) -> subprocess.CompletedProcess:
    """test_chart.py's CHECKS against the chart at `chart`."""
    env = dict(os.environ, CS_CHART_DIR=str(chart), CHUNKSERVE_BIN_DIR=str(bin_dir))
    env.pop("CS_UPDATE_GOLDEN", None)
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider",
                           "-k", CHECKS, str(REPO / "tests" / "deploy" / "test_chart.py")],
                          env=env, capture_output=True, text=True, timeout=600, cwd=REPO)


@pytest.fixture(scope="module")
def baseline(tmp_path_factory, bin_dir):
    """The unmutated scratch copy passes: a mutation's failure is then its own, not the
    environment's."""
    chart = tmp_path_factory.mktemp("baseline") / "chunkserve"
    shutil.copytree(CHART, chart)
    p = suite_on(chart, bin_dir)
    assert p.returncode == 0, f"the unmutated copy fails:\n{p.stdout[-3000:]}"


@pytest.mark.parametrize("mutation", MUTATIONS, ids=[m[0] for m in MUTATIONS])
def test_a_broken_chart_fails_the_tests(mutation, tmp_path, bin_dir, baseline):
    name, file, pattern, repl = mutation
    chart = tmp_path / "chunkserve"
    shutil.copytree(CHART, chart)
    f = chart / "templates" / file
    text = f.read_text()
    mutated, n = re.subn(pattern, repl, text)
    assert n >= 1, f"{name}: the pattern no longer matches {file}: update the mutation"
    f.write_text(mutated)
    p = suite_on(chart, bin_dir)
    assert p.returncode == 1, f"{name}: the chart's tests did not catch it:\n{p.stdout[-3000:]}"
