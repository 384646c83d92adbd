#!/usr/bin/env python3
"""Writes tests/deploy/crd/httproute.json: the Gateway API's HTTPRoute v1 schema (the
openAPIV3Schema of the standard-channel CRD, gateway.networking.k8s.io_httproutes.yaml from
kubernetes-sigs/gateway-api, commit 4564255ac2c35d582249b3cdf261bdf51c8bca32) made strict: descriptions dropped, and every object that lists
its properties refuses others (a CRD's API server would prune them silently; the chart's
tests treat an unknown field as the chart's mistake).

  python3 tests/deploy/crd/make_httproute_schema.py PATH/TO/gateway.networking.k8s.io_httproutes.yaml
"""
import json
import sys
from pathlib import Path

import yaml


def strict(node):
    if isinstance(node, dict):
        out = {k: strict(v) for k, v in node.items()
               if k != "description" and not k.startswith("x-kubernetes-")}
        if out.get("type") == "object" and "properties" in out and "additionalProperties" not in out:
            out["additionalProperties"] = False
        return out
    if isinstance(node, list):
        return [strict(v) for v in node]
    return node


def main():
    crd = yaml.safe_load(Path(sys.argv[1]).read_text())
    (v1,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1"]
    schema = strict(v1["schema"]["openAPIV3Schema"])
    schema["properties"].pop("status", None)  # written by the controller, never by a chart
    schema["properties"]["metadata"] = {"type": "object"}
    schema = {"$schema": "http://json-schema.org/draft-07/schema#",
              "title": "HTTPRoute gateway.networking.k8s.io/v1 (strict)", **schema}
    out = Path(__file__).resolve().parent / "httproute.json"
    out.write_text(json.dumps(schema, indent=1, sort_keys=True) + "\n")


if __name__ == "__main__":
    main()
