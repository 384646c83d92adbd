"""The Helm chart (deploy/helm/chunkserve), checked offline for every values file
in its ci/ matrix:

- Helm's own Go engine (PyPI helm-python-sdk: libhelm_c, Helm v4): lint --strict,
  values.schema.json validation, render;
- every rendered Kubernetes object against the Kubernetes OpenAPI schemas of
  kubernetes-validate in strict mode (unknown fields refused) at the chart's minimum
  Kubernetes version (Chart.yaml kubeVersion: 1.29) and at the newest it ships; a kind
  without a schema fails;
- the CRD objects (KEDA ScaledObject, PodMonitor, ServiceMonitor) against the schemas
  in tests/deploy/crd/ (unknown fields refused);
- yamllint on the renders, and the renders against the committed goldens
  (tests/deploy/golden/; CS_UPDATE_GOLDEN=1 rewrites them);
- structure: selectors match pod labels, named ports exist, one autoscaler per pool,
  the scale-in arithmetic, bind addresses, discovery, security settings;
- the processes' side: every CHUNKSERVE_* variable the chart sets is a flag in the
  binary's own config table (--help-json) and parses in the real binary; the
  autoscaling queries name metrics that live tiny-model processes export.

What this cannot check (no cluster here): scheduling, DNS, Prometheus/KEDA/adapter
behaviour; see docs/deploy.md.
"""
from __future__ import annotations

import base64
import copy
import json
import math
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import yaml
from yamllint import config as yamllint_config
from yamllint import linter as yamllint_linter

import helm_python as helm

REPO = Path(__file__).resolve().parents[2]
# CS_CHART_DIR: a copy of the chart to check instead (test_chart_mutations.py)
CHART = Path(os.environ.get("CS_CHART_DIR") or REPO / "deploy" / "helm" / "chunkserve")
HERE = Path(__file__).resolve().parent
GOLDEN = HERE / "golden"
CRD_DIR = HERE / "crd"
CI_VALUES = sorted((CHART / "ci").glob("*-values.yaml"))
CI_IDS = [p.name[: -len("-values.yaml")] for p in CI_VALUES]

RELEASE, NAMESPACE = "cs", "serving"
# Kubernetes versions the renders are validated against: the chart's minimum
# (Chart.yaml kubeVersion >=1.29) and the newest kubernetes-validate ships.
KUBE_MIN = "1.29"
KUBE_VERSIONS = [KUBE_MIN, kubernetes_validate.latest_version()]
CRD_SCHEMAS = {
    ("keda.sh/v1alpha1", "ScaledObject"): "keda-scaledobject.json",
    ("monitoring.coreos.com/v1", "PodMonitor"): "podmonitor.json",
    ("monitoring.coreos.com/v1", "ServiceMonitor"): "servicemonitor.json",
    ("gateway.networking.k8s.io/v1", "HTTPRoute"): "httproute.json",
}
RBAC_KINDS = {"ServiceAccount", "Role", "ClusterRole", "RoleBinding", "ClusterRoleBinding"}
IMAGE_UID = 10001
# After a worker's drain (grace-ms) its RPC server gets a 3 s backstop before the
# process tears down (worker/worker.c close_server): part of what the pod must outlive.
RPC_BACKSTOP_S = 3
ROLES = ("router", "prefill", "decode")
# CHUNKSERVE_* variables that are not config-table flags.
NON_FLAG_ENV = {"CHUNKSERVE_BACKEND"}  # kernels/backend.c: cpu|cuda|auto


# ---------------------------------------------------------------- helpers

def load_values(path: Path) -> dict:
    return yaml.safe_load(path.read_text()) or {}


# The one value the chart requires (clusterSecret.existingSecret: the chart makes
# nothing random): the hand-written cases below start from it, the values win.
REQUIRED = {"clusterSecret": {"existingSecret": "chunkserve-cluster"}}


def with_required(values: dict) -> dict:
    return deep_merge(REQUIRED, values)


def render(values: dict) -> dict:
    """Template path -> rendered text (Helm's engine, offline)."""
    with helm.Chart.load(str(CHART)) as chart:
        return chart.render(values=with_required(values), name=RELEASE, namespace=NAMESPACE)


def manifest_text(rendered: dict) -> str:
    """The manifests as `helm template` prints them (NOTES.txt left out)."""
    parts = []
    for path in sorted(rendered):
        text = rendered[path].strip()
        if path.endswith("NOTES.txt") or not text:
            continue
        for doc in re.split(r"^---\s*$", text, flags=re.M):
            if doc.strip():
                parts.append(f"---\n# Source: {path}\n{doc.strip()}\n")
    return "".join(parts)


def objects(text: str) -> list:
    return [d for d in yaml.safe_load_all(text) if d]


def merged_values(values: dict) -> dict:
    with helm.Chart.load(str(CHART)) as chart:
        return chart.merge_values(values)


def deep_merge(base: dict, over: dict) -> dict:
    out = copy.deepcopy(base)
    for k, v in over.items():
        out[k] = deep_merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def selector_matches(selector: dict, labels: dict) -> bool:
    """A LabelSelector (matchLabels + matchExpressions) or a plain selector map."""
    if "matchLabels" in selector or "matchExpressions" in selector:
        ml, exprs = selector.get("matchLabels") or {}, selector.get("matchExpressions") or []
    else:
        ml, exprs = selector, []
    if any(labels.get(k) != v for k, v in ml.items()):
        return False
    for e in exprs:
        has, val = e["key"] in labels, labels.get(e["key"])
        op = e["operator"]
        if op == "In" and val not in e["values"]: return False
        if op == "NotIn" and has and val in e["values"]: return False
        if op == "Exists" and not has: return False
        if op == "DoesNotExist" and has: return False
    return True


def pod_labels(dep: dict) -> dict:
    return dep["spec"]["template"]["metadata"]["labels"]


def containers(dep: dict) -> list:
    return dep["spec"]["template"]["spec"]["containers"]


def port_names(dep: dict) -> set:
    return {p["name"] for c in containers(dep) for p in c.get("ports", []) if "name" in p}


def env_of(container: dict) -> dict:
    return {e["name"]: e for e in container.get("env", [])}


def component(obj: dict) -> str:
    return obj["metadata"]["labels"]["app.kubernetes.io/component"]


class Render:
    """One values file's render, parsed."""

    def __init__(self, name: str, values: dict):
        self.name, self.values = name, values
        self.rendered = render(values)
        self.text = manifest_text(self.rendered)
        self.objs = objects(self.text)
        self.merged = merged_values(with_required(values))

    def kind(self, kind: str) -> list:
        return [o for o in self.objs if o["kind"] == kind]

    def deployment(self, role: str):
        deps = [d for d in self.kind("Deployment") if component(d) == role]
        assert len(deps) <= 1, f"{self.name}: {len(deps)} Deployments for {role}"
        return deps[0] if deps else None


@pytest.fixture(scope="session")
def renders() -> dict:
    return {i: Render(i, load_values(p)) for i, p in zip(CI_IDS, CI_VALUES)}


# ------------------------------------------------ the processes' own tables

