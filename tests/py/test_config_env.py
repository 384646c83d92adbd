"""CHUNKSERVE_* variables that nobody reads are refused (proc/src/config_env.c): a typo such
as CHUNKSERVE_MAX_BATCH_TOKENS=4096 must stop the process with the nearest valid name, not
start it with the default budget. A variable that is another chunkserve process's flag is
left alone (one environment is shared by `chunkserve cluster up` and its children).

The list of the family's flags in config_env.c must equal the union of every process's and
command's own table (their --help-json), so that a new flag cannot be refused by a sibling.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

# every table a chunkserve process or command parses (cs_config_parse callers)
COMMANDS = [["chunkserve", "generate"], ["chunkserve", "bench", "serve"], ["chunkserve", "tune"],
            ["chunkserve", "cluster", "up"], ["chunkserve-router"], ["chunkserve-prefill"],
            ["chunkserve-decode"]]


def table(bin_dir: Path, cmd: list) -> list:
    out = subprocess.run([str(bin_dir / cmd[0]), *cmd[1:], "--help-json"], check=True,
                         capture_output=True, text=True, timeout=30).stdout
    return json.loads(out)


def family_list() -> set:
    src = (REPO / "proc" / "src" / "config_env.c").read_text()
    body = src.split("family_flags[] = {", 1)[1].split("};", 1)[0]
    return {"CHUNKSERVE_" + n for n in re.findall(r'"([A-Z0-9_]+)"', body)}


def test_the_family_list_is_the_union_of_the_tables(bin_dir):
    union = set()
    for cmd in COMMANDS:
        union |= {e["env"] for e in table(bin_dir, cmd)}
    listed = family_list()
    assert listed == union, (f"add to config_env.c: {sorted(union - listed)}; "
                             f"remove: {sorted(listed - union)}")


def run(bin_dir: Path, cmd: list, env_extra: dict, *args) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("CHUNKSERVE_")}
    env.update(env_extra)
    return subprocess.run([str(bin_dir / cmd[0]), *cmd[1:], *args], env=env,
                          capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("cmd", [["chunkserve", "serve"], ["chunkserve", "generate"],
                                 ["chunkserve", "cluster", "up"], ["chunkserve", "bench", "serve"],
                                 ["chunkserve", "tune"], ["chunkserve-router"],
                                 ["chunkserve-prefill"], ["chunkserve-decode"]],
                         ids=lambda c: "-".join(c))
def test_a_typo_is_refused_naming_the_nearest_flag(bin_dir, model_path, cmd):
    model = [] if cmd[1:] in (["bench", "serve"], ["tune"]) else ["--model", str(model_path)]
    p = run(bin_dir, cmd, {"CHUNKSERVE_MAX_BATCH_TOKENS": "4096"}, *model)
    assert p.returncode == 2, (p.returncode, p.stderr[-800:])
    assert "unknown environment variable CHUNKSERVE_MAX_BATCH_TOKENS" in p.stderr, p.stderr
    # serve and generate share the chunkserve command's table
    own = ["chunkserve", "generate"] if cmd == ["chunkserve", "serve"] else cmd
    names = {e["env"] for e in table(bin_dir, own)}
    if "CHUNKSERVE_MAX_BATCHED_TOKENS" in names:  # the nearest of its own names
        assert "did you mean CHUNKSERVE_MAX_BATCHED_TOKENS?" in p.stderr, p.stderr


def test_a_siblings_flag_and_an_empty_variable_are_left_alone(bin_dir, model_path):
    # the router's flag in a decode worker's environment, an empty unknown variable, the
    # variables read outside the tables: the worker starts past its configuration (and
    # stops at the missing model, which is the point where the environment was accepted)
    env = {"CHUNKSERVE_DNS_REFRESH_MS": "4000", "CHUNKSERVE_NO_SUCH_THING": "",
           "CHUNKSERVE_BACKEND": "cpu", "CHUNKSERVE_BIN_DIR": str(bin_dir),
           # Kubernetes service links of a Service named chunkserve-router (a pod that does
           # not set enableServiceLinks: false gets them)
           "CHUNKSERVE_ROUTER_SERVICE_HOST": "10.0.0.1", "CHUNKSERVE_ROUTER_SERVICE_PORT": "50050",
           "CHUNKSERVE_ROUTER_SERVICE_PORT_GRPC": "50050",
           "CHUNKSERVE_ROUTER_PORT": "tcp://10.0.0.1:50050",
           "CHUNKSERVE_ROUTER_PORT_50050_TCP": "tcp://10.0.0.1:50050",
           "CHUNKSERVE_ROUTER_PORT_50050_TCP_ADDR": "10.0.0.1",
           "CHUNKSERVE_ROUTER_PORT_50050_TCP_PROTO": "tcp"}
    p = run(bin_dir, ["chunkserve-decode"], env, "--model", "/nonexistent/model.gguf")
    assert p.returncode != 0 and "unknown environment variable" not in p.stderr, p.stderr
    assert "/nonexistent/model.gguf" in p.stderr, p.stderr[-800:]


def test_a_typo_of_a_siblings_flag_names_it(bin_dir):
    p = run(bin_dir, ["chunkserve-decode"], {"CHUNKSERVE_DNS_REFRESH_M": "4000"}, "--model", "x")
    assert p.returncode == 2 and "did you mean CHUNKSERVE_DNS_REFRESH_MS?" in p.stderr, p.stderr
