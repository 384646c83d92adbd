#!/usr/bin/env python3
"""Writes the Helm chart's `config:` schemas (values.schema.json, definitions routerConfig,
prefillConfig, decodeConfig) from the binaries' own option tables (`--help-json`): each
component's `config:` accepts exactly its binary's flags, with their types and bounds, less
the flags the chart sets itself (ports, discovery, model, identity) and the secrets (which
come from Secrets, never from values). A typo in a config key then fails `helm install`,
naming the key, instead of rendering a variable the process would refuse at start.

  python3 scripts/chart_config_schema.py [--bin-dir build/bin] [--check]

--check changes nothing and exits 1 when the committed schema differs (the chart's tests
run it, so a new flag cannot be missing from the chart).
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SCHEMA = REPO / "deploy" / "helm" / "chunkserve" / "values.schema.json"
ROLES = ("router", "prefill", "decode")

# Set by the chart's templates (router.yaml, _pool.tpl) from other values.
CHART_SETS = {"host", "port", "http-host", "http-port", "model", "worker-id", "kv-host",
              "kv-port", "kv-advertise", "prefill-dns", "decode-dns", "prefill-workers",
              "decode-workers", "ready-without-workers", "openai-host", "openai-port",
              "tls-cert-file", "tls-key-file", "tls-client-ca-file", "worker-tls-ca-file",
              "worker-tls-cert-file", "worker-tls-key-file", "worker-tls-server-name",
              "cluster-secret-file", "openai-tls"}
# Secrets: from clusterSecret / apiKey (Secrets), never as plain values.
SECRETS = {"cluster-secret", "api-key"}


def flag_schema(e: dict) -> dict:
    s: dict = {"description": e.get("help", "")}
    if e["type"] == "int":
        s["type"] = "integer"
    elif e["type"] == "double":
        s["type"] = "number"
    elif e["type"] == "bool":
        s["type"] = "boolean"
    else:
        s["type"] = "string"
    if e["type"] in ("int", "double") and ("min" in e or "max" in e):
        s["minimum"], s["maximum"] = e["min"], e["max"]
    return s


def config_schema(table: list, role: str) -> dict:
    props = {e["name"]: flag_schema(e) for e in sorted(table, key=lambda e: e["name"])
             if e["name"] not in CHART_SETS | SECRETS}
    return {
        "type": "object",
        "description": (f"chunkserve-{role} flags (name without --) to values, rendered as "
                        "CHUNKSERVE_<NAME> variables; generated from its --help-json by "
                        "scripts/chart_config_schema.py. The flags the chart sets itself and "
                        "the secrets are not accepted."),
        "additionalProperties": False,
        "properties": props,
    }


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--bin-dir", default=str(REPO / "build" / "bin"))
    ap.add_argument("--check", action="store_true")
    a = ap.parse_args()
    schema = json.loads(SCHEMA.read_text())
    for role in ROLES:
        exe = Path(a.bin_dir) / f"chunkserve-{role}"
        out = subprocess.run([str(exe), "--help-json"], check=True, capture_output=True,
                             text=True, timeout=30).stdout
        schema["definitions"][f"{role}Config"] = config_schema(json.loads(out), role)
    text = json.dumps(schema, indent=2) + "\n"
    if a.check:
        if text != SCHEMA.read_text():
            print(f"{SCHEMA} is out of date: run scripts/chart_config_schema.py", file=sys.stderr)
            return 1
        return 0
    SCHEMA.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