def help_table(exe: Path) -> list:
    """The binary's own config table, from `--help-json`: [{"name", "env", "type",
    "default", "help", ("min", "max")}] (ops/src/config.c cs_config_print_json)."""
    proc = subprocess.run([str(exe), "--help-json"], capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0, f"{exe.name} --help-json: exit {proc.returncode}: {proc.stderr[-1000:]}"
    table = json.loads(proc.stdout)
    assert isinstance(table, list) and table and all(
        {"name", "env", "type", "default"} <= set(e) for e in table), proc.stdout[:500]
    return table


@pytest.fixture(scope="session")
def flag_tables(bin_dir) -> dict:
    tables = {}
    for role in ROLES:
        exe = bin_dir / f"chunkserve-{role}"
        if not exe.is_file():
            pytest.skip(f"{exe} not built")
        tables[role] = help_table(exe)
    return tables


# --------------------------------------------------------- Helm engine

@pytest.mark.parametrize("values_file", CI_VALUES, ids=CI_IDS)
def test_lint_strict(values_file):
    report = helm.lint(str(CHART), load_values(values_file), strict=True, namespace=NAMESPACE,
                       kube_version=f"v{KUBE_MIN}.0")
    # severity 1 = info ("icon is recommended"); warnings and errors fail (--strict).
    bad = [m for m in report["messages"] if m["severity"] >= 2]
    assert not bad and not report["errors"], json.dumps(report, indent=2)


@pytest.mark.parametrize("values_file", CI_VALUES, ids=CI_IDS)
def test_schema_accepts(values_file):
    with helm.Chart.load(str(CHART)) as chart:
        chart.validate_schema(load_values(values_file))


BAD_SCHEMA_VALUES = {
    "unknown top-level key": {"replicaCount": 2},
    "unknown pool key": {"prefill": {"replica": 2}},
    "unknown autoscaling key": {"decode": {"autoscaling": {"targetKvUsage": 0.8}}},
    "chart-managed flag in config": {"decode": {"config": {"kv-port": 6000}}},
    "unknown config key (a typo)": {"decode": {"config": {"max-batch-tokens": 4096}}},
    "another binary's flag in config": {"decode": {"config": {"dns-refresh-ms": 1000}}},
    "config value out of the flag's range": {"prefill": {"config": {"threads": -1}}},
    "config value of the wrong type": {"router": {"config": {"dns-refresh-ms": "soon"}}},
    "secret as a config value": {"router": {"config": {"api-key": "sk-plain"}}},
    "flag name with underscores": {"prefill": {"config": {"max_batched_tokens": 4096}}},
    "gpu without nvidia.com/gpu": {"prefill": {"gpu": {"enabled": True}}},
    "minReplicas 0": {"prefill": {"autoscaling": {"minReplicas": 0}}},
    "both engines": {"decode": {"autoscaling": {"engine": "both"}}},
    "kv usage target above 1": {"decode": {"autoscaling": {"kvCacheUsageTarget": 1.5}}},
    "margin below the RPC backstop": {"decode": {"graceMarginSeconds": 2}},
    "unknown router key": {"router": {"openai": {"port": 8000}}},
    "image tag latest": {"image": {"tag": "latest"}},
    "PDB that blocks every drain (0%)": {"decode": {"pdb": {"maxUnavailable": "0%"}}},
    "quantity the API server refuses (4GB)": {"decode": {"resources": {"limits": {"memory": "4GB"}}}},
    "upper-case name": {"fullnameOverride": "ChunkServe"},
    "unknown eviction policy": {"prefill": {"pdb": {"unhealthyPodEvictionPolicy": "Never"}}},
    "unknown KEDA fallback behavior": {"decode": {"autoscaling": {"fallback": {"behavior": "max"}}}},
    "unknown Prometheus auth mode": {"prometheus": {"authModes": "oauth"}},
}


@pytest.mark.parametrize("values", BAD_SCHEMA_VALUES.values(), ids=BAD_SCHEMA_VALUES.keys())
def test_schema_refuses(values):
    with helm.Chart.load(str(CHART)) as chart:
        with pytest.raises(helm.HelmValuesError):
            chart.validate_schema(values)
        chart.validate_schema(with_required({}))  # the required values alone pass
    report = helm.lint(str(CHART), with_required(values), strict=True, namespace=NAMESPACE)
    assert report["errors"], f"lint accepted {values}"
    assert any("schema" in str(e).lower() for e in report["errors"]), report["errors"]


BAD_RENDER_VALUES = {
    "grace below preStop + grace-ms + margin": (
        {"prefill": {"terminationGracePeriodSeconds": 20}}, "terminationGracePeriodSeconds 20 is too short"),
    "grace-ms raised without the pod's grace": (
        {"decode": {"config": {"grace-ms": 60000}}}, "decode: terminationGracePeriodSeconds 50 is too short"),
    "router grace too short": (
        {"router": {"terminationGracePeriodSeconds": 10}}, "router: terminationGracePeriodSeconds 10 is too short"),
    "preStop shorter than the routers' DNS refresh": (
        {"router": {"config": {"dns-refresh-ms": 20000}}}, "shorter than the router's dns-refresh-ms"),
    "autoscaling without monitoring": (
        {"prefill": {"autoscaling": {"enabled": True}}}, "needs monitoring.enabled"),
    "model outside its volume": (
        {"model": {"path": "/data/m.gguf", "volume": {"persistentVolumeClaim": {"claimName": "m"}}}},
        "is not under model.mountPath"),
    "static discovery without decode workers": (
        {"router": {"discovery": "static"}}, "needs router.staticWorkers.decode"),
    "dns discovery without a decode pool": ({"decode": {"enabled": False}}, "needs decode.enabled"),
    "apiKey without a value": ({"apiKey": {"enabled": True}}, "apiKey.enabled needs apiKey.existingSecret"),
    "apiKey value and existingSecret": (
        {"apiKey": {"enabled": True, "value": "k", "existingSecret": "s"}}, "not both"),
    "cluster secret without existingSecret": (
        {"clusterSecret": {"existingSecret": ""}}, "clusterSecret.enabled needs clusterSecret.existingSecret"),
    "two autoscaling engines in one release": (
        {"monitoring": {"enabled": True}, "prefill": {"autoscaling": {"enabled": True, "engine": "keda"}},
         "decode": {"autoscaling": {"enabled": True, "engine": "hpa"}}}, "use one engine per release"),
    "a rollout that cannot progress": (
        {"decode": {"rollingUpdate": {"maxSurge": 0, "maxUnavailable": 0}}}, "both 0"),
    "a rollout that cannot progress (0%)": (
        {"prefill": {"rollingUpdate": {"maxSurge": "0%", "maxUnavailable": 0}}}, "both 0"),
    "two container ports alike": ({"decode": {"ports": {"ops": 50060}}}, "port 50060 is used twice"),
    "extraEnv replacing a variable the chart sets": (
        {"prefill": {"extraEnv": [{"name": "CHUNKSERVE_PORT", "value": "1"}]}}, "which the chart sets itself"),
    "extraEnv replacing a config: key": (
        {"decode": {"extraEnv": [{"name": "CHUNKSERVE_THREADS", "value": "8"}]}}, "which the chart sets itself"),
    "a GPU limit without gpu.enabled": (
        {"prefill": {"resources": {"limits": {"nvidia.com/gpu": 1}}}}, "gpu.enabled is false"),
    "ingress without hosts": ({"ingress": {"enabled": True}}, "ingress.enabled needs ingress.hosts"),
    "public TLS without a Secret": ({"router": {"publicTls": {"enabled": True}}}, "needs router.publicTls.secretName"),
    "httpRoute without a Gateway": ({"httpRoute": {"enabled": True}}, "needs httpRoute.parentRefs"),
    "public door without the OpenAI port": (
        {"router": {"ports": {"openai": 0}}, "ingress": {"enabled": True, "hosts": ["a.example.com"]}},
        "need router.ports.openai"),
    "gpu.enabled with nvidia.com/gpu 0": (
        {"prefill": {"gpu": {"enabled": True}, "resources": {"limits": {"nvidia.com/gpu": 0}}}},
        "needs at least 1"),
    "minReplicas above maxReplicas": (
        {"monitoring": {"enabled": True}, "decode": {"autoscaling": {"enabled": True, "minReplicas": 5, "maxReplicas": 2}}},
        "minReplicas (5) > maxReplicas (2)"),
}


@pytest.mark.parametrize("case", BAD_RENDER_VALUES.values(), ids=BAD_RENDER_VALUES.keys())
def test_render_refuses(case):
    values, message = case
    with pytest.raises(helm.HelmError) as e:
        render(values)
    assert message in str(e.value), str(e.value)


@pytest.mark.parametrize("values_file", CI_VALUES, ids=CI_IDS)
def test_renders_are_stable(values_file):
    """GitOps (helm template, Argo CD, Flux) renders the chart again and again: nothing
    random or time-dependent may appear, or every sync would change the cluster secret or
    restart pods."""
    v = load_values(values_file)
    assert manifest_text(render(v)) == manifest_text(render(v))


def test_grace_boundary_renders():
    """Exactly preStop + grace + margin is enough (the check is >=, not >)."""
    objs = objects(manifest_text(render({"prefill": {"terminationGracePeriodSeconds": 15 + 5 + 5}})))
    dep = [o for o in objs if o["kind"] == "Deployment" and component(o) == "prefill"][0]
    assert dep["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] == 25


# ------------------------------------------------------ schemas of objects

@pytest.mark.parametrize("name", CI_IDS)
def test_objects_validate(renders, name):
    r = renders[name]
    assert r.objs, f"{name}: nothing rendered"
    failures = []
    for obj in r.objs:
        key = (obj.get("apiVersion"), obj.get("kind"))
        what = f"{obj.get('kind')}/{obj.get('metadata', {}).get('name')}"
        if key in CRD_SCHEMAS:
            schema = json.loads((CRD_DIR / CRD_SCHEMAS[key]).read_text())
            errs = sorted(jsonschema.Draft7Validator(schema).iter_errors(obj), key=str)
            failures += [f"{what} (CRD schema): {e.message} at {list(e.absolute_path)}" for e in errs]
            continue
        for version in KUBE_VERSIONS:
            try:
                kubernetes_validate.validate(obj, version, strict=True)
            except kubernetes_validate.SchemaNotFoundError:
                failures.append(f"{what}: no schema for {key} in Kubernetes {version}")
            except kubernetes_validate.ValidationError as e:
                failures.append(f"{what} (Kubernetes {version}): {e.message} at {list(e.path)}")
    assert not failures, "\n".join(failures)


def test_crd_schemas_refuse_unknown_fields():
    """The CRD schemas are strict: an unknown field anywhere fails, a known one passes."""
    r = Render("keda", load_values(CHART / "ci" / "keda-values.yaml"))
    so = r.kind("ScaledObject")[0]
    schema = json.loads((CRD_DIR / "keda-scaledobject.json").read_text())
    jsonschema.validate(so, schema)
    for path, field in [([], "status"), (["spec"], "minReplicas"), (["spec", "triggers", 0], "threshold"),
                        (["spec", "triggers", 0, "metadata"], "querry"),
                        (["spec", "advanced", "horizontalPodAutoscalerConfig", "behavior", "scaleUp"], "window")]:
        bad = copy.deepcopy(so)
        node = bad
        for p in path:
            node = node[p]
        node[field] = "1"
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
    pm = r.kind("PodMonitor")[0]
    pm_schema = json.loads((CRD_DIR / "podmonitor.json").read_text())
    jsonschema.validate(pm, pm_schema)
    bad = copy.deepcopy(pm)
    bad["spec"]["podMetricsEndpoints"][0]["relabelings"][0]["target_label"] = "x"
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(bad, pm_schema)


def test_every_kind_is_checked(renders):
    """Every kind the matrix renders has a schema here (none slips through unvalidated)."""
    kinds = {(o["apiVersion"], o["kind"]) for r in renders.values() for o in r.objs}
    expected = {("apps/v1", "Deployment"), ("v1", "Service"), ("policy/v1", "PodDisruptionBudget"),
                ("autoscaling/v2", "HorizontalPodAutoscaler"), ("networking.k8s.io/v1", "NetworkPolicy"),
                ("networking.k8s.io/v1", "Ingress"), ("v1", "Secret"), *CRD_SCHEMAS}
    assert kinds == expected, f"rendered kinds {sorted(kinds)} != the matrix's expected {sorted(expected)}"


# ----------------------------------------------------- yamllint, goldens

@pytest.mark.parametrize("name", CI_IDS)
def test_yamllint(renders, name):
    conf = yamllint_config.YamlLintConfig(file=str(HERE / "yamllint.yaml"))
    problems = [f"{p.line}:{p.column} {p.rule}: {p.desc}"
                for p in yamllint_linter.run(renders[name].text, conf)]
    assert not problems, "\n".join(problems[:40])


@pytest.mark.parametrize("name", CI_IDS)
def test_golden(renders, name):
    golden = GOLDEN / f"{name}.yaml"
    text = renders[name].text
    if os.environ.get("CS_UPDATE_GOLDEN") == "1":
        GOLDEN.mkdir(exist_ok=True)
        golden.write_text(text)
    assert golden.is_file(), f"{golden} missing (CS_UPDATE_GOLDEN=1 writes it)"
    if golden.read_text() != text:
        import difflib
        diff = "".join(difflib.unified_diff(golden.read_text().splitlines(True), text.splitlines(True),
                                            str(golden), "render", n=2))
        pytest.fail(f"render differs from {golden} (CS_UPDATE_GOLDEN=1 rewrites it):\n{diff[:6000]}")


def test_no_stale_goldens():
    assert sorted(p.stem for p in GOLDEN.glob("*.yaml")) == sorted(CI_IDS)


def test_matrix_is_complete():
    assert set(CI_IDS) >= {"default", "keda", "hpa", "monitoring", "gpu", "netpol", "static-workers",
                           "single-replica", "public", "tls"}


# ------------------------------------------------------------- structure

@pytest.mark.parametrize("name", CI_IDS)
def test_selectors_and_ports(renders, name):
    r = renders[name]
    deps = r.kind("Deployment")
    for d in deps:
        sel = d["spec"]["selector"]["matchLabels"]
        assert selector_matches(sel, pod_labels(d)), f"{d['metadata']['name']}: selector {sel} misses its pods"
        others = [o for o in deps if o is not d and selector_matches(sel, pod_labels(o))]
        assert not others, f"{d['metadata']['name']}: selector also matches {[o['metadata']['name'] for o in others]}"
        names = port_names(d)
        for c in containers(d):
            for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
                port = c[probe]["httpGet"]["port"]
                assert port in names, f"{d['metadata']['name']}: {probe} port {port} not a container port"
    for svc in r.kind("Service"):
        matched = [d for d in deps if selector_matches(svc["spec"]["selector"], pod_labels(d))]
        assert len(matched) == 1, f"Service {svc['metadata']['name']} selects {len(matched)} Deployments"
        for p in svc["spec"]["ports"]:
            tp = p["targetPort"]
            assert not isinstance(tp, str) or tp in port_names(matched[0]), \
                f"Service {svc['metadata']['name']}: targetPort {tp} not in {port_names(matched[0])}"
    for pdb in r.kind("PodDisruptionBudget"):
        matched = [d for d in deps if selector_matches(pdb["spec"]["selector"], pod_labels(d))]
        assert len(matched) == 1, f"PDB {pdb['metadata']['name']} selects {len(matched)} Deployments"
    for np_ in r.kind("NetworkPolicy"):
        matched = [d for d in deps if selector_matches(np_["spec"]["podSelector"], pod_labels(d))]
        assert matched, f"NetworkPolicy {np_['metadata']['name']} selects no pod"
        for rule in np_["spec"].get("ingress", []):
            for p in rule.get("ports", []):
                for d in matched:
                    assert not isinstance(p["port"], str) or p["port"] in port_names(d), \
                        f"NetworkPolicy {np_['metadata']['name']}: port {p['port']} not in {d['metadata']['name']}"
            for peer in rule.get("from", []):
                if "podSelector" in peer and "namespaceSelector" not in peer:
                    assert any(selector_matches(peer["podSelector"], pod_labels(d)) for d in deps)
    for mon in r.kind("PodMonitor"):
        matched = [d for d in deps if selector_matches(mon["spec"]["selector"], pod_labels(d))]
        assert {component(d) for d in matched} == {component(d) for d in deps}, "PodMonitor misses a component"
        for ep in mon["spec"]["podMetricsEndpoints"]:
            assert all(ep["port"] in port_names(d) for d in matched)
    for mon in r.kind("ServiceMonitor"):
        matched = [s for s in r.kind("Service") if selector_matches(mon["spec"]["selector"], s["metadata"]["labels"])]
        for ep in mon["spec"]["endpoints"]:
            scraped = [s for s in matched if ep["port"] in {p["name"] for p in s["spec"]["ports"]}]
            assert {component(s) for s in scraped} == {component(d) for d in deps}, \
                "ServiceMonitor misses a component"
    # the ops port (/metrics, unauthenticated) is never on the router's public Service
    # nor on any Service published outside the cluster
    for svc in r.kind("Service"):
        names = {p["name"] for p in svc["spec"]["ports"]}
        public = svc["spec"].get("type", "ClusterIP") != "ClusterIP" or (
            component(svc) == "router" and ("grpc" in names or "openai" in names))
        assert not (public and "ops" in names), f"Service {svc['metadata']['name']} publishes ops"


@pytest.mark.parametrize("name", CI_IDS)
def test_one_autoscaler_per_pool(renders, name):
    r = renders[name]
    deps = {d["metadata"]["name"]: d for d in r.kind("Deployment")}
    scalers = {}
    for o in r.kind("HorizontalPodAutoscaler") + r.kind("ScaledObject"):
        ref = o["spec"]["scaleTargetRef"]
        assert ref.get("kind", "Deployment") == "Deployment" and ref["name"] in deps, f"{o['kind']} targets {ref}"
        scalers.setdefault(ref["name"], []).append(o["kind"])
        lo = o["spec"].get("minReplicas", o["spec"].get("minReplicaCount"))
        hi = o["spec"].get("maxReplicas", o["spec"].get("maxReplicaCount"))
        assert 1 <= lo <= hi, f"{o['kind']} {o['metadata']['name']}: min {lo} max {hi}"
    for dep_name, kinds in scalers.items():
        assert len(kinds) == 1, f"{dep_name} has {kinds}: never HPA and ScaledObject for one pool"
    for dep_name, d in deps.items():
        if dep_name in scalers:
            assert "replicas" not in d["spec"], f"{dep_name}: replicas set although {scalers[dep_name]} scales it"
            assert component(d) in ("prefill", "decode")
        else:
            assert d["spec"].get("replicas", 0) >= 1
    for role in ("prefill", "decode"):
        as_ = r.merged[role]["autoscaling"]
        dep = r.deployment(role)
        if dep is not None and r.merged[role]["enabled"]:
            assert (dep["metadata"]["name"] in scalers) == as_["enabled"]
            if as_["enabled"]:
                want = "ScaledObject" if as_["engine"] == "keda" else "HorizontalPodAutoscaler"
                assert scalers[dep["metadata"]["name"]] == [want]


def behavior_of(o: dict) -> dict:
    if o["kind"] == "ScaledObject":
        return o["spec"]["advanced"]["horizontalPodAutoscalerConfig"]["behavior"]
    return o["spec"]["behavior"]


@pytest.mark.parametrize("name", CI_IDS)
def test_autoscaling_targets(renders, name):
    """The targets are the documented formulas of the values; up fast, down after the window."""
    r = renders[name]
    for o in r.kind("HorizontalPodAutoscaler") + r.kind("ScaledObject"):
        role = component(o)
        a = r.merged[role]["autoscaling"]
        b = behavior_of(o)
        assert b["scaleUp"]["stabilizationWindowSeconds"] == 0
        assert b["scaleDown"]["stabilizationWindowSeconds"] == a["scaleDownStabilizationSeconds"] > 0
        if o["kind"] == "ScaledObject":
            targets = {t["name"]: float(t["metadata"]["threshold"]) for t in o["spec"]["triggers"]}
            assert all(t["metricType"] == "AverageValue" for t in o["spec"]["triggers"])
        else:
            targets = {}
            for m in o["spec"]["metrics"]:
                spec = m[m["type"].lower()]
                q = str(spec["target"]["averageValue"])
                targets[spec["metric"]["name"]] = float(q[:-1]) / 1000 if q.endswith("m") else float(q)
        # predictive: the routers' replicas wanted, target 1: instead of the prefill queue's
        # target, beside the decode pool's two
        if role == "prefill":
            want = [1.0] if a["signal"] == "predictive" else \
                [math.ceil(a["prefillTokensPerSecond"] * a["backlogSeconds"])]
        else:
            want = [a["kvCacheUsageTarget"], a["waitingRequestsPerReplica"]] + \
                ([1.0] if a["signal"] == "predictive" else [])
        assert sorted(targets.values()) == sorted(want), f"{role} targets {targets}, want {want}"


@pytest.mark.parametrize("name", CI_IDS)
def test_pods(renders, name, flag_tables):
    """Security, probes, /dev/shm, scale-in arithmetic, bind addresses, ports in env."""
    r = renders[name]
    assert not [o for o in r.objs if o["kind"] in RBAC_KINDS], "the chart needs no RBAC or ServiceAccount"
    defaults = {role: {e["name"]: e["default"] for e in t} for role, t in flag_tables.items()}
    for d in r.kind("Deployment"):
        role, pod = component(d), d["spec"]["template"]["spec"]
        n = d["metadata"]["name"]
        assert pod["automountServiceAccountToken"] is False, n
        assert pod["securityContext"]["runAsNonRoot"] is True and pod["securityContext"]["runAsUser"] == IMAGE_UID, n
        shm = [v for v in pod["volumes"] if v["name"] == "dshm"][0]
        assert shm["emptyDir"]["medium"] == "Memory", n
        (c,) = containers(d)
        assert c["securityContext"]["readOnlyRootFilesystem"] is True, n
        assert c["securityContext"]["allowPrivilegeEscalation"] is False, n
        assert {m["mountPath"] for m in c["volumeMounts"]} >= {"/dev/shm", "/tmp"}, n
        assert c["args"] == [f"/usr/local/bin/chunkserve-{role}"], n
        # probes: startup and liveness on /healthz, readiness on /readyz; model loads get an hour
        assert c["startupProbe"]["httpGet"]["path"] == "/healthz"
        assert c["livenessProbe"]["httpGet"]["path"] == "/healthz"
        assert c["readinessProbe"]["httpGet"]["path"] == "/readyz"
        if role != "router":
            sp = c["startupProbe"]
            assert sp["periodSeconds"] * sp["failureThreshold"] >= 3600, f"{n}: startup budget under an hour"
        # scale-in: the kubelet's SIGKILL must come after preStop + the drain + the RPC backstop
        env = env_of(c)
        cmd = c["lifecycle"]["preStop"]["exec"]["command"]
        assert cmd[0] == "/bin/sleep", cmd
        pre_stop = int(cmd[1])
        grace_ms = int(env["CHUNKSERVE_GRACE_MS"]["value"]) if "CHUNKSERVE_GRACE_MS" in env \
            else int(defaults[role]["grace-ms"])
        need = pre_stop + math.ceil(grace_ms / 1000) + RPC_BACKSTOP_S
        assert pod["terminationGracePeriodSeconds"] > need, \
            f"{n}: terminationGracePeriodSeconds {pod['terminationGracePeriodSeconds']} <= preStop {pre_stop} + " \
            f"grace {grace_ms} ms + {RPC_BACKSTOP_S} s backstop"
        # bind addresses and the ports the process listens on
        assert env["CHUNKSERVE_HOST"]["value"] == "0.0.0.0" and env["CHUNKSERVE_HTTP_HOST"]["value"] == "0.0.0.0"
        ports = {p["name"]: p["containerPort"] for p in c["ports"]}
        assert int(env["CHUNKSERVE_PORT"]["value"]) == ports["grpc"]
        assert int(env["CHUNKSERVE_HTTP_PORT"]["value"]) == ports["ops"]
        names = [e["name"] for e in c["env"]]
        for e in c["env"]:  # $(VAR) refers only to variables defined earlier (Kubernetes expands in order)
            for ref in re.findall(r"\$\((\w+)\)", e.get("value", "")):
                assert ref in names[: names.index(e["name"])], f"{n}: {e['name']} uses $({ref}) before it is set"
        if role == "decode":
            assert env["CHUNKSERVE_KV_HOST"]["value"] == "0.0.0.0"
            assert int(env["CHUNKSERVE_KV_PORT"]["value"]) == ports["kv"]
            assert env["CHUNKSERVE_KV_ADVERTISE"]["value"] == "$(POD_IP)"
            assert env["POD_IP"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
        gpus = (c.get("resources", {}).get("limits") or {}).get("nvidia.com/gpu")
        if role != "router":
            assert env["CHUNKSERVE_BACKEND"]["value"] == ("cuda" if gpus else "cpu"), n
            repo = r.merged["image"]["cuda" if gpus else "repository"]
            repo = repo["repository"] if isinstance(repo, dict) else repo
            assert c["image"].startswith(repo + ":"), f"{n}: image {c['image']}"
            if gpus:
                assert "NCCL_DEBUG" in env
                nccl_if = r.merged[role]["gpu"]["nccl"]["socketIfname"]
                assert env.get("NCCL_SOCKET_IFNAME", {}).get("value", "") == nccl_if
        else:
            assert not gpus


@pytest.mark.parametrize("name", CI_IDS)
def test_router_discovery(renders, name):
    r = renders[name]
    router = r.deployment("router")
    env = env_of(containers(router)[0])
    assert env["CHUNKSERVE_READY_WITHOUT_WORKERS"]["value"] == str(r.merged["router"]["readyWithoutWorkers"]).lower()
    if r.merged["router"]["discovery"] == "static":
        assert "CHUNKSERVE_DECODE_DNS" not in env and "CHUNKSERVE_PREFILL_DNS" not in env
        assert env["CHUNKSERVE_DECODE_WORKERS"]["value"] == ",".join(r.merged["router"]["staticWorkers"]["decode"])
        return
    for role in ("prefill", "decode"):
        var = f"CHUNKSERVE_{role.upper()}_DNS"
        if not r.merged[role]["enabled"]:
            assert var not in env
            continue
        host, port = env[var]["value"].rsplit(":", 1)
        svc_name, ns, svc, domain = host.split(".", 3)
        assert (ns, svc, domain) == (NAMESPACE, "svc", r.merged["clusterDomain"])
        (svc_obj,) = [s for s in r.kind("Service") if s["metadata"]["name"] == svc_name]
        assert svc_obj["spec"]["clusterIP"] == "None" and svc_obj["spec"]["publishNotReadyAddresses"] is False
        dep = r.deployment(role)
        assert selector_matches(svc_obj["spec"]["selector"], pod_labels(dep))
        grpc = [p for p in svc_obj["spec"]["ports"] if p["name"] == "grpc"][0]
        # a headless Service's DNS gives pod IPs: the router dials the container port itself
        cport = {p["name"]: p["containerPort"] for p in containers(dep)[0]["ports"]}[grpc["targetPort"]]
        assert int(port) == cport == grpc["port"]


# ---------------------------------------- what the processes will do
# Each rendered port, probe, monitor, Service, discovery name and policy is checked
# against what the process in that pod will actually listen on or dial, from its own
# environment and its binary's defaults (--help-json), not against names in the chart.

def listens(dep: dict, flag_tables: dict) -> dict:
    """purpose -> the port number the pod's process listens on for it."""
    c = containers(dep)[0]
    env, role = env_of(c), component(dep)
    dflt = {e["env"]: e["default"] for e in flag_tables[role]}

    def val(var):
        return int(env[var]["value"]) if var in env else int(dflt[var])
    out = {"grpc": val("CHUNKSERVE_PORT"), "ops": val("CHUNKSERVE_HTTP_PORT")}
    if role == "decode":
        out["kv"] = val("CHUNKSERVE_KV_PORT")
    if role == "router" and "CHUNKSERVE_OPENAI_PORT" in env:
        out["openai"] = val("CHUNKSERVE_OPENAI_PORT")
    return out


def container_port(dep: dict, port) -> int:
    """A port reference (a container port's name or a number) as a number; -1 when a
    name does not exist."""
    if isinstance(port, int):
        return port
    named = {p["name"]: p["containerPort"] for p in containers(dep)[0].get("ports", [])}
    return named.get(port, -1)


def service_targets(r, svc: dict, port_name: str) -> list:
    """(Deployment, container port number) the Service's port named port_name reaches."""
    (sp,) = [p for p in svc["spec"]["ports"] if p["name"] == port_name]
    deps = [d for d in r.kind("Deployment") if selector_matches(svc["spec"]["selector"], pod_labels(d))]
    return [(d, container_port(d, sp.get("targetPort", sp["port"]))) for d in deps]


def allowed(r, src: dict, dst: dict, port: int) -> bool:
    """Whether the NetworkPolicies let a pod of Deployment src (same namespace) reach
    port on a pod of dst. No policy selecting dst: allowed."""
    pols = [p for p in r.kind("NetworkPolicy")
            if "Ingress" in p["spec"].get("policyTypes", ["Ingress"])
            and selector_matches(p["spec"]["podSelector"], pod_labels(dst))]
    if not pols:
        return True
    for pol in pols:
        for rule in pol["spec"].get("ingress", []):
            ports = rule.get("ports")
            if ports and not any(container_port(dst, p["port"]) == port for p in ports):
                continue
            peers = rule.get("from")
            if not peers or any("podSelector" in q and "namespaceSelector" not in q
                                and selector_matches(q["podSelector"], pod_labels(src))
                                for q in peers):
                return True
    return False


@pytest.mark.parametrize("name", CI_IDS)
def test_objects_do_what_the_processes_need(renders, name, flag_tables):
    r = renders[name]
    deps = {component(d): d for d in r.kind("Deployment")}
    listen = {role: listens(d, flag_tables) for role, d in deps.items()}
    problems = []
    for role, d in deps.items():
        c = containers(d)[0]
        # probes hit the ops port, where /healthz and /readyz are served
        for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
            got = container_port(d, c[probe]["httpGet"]["port"])
            if got != listen[role]["ops"]:
                problems.append(f"{role} {probe}: port {got}, the process serves ops on {listen[role]['ops']}")
        # every declared container port is one the process listens on, for that purpose
        for p in c.get("ports", []):
            if listen[role].get(p["name"]) != p["containerPort"]:
                problems.append(f"{role}: container port {p['name']}={p['containerPort']}, "
                                f"the process: {listen[role]}")
    # Services reach the process's port of their port's purpose
    for svc in r.kind("Service"):
        for sp in svc["spec"]["ports"]:
            for d, port in service_targets(r, svc, sp["name"]):
                want = listen[component(d)].get(sp["name"])
                if port != want:
                    problems.append(f"Service {svc['metadata']['name']} port {sp['name']} reaches "
                                    f"{component(d)}:{port}, the process serves it on {want}")
    # the public door reaches the router's OpenAI listener, through its public Service
    svcs = {x["metadata"]["name"]: x for x in r.kind("Service")}
    backends = [(i["metadata"]["name"], p["backend"]["service"]["name"], p["backend"]["service"]["port"])
                for i in r.kind("Ingress") for rule in i["spec"]["rules"] for p in rule["http"]["paths"]]
    backends += [(h["metadata"]["name"], b["name"], {"number": b["port"]})
                 for h in r.kind("HTTPRoute") for rule in h["spec"]["rules"] for b in rule["backendRefs"]]
    for obj, svc_name, port in backends:
        svc = svcs.get(svc_name)
        sp = [p for p in (svc or {"spec": {"ports": []}})["spec"]["ports"]
              if p["name"] == port.get("name") or p["port"] == port.get("number")]
        targets = service_targets(r, svc, sp[0]["name"]) if len(sp) == 1 else []
        if [(component(d), t) for d, t in targets] != [("router", listen["router"].get("openai"))]:
            problems.append(f"{obj} routes to {svc_name} {port}, not the router's OpenAI port")
    # monitors scrape the ops port of every component
    for mon in r.kind("PodMonitor"):
        for ep in mon["spec"]["podMetricsEndpoints"]:
            for role, d in deps.items():
                if container_port(d, ep["port"]) != listen[role]["ops"]:
                    problems.append(f"PodMonitor scrapes {role} on {ep['port']}, not its ops port")
    for mon in r.kind("ServiceMonitor"):
        for ep in mon["spec"]["endpoints"]:
            reached = set()
            for svc in r.kind("Service"):
                if not selector_matches(mon["spec"]["selector"], svc["metadata"]["labels"]):
                    continue
                if ep["port"] in {p["name"] for p in svc["spec"]["ports"]}:
                    for d, port in service_targets(r, svc, ep["port"]):
                        reached.add(component(d))
                        if port != listen[component(d)]["ops"]:
                            problems.append(f"ServiceMonitor scrapes {component(d)} on {port}")
            if reached != set(deps):
                problems.append(f"ServiceMonitor reaches {sorted(reached)}, not every component")
    # discovery: each DNS name is the other pool's headless Service, on the port its
    # process serves gRPC on
    routes = [("router", "CHUNKSERVE_DECODE_DNS", "decode"), ("router", "CHUNKSERVE_PREFILL_DNS", "prefill"),
              ("prefill", "CHUNKSERVE_DECODE_DNS", "decode")]
    for src, var, dst in routes:
        env = env_of(containers(deps[src])[0]) if src in deps else {}
        if var not in env:
            continue
        host, port = env[var]["value"].rsplit(":", 1)
        svcs = [s for s in r.kind("Service") if s["metadata"]["name"] == host.split(".")[0]]
        ok = len(svcs) == 1 and svcs[0]["spec"].get("clusterIP") == "None" and \
            [component(d) for d, _ in service_targets(r, svcs[0], "grpc")] == [dst] and \
            int(port) == listen[dst]["grpc"]
        if not ok:
            problems.append(f"{src} {var}={env[var]['value']} is not the {dst} pool's headless Service "
                            f"on its gRPC port {listen[dst]['grpc']}")
    # NetworkPolicies let the cluster's own flows through: router -> pools (gRPC),
    # prefill -> decode (gRPC, KV), and the OpenAI/gRPC doors from the allowed clients
    flows = [("router", "prefill", "grpc"), ("router", "decode", "grpc"),
             ("prefill", "decode", "grpc"), ("prefill", "decode", "kv")]
    for src, dst, what in flows:
        if src in deps and dst in deps and not allowed(r, deps[src], deps[dst], listen[dst][what]):
            problems.append(f"NetworkPolicy blocks {src} -> {dst} {what} ({listen[dst][what]})")
    # scale-in: a worker must outlive the routers' DNS view of it
    if "router" in deps and r.merged["router"]["discovery"] == "dns":
        renv = env_of(containers(deps["router"])[0])
        dflt = {e["env"]: e["default"] for e in flag_tables["router"]}
        refresh_ms = int(renv.get("CHUNKSERVE_DNS_REFRESH_MS", {}).get("value")
                         or dflt["CHUNKSERVE_DNS_REFRESH_MS"])
        for role in ("prefill", "decode"):
            if role in deps:
                cmd = containers(deps[role])[0]["lifecycle"]["preStop"]["exec"]["command"]
                if int(cmd[-1]) != r.merged[role]["preStopSleepSeconds"]:
                    problems.append(f"{role} preStop sleeps {cmd[-1]} s, not preStopSleepSeconds")
                if int(cmd[-1]) * 1000 < refresh_ms:
                    problems.append(f"{role} preStop sleeps {cmd[-1]} s, under the routers' "
                                    f"DNS refresh of {refresh_ms} ms")
    # autoscaling reads the Prometheus the values name; PDBs are the values' and allow drains
    for so in r.kind("ScaledObject"):
        for t in so["spec"]["triggers"]:
            if t["metadata"]["serverAddress"] != r.merged["prometheus"]["serverAddress"]:
                problems.append(f"ScaledObject {so['metadata']['name']} queries {t['metadata']['serverAddress']}")
    for pdb in r.kind("PodDisruptionBudget"):
        role = component(pdb)
        if pdb["spec"]["maxUnavailable"] != r.merged[role]["pdb"]["maxUnavailable"] or \
                str(pdb["spec"]["maxUnavailable"]) in ("0", "0%"):
            problems.append(f"PDB {pdb['metadata']['name']}: maxUnavailable {pdb['spec']['maxUnavailable']}")
    assert not problems, "\n".join(problems)


def test_monitor_tells_components_apart(renders):
    for r in renders.values():
        for mon in r.kind("PodMonitor") + r.kind("ServiceMonitor"):
            eps = mon["spec"].get("podMetricsEndpoints") or mon["spec"]["endpoints"]
            for ep in eps:
                rl = {x["targetLabel"]: x["sourceLabels"] for x in ep["relabelings"]}
                assert rl["component"] == ["__meta_kubernetes_pod_label_app_kubernetes_io_component"]
                assert rl["release"] == ["__meta_kubernetes_pod_label_app_kubernetes_io_instance"]
        comps = [component(d) for d in r.kind("Deployment")]
        assert len(comps) == len(set(comps))


# --------------------------------------------- the binaries: flags, env

def flag_env(table: list) -> dict:
    return {e["env"]: e for e in table}


def check_value(entry: dict, value: str) -> str | None:
    t = entry.get("type")
    try:
        if t == "int":
            v = int(value)
        elif t == "double":
            v = float(value)
        elif t == "bool":
            return None if value in ("true", "false", "1", "0") else f"'{value}' is not a boolean"
        else:
            return None
    except ValueError:
        return f"'{value}' is not a{'n integer' if t == 'int' else ' number'}"
    if "min" in entry and not (entry["min"] <= v <= entry["max"]):
        return f"{value} outside {entry['min']}..{entry['max']}"
    return None


@pytest.mark.parametrize("name", CI_IDS)
def test_env_are_real_flags(renders, name, flag_tables):
    """Every CHUNKSERVE_* variable is a flag of that binary, with a value of its type."""
    r = renders[name]
    problems = []
    for d in r.kind("Deployment"):
        role = component(d)
        known = flag_env(flag_tables[role])
        for e in containers(d)[0]["env"]:
            if not e["name"].startswith("CHUNKSERVE_") or e["name"] in NON_FLAG_ENV:
                continue
            if e["name"] not in known:
                problems.append(f"{role}: {e['name']} is not a flag of chunkserve-{role}")
            elif "value" in e and "$(" not in e["value"]:
                err = check_value(known[e["name"]], e["value"])
                if err:
                    problems.append(f"{role}: {e['name']}: {err}")
    assert not problems, "\n".join(problems)


def test_config_keys_are_real_flags(flag_tables):
    """The values' config: keys (chart defaults and every ci file) and the flags the schema
    reserves for the chart are flags of the binaries."""
    names = {role: {e["name"] for e in t} for role, t in flag_tables.items()}
    for p in [CHART / "values.yaml", *CI_VALUES]:
        v = load_values(p)
        for role in ROLES:
            for key in ((v.get(role) or {}).get("config") or {}):
                assert key in names[role], f"{p.name}: {role}.config.{key} is not a chunkserve-{role} flag"


def test_config_schema_is_the_binaries_tables(bin_dir):
    """values.schema.json's routerConfig/prefillConfig/decodeConfig are what
    scripts/chart_config_schema.py makes from the binaries' --help-json now: a flag added,
    renamed or re-bounded in a binary fails here until the schema is regenerated."""
    p = subprocess.run([sys.executable, str(REPO / "scripts" / "chart_config_schema.py"),
                        "--bin-dir", str(bin_dir), "--check"], capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 0, p.stderr


def test_chart_grace_default_is_the_binaries(flag_tables):
    """The chart assumes grace-ms = 5000 when config leaves it out (_helpers.tpl)."""
    helpers = (CHART / "templates" / "_helpers.tpl").read_text()
    m = re.search(r'define "chunkserve.graceSeconds".*?\$ms := (\d+)', helpers, re.S)
    for role, t in flag_tables.items():
        assert {e["name"]: e["default"] for e in t}["grace-ms"] == m.group(1), role


@pytest.mark.parametrize("name", CI_IDS)
def test_env_parses_in_the_binary(renders, name, bin_dir, tmp_path):
    """Each container's environment, as rendered, goes through the binary's own parser:
    with the model path pointed at a missing file the process must get past its config
    (exit 1, "cannot open") rather than refuse a variable (exit 2)."""
    r = renders[name]
    for d in r.kind("Deployment"):
        role = component(d)
        env = {k: v for k, v in os.environ.items() if not k.startswith("CHUNKSERVE_")}
        fake = {"POD_IP": "10.1.2.3", "POD_NAME": f"{role}-0"}
        secrets = {(o["metadata"]["name"], k): v for o in r.kind("Secret")
                   for k, v in (o.get("stringData") or {}).items()}
        for e in containers(d)[0]["env"]:
            ref = e.get("valueFrom", {}).get("secretKeyRef")
            if ref:  # the Secret the chart renders beside it, or one of the user's
                env[e["name"]] = secrets.get((ref["name"], ref["key"]), "a-key-of-the-users")
            elif "valueFrom" in e:
                env[e["name"]] = fake[e["name"]]
            else:
                env[e["name"]] = re.sub(r"\$\((\w+)\)", lambda m: env[m.group(1)], e["value"])
        if "CHUNKSERVE_CLUSTER_SECRET_FILE" in env:  # the user's Secret, mounted
            mount = {m["mountPath"] for m in containers(d)[0]["volumeMounts"]
                     if m["name"] == "cluster-secret"}
            assert os.path.dirname(env["CHUNKSERVE_CLUSTER_SECRET_FILE"]) in mount
            f = tmp_path / f"{role}-cluster-secret"
            f.write_text(base64.b32encode(os.urandom(30)).decode())  # 48 characters
            env["CHUNKSERVE_CLUSTER_SECRET_FILE"] = str(f)
        env["CHUNKSERVE_MODEL"] = str(tmp_path / "absent.gguf")
        env["CHUNKSERVE_BACKEND"] = "cpu"  # no GPU here; the value itself is checked in test_pods
        proc = subprocess.run([str(bin_dir / f"chunkserve-{role}")], env=env, capture_output=True, text=True,
                              timeout=60)
        assert proc.returncode == 1 and "cannot open" in proc.stderr, \
            f"{name}/{role}: exit {proc.returncode}: {proc.stderr[-2000:]}"


# ---------------------------------------------- live metrics and queries

def start(exe: Path, args: list, name: str, err) -> tuple:
    proc = subprocess.Popen([str(exe), *map(str, args)], stdout=subprocess.PIPE, stderr=err)
    lines = [proc.stdout.readline().decode().strip() for _ in range(2)]
    m = re.match(r"listening on (\S+):(\d+)$", lines[0])
    h = re.match(r"http listening on (\S+):(\d+)$", lines[1])
    if not m or not h:
        proc.kill()
        err.seek(0)
        pytest.fail(f"{name}: unexpected start lines {lines!r}: {err.read()[-2000:]!r}")
    return proc, f"{m.group(1)}:{m.group(2)}", f"http://{h.group(1)}:{h.group(2)}"


def metric_names(text: str) -> set:
    names = set()
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            names.add(line.split()[2])
        elif line and not line.startswith("#"):
            names.add(re.match(r"[^{\s]+", line).group(0))
    return names


@pytest.fixture(scope="session")
def live_metrics(bin_dir, tmp_path_factory) -> dict:
    """component -> metric names from the /metrics of live tiny-model processes:
    a prefill and a decode worker and a router in front of them."""
    for b in ("chunkserve-mktiny", "chunkserve-router", "chunkserve-prefill", "chunkserve-decode"):
        if not (bin_dir / b).is_file():
            pytest.skip(f"{bin_dir / b} not built")
    d = tmp_path_factory.mktemp("tiny")
    subprocess.run([str(bin_dir / "chunkserve-mktiny"), "--out", str(d), "--type", "q8_0"], check=True,
                   capture_output=True, timeout=120)
    model = d / "tiny.gguf"
    procs, out = [], {}
    try:
        errs = {n: tempfile.TemporaryFile() for n in ROLES}
        dec, dec_addr, dec_http = start(bin_dir / "chunkserve-decode", ["--model", model, "--port", 0, "--http-port", 0,
                                        "--kv-port", 0, "--threads", 1], "decode", errs["decode"])
        procs.append(dec)
        pre, pre_addr, pre_http = start(bin_dir / "chunkserve-prefill", ["--model", model, "--port", 0, "--http-port", 0,
                                        "--threads", 1], "prefill", errs["prefill"])
        procs.append(pre)
        rtr, _, rtr_http = start(bin_dir / "chunkserve-router", ["--model", model, "--port", 0, "--http-port", 0,
                                 "--decode-workers", dec_addr, "--prefill-workers", pre_addr], "router", errs["router"])
        procs.append(rtr)
        for role, url in (("prefill", pre_http), ("decode", dec_http), ("router", rtr_http)):
            with urllib.request.urlopen(url + "/metrics", timeout=10) as resp:
                out[role] = metric_names(resp.read().decode())
    finally:
        for p in reversed(procs):
            p.send_signal(signal.SIGTERM)
        for p in reversed(procs):
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
    return out


def test_live_metrics_present(live_metrics):
    # the signals the chart's autoscalers use, from the processes that export them
    assert "chunkserve:queued_prefill_tokens" in live_metrics["prefill"]
    assert "chunkserve:kv_cache_usage_perc" in live_metrics["decode"]
    assert "chunkserve:num_requests_waiting" in live_metrics["router"]


def parse_query(q: str) -> tuple:
    m = re.fullmatch(r"sum\(([a-zA-Z_:][a-zA-Z0-9_:]*)\{(.*)\}\)", q)
    assert m, f"unexpected query shape: {q}"
    labels = dict(re.findall(r'(\w+)="([^"]*)"', m.group(2)))
    return m.group(1), labels


def adapter_names(rules: list, series: set) -> dict:
    """What prometheus-adapter would serve: metrics-API name -> source series, for the
    series that the rules' seriesQuery selects (by __name__), renamed by name.matches/as."""
    out = {}
    for rule in rules:
        sq = re.search(r'__name__(=~|=)"([^"]+)"', rule["seriesQuery"])
        op, pat = sq.group(1), sq.group(2)
        for s in series:
            if (op == "=" and s == pat) or (op == "=~" and re.fullmatch(pat, s)):
                repl = re.sub(r"\$\{(\d+)\}", r"\\\1", rule["name"]["as"])
                out[re.sub(rule["name"]["matches"], repl, s)] = s
    return out


@pytest.mark.parametrize("name", [i for i in CI_IDS if i in ("keda", "hpa", "gpu")])
def test_autoscaling_queries_use_live_metrics(renders, name, live_metrics):
    """Every autoscaling signal names a metric that the component it selects really
    exports (read from live processes), with the labels the monitor's relabeling adds."""
    r = renders[name]
    comp_of = {component(d): d for d in r.kind("Deployment")}
    (mon,) = r.kind("PodMonitor") + r.kind("ServiceMonitor")
    eps = mon["spec"].get("podMetricsEndpoints") or mon["spec"]["endpoints"]
    series_labels = {"namespace", "pod", "container", "endpoint", "job", "instance", "service"} | \
        {x["targetLabel"] for x in eps[0]["relabelings"]}
    # labels a series carries itself
    own = {"chunkserve:pool_replicas_wanted": {"role"}, "chunkserve_pool_replicas_wanted": {"role"}}
    rules = yaml.safe_load((CHART / "adapter-rules.yaml").read_text())["rules"]
    checked = 0
    for so in r.kind("ScaledObject"):
        for t in so["spec"]["triggers"]:
            assert t["type"] == "prometheus"
            metric, labels = parse_query(t["metadata"]["query"])
            assert set(labels) <= series_labels | own.get(metric, set()), \
                f"{labels} uses labels no scrape adds"
            assert labels["namespace"] == NAMESPACE and labels["release"] == RELEASE
            comp = labels["component"]
            assert comp in comp_of, f"query selects component={comp}, which this release does not run"
            assert metric in live_metrics[comp], f"{metric} is not exported by a live {comp}"
            checked += 1
    for hpa in r.kind("HorizontalPodAutoscaler"):
        target = {d["metadata"]["name"]: d for d in r.kind("Deployment")}[hpa["spec"]["scaleTargetRef"]["name"]]
        for m in hpa["spec"]["metrics"]:
            if m["type"] == "Pods":  # the scaled pool's own pods
                served = adapter_names(rules["custom"], live_metrics[component(target)])
                assert m["pods"]["metric"]["name"] in served, \
                    f"{m['pods']['metric']['name']}: no adapter rule serves it from a live {component(target)} series"
            else:
                assert m["type"] == "External"
                sel = m["external"]["metric"]["selector"]["matchLabels"]
                name = m["external"]["metric"]["name"]
                assert set(sel) <= series_labels | own.get(name, set()) and sel["release"] == RELEASE
                comp = sel["component"]
                assert comp in comp_of
                served = adapter_names(rules["external"], live_metrics[comp])
                assert m["external"]["metric"]["name"] in served, \
                    f"{m['external']['metric']['name']}: no adapter rule serves it from a live {comp} series"
                for rule in rules["external"]:  # the rule's own label filter agrees
                    cm = re.search(r'component="(\w+)"', rule["seriesQuery"])
                    assert not cm or cm.group(1) == comp
            checked += 1
    assert checked, f"{name}: no autoscaling signal rendered"


def test_every_process_gets_the_cluster_secret(renders):
    """The router and both pools read the same mounted cluster secret (docs/security.md),
    always from the user's Secret (clusterSecret.existingSecret): the chart makes none."""
    for name, r in renders.items():
        assert not [o for o in r.kind("Secret") if "cluster" in o["metadata"]["name"]], name
        if not r.merged["clusterSecret"]["enabled"]:
            continue
        for d in r.kind("Deployment"):
            c = containers(d)[0]
            env = {e["name"]: e.get("value") for e in c["env"]}
            assert env["CHUNKSERVE_CLUSTER_SECRET_FILE"] == "/etc/chunkserve/cluster/cluster-secret"
            vols = {v["name"]: v for v in d["spec"]["template"]["spec"]["volumes"]}
            assert vols["cluster-secret"]["secret"]["secretName"] == \
                r.merged["clusterSecret"]["existingSecret"]


def test_public_tls_mounts_the_named_secret(renders):
    """router.publicTls (ci/public-values.yaml): the router's gRPC port speaks TLS from the
    named Secret: both files the process reads lie in a read-only mount of that Secret."""
    seen = 0
    for r in renders.values():
        if not r.merged["router"]["publicTls"]["enabled"]:
            continue
        seen += 1
        c = containers(r.deployment("router"))[0]
        env = env_of(c)
        vols = {v["name"]: v for v in r.deployment("router")["spec"]["template"]["spec"]["volumes"]}
        for var in ("CHUNKSERVE_TLS_CERT_FILE", "CHUNKSERVE_TLS_KEY_FILE"):
            path = env[var]["value"]
            (m,) = [m for m in c["volumeMounts"] if path.startswith(m["mountPath"] + "/")]
            assert m["readOnly"] is True
            assert vols[m["name"]]["secret"]["secretName"] == r.merged["router"]["publicTls"]["secretName"]
    assert seen, "no ci values file turns router.publicTls on"


def test_tls_mounts_the_users_secret_in_every_pod(renders, flag_tables):
    """tls.enabled (ci/tls-values.yaml): every pod mounts the named Secret at
    /etc/chunkserve/tls; workers serve TLS and want client certificates of its ca.crt;
    the router presents tls.crt to them and checks theirs against ca.crt and serverName;
    every variable is a flag of that binary. Off (the default): no TLS variable anywhere."""
    r = renders["tls"]
    want = {
        "router": {"CHUNKSERVE_WORKER_TLS_CA_FILE": "/etc/chunkserve/tls/ca.crt",
                   "CHUNKSERVE_WORKER_TLS_CERT_FILE": "/etc/chunkserve/tls/tls.crt",
                   "CHUNKSERVE_WORKER_TLS_KEY_FILE": "/etc/chunkserve/tls/tls.key",
                   "CHUNKSERVE_WORKER_TLS_SERVER_NAME": "chunkserve-worker"},
        "worker": {"CHUNKSERVE_TLS_CERT_FILE": "/etc/chunkserve/tls/tls.crt",
                   "CHUNKSERVE_TLS_KEY_FILE": "/etc/chunkserve/tls/tls.key",
                   "CHUNKSERVE_TLS_CLIENT_CA_FILE": "/etc/chunkserve/tls/ca.crt"},
    }
    deployments = r.kind("Deployment")
    assert len(deployments) == 3
    for d in deployments:
        c = containers(d)[0]
        env = {e["name"]: e.get("value") for e in c["env"]}
        comp = d["spec"]["template"]["metadata"]["labels"]["app.kubernetes.io/component"]
        role = "router" if comp == "router" else comp
        exp = want["router" if role == "router" else "worker"]
        for k, v in exp.items():
            assert env.get(k) == v, (role, k, env.get(k))
        envs = {e["env"] for e in flag_tables[role]}
        assert set(exp) <= envs, (role, set(exp) - envs)
        vols = {v["name"]: v for v in d["spec"]["template"]["spec"]["volumes"]}
        assert vols["tls"]["secret"]["secretName"] == "chunkserve-internal-tls"
        mounts = {m["name"]: m for m in c["volumeMounts"]}
        assert mounts["tls"]["mountPath"] == "/etc/chunkserve/tls" and mounts["tls"]["readOnly"]
    for name, other in renders.items():
        if other.merged["tls"]["enabled"]:
            continue
        for d in other.kind("Deployment"):
            names = {e["name"] for e in containers(d)[0]["env"]}
            # the router's own public TLS (router.publicTls) is the only other TLS
            public = {"CHUNKSERVE_TLS_CERT_FILE", "CHUNKSERVE_TLS_KEY_FILE"} \
                if component(d) == "router" and other.merged["router"]["publicTls"]["enabled"] else set()
            assert not [n for n in names - public if "_TLS_" in n], name


def pod_templates(text: str) -> dict:
    """component -> pod template of each Deployment in a render's text."""
    return {component(o): o["spec"]["template"] for o in objects(text) if o["kind"] == "Deployment"}


def test_api_key_change_rolls_the_routers_only():
    """The router reads CHUNKSERVE_API_KEY at start: a new apiKey.value (a Secret the chart
    makes) changes the router's pod template (a checksum annotation), and nothing else's;
    with apiKey.existingSecret there is nothing of the key in the release to checksum."""
    def templates(api_key: dict) -> dict:
        return pod_templates(manifest_text(render({"apiKey": {"enabled": True, **api_key}})))
    a, b = templates({"value": "key-one"}), templates({"value": "key-two"})
    ann = a["router"]["metadata"]["annotations"]["checksum/api-key"]
    assert ann != b["router"]["metadata"]["annotations"]["checksum/api-key"]
    assert "key-one" not in ann
    for pool in ("prefill", "decode"):
        assert a[pool] == b[pool]
    ext = templates({"existingSecret": "mine"})
    assert "checksum/api-key" not in ext["router"]["metadata"].get("annotations", {})


def test_credential_mounts_follow_secret_updates(renders):
    """Processes re-read the cluster secret and TLS files (docs/security.md, "Rotating
    credentials"): every Secret volume is mounted whole, never with subPath (a subPath
    mount is never updated by the kubelet), and read-only."""
    seen = 0
    for r in renders.values():
        for o in objects(r.text):
            if o["kind"] != "Deployment":
                continue
            spec = o["spec"]["template"]["spec"]
            secrets = {v["name"] for v in spec.get("volumes", []) if "secret" in v}
            for c in spec["containers"]:
                for m in c.get("volumeMounts", []):
                    if m["name"] in secrets:
                        seen += 1
                        assert "subPath" not in m and m.get("readOnly") is True, (r, m)
    assert seen
