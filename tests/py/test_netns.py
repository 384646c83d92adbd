"""Two prefill workers started with the very same settings (--host=0.0.0.0, the same
--port, no --worker-id, the same host name), each in its own network namespace, as two
replicas of a Deployment are: they must not fence each other out at the decode worker
(issue 17). Each draws a random instance id into its KV sender name
("prefill-<host>-<instance>"), so the decode worker keeps both channels, and both deliver
KV for a whole minute.

Needs root and `ip netns` (skipped with the reason otherwise). Topology: namespaces
cs-nsA, cs-nsB, each with a veth pair to the host (10.231.1.0/24, 10.231.2.0/24) and a
default route back; the router and the decode worker run on the host.
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import threading
import time
import urllib.request
from pathlib import Path

import pytest

grpc = pytest.importorskip("grpc")
pytest.importorskip("grpc_tools.protoc")

from cluster_harness import Proc, make_tiny, metric, rpc_token, wait_for  # noqa: E402

pytestmark = pytest.mark.cluster

SECRET = "netns-test-secret-0123456789"
NS = (("cs-nsA", "csvA", "10.231.1"), ("cs-nsB", "csvB", "10.231.2"))
PREFILL_PORT, PREFILL_HTTP = 50370, 50371  # the same in both namespaces
RUN_S = int(os.environ.get("CS_NETNS_SECONDS", "60"))  # shorter while editing the test


def sh(*args, check=True):
    return subprocess.run(list(args), capture_output=True, text=True, check=check)


@pytest.fixture(scope="module")
def namespaces():
    if os.geteuid() != 0 or not shutil.which("ip"):
        pytest.skip("needs root and iproute2 (ip netns)")
    for ns, _, _ in NS:
        sh("ip", "netns", "del", ns, check=False)
    r = sh("ip", "netns", "add", NS[0][0], check=False)
    if r.returncode != 0:
        pytest.skip(f"ip netns add is not permitted here: {r.stderr.strip()}")
    try:
        for i, (ns, veth, net) in enumerate(NS):
            if i:
                sh("ip", "netns", "add", ns)
            sh("ip", "link", "add", f"{veth}0", "type", "veth", "peer", "name", f"{veth}1")
            sh("ip", "link", "set", f"{veth}1", "netns", ns)
            sh("ip", "addr", "add", f"{net}.1/24", "dev", f"{veth}0")
            sh("ip", "link", "set", f"{veth}0", "up")
            for cmd in (["ip", "addr", "add", f"{net}.2/24", "dev", f"{veth}1"],
                        ["ip", "link", "set", f"{veth}1", "up"], ["ip", "link", "set", "lo", "up"],
                        ["ip", "route", "add", "default", "via", f"{net}.1"]):
                sh("ip", "netns", "exec", ns, *cmd)
    except subprocess.CalledProcessError as e:
        for ns, veth, _ in NS:
            sh("ip", "netns", "del", ns, check=False)
            sh("ip", "link", "del", f"{veth}0", check=False)
        pytest.skip(f"cannot build the namespaces: {' '.join(e.cmd)}: {e.stderr.strip()}")
    yield
    for ns, veth, _ in NS:
        sh("ip", "netns", "del", ns, check=False)
        sh("ip", "link", "del", f"{veth}0", check=False)


def http_metrics(url: str) -> dict:
    out = {}
    with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
        for line in r.read().decode().splitlines():
            m = re.match(r"^([a-zA-Z_:][\w:]*(?:\{[^}]*\})?) (\S+)$", line)
            if m:
                out[m.group(1)] = float(m.group(2))
    return out


def test_two_identical_prefill_replicas_in_separate_namespaces(namespaces, bin_dir, proto_modules,
                                                              tmp_path):
    pb = type("PB", (), proto_modules)
    g = pb.generation_pb2
    model = make_tiny(bin_dir, tmp_path / "tiny")
    common = [f"--model={model}", "--threads=1", "--kv-cache-mib=64", "--grace-ms=2000",
              f"--cluster-secret={SECRET}"]
    # the decode worker on the host: KV on every address, advertised on nsA's gateway
    # (both namespaces route to it)
    dec = Proc(bin_dir / "chunkserve-decode",
               [*common, "--port=0", "--kv-host=0.0.0.0", f"--kv-advertise={NS[0][2]}.1"],
               "decode")
    pre = [Proc(Path(shutil.which("ip")),
                ["netns", "exec", ns, str(bin_dir / "chunkserve-prefill"), *common,
                 "--host=0.0.0.0", f"--port={PREFILL_PORT}", "--http-host=0.0.0.0",
                 f"--http-port={PREFILL_HTTP}"], f"prefill-{ns}")
           for ns, _, _ in NS]
    urls = [f"http://{net}.2:{PREFILL_HTTP}" for _, _, net in NS]
    router = None
    try:
        router = Proc(bin_dir / "chunkserve-router", [
            f"--model={model}", "--port=0", "--status-interval-ms=100", "--grace-ms=2000",
            f"--cluster-secret={SECRET}", "--local-prefill-threshold=1",
            "--prefill-workers=" + ",".join(f"{net}.2:{PREFILL_PORT}" for _, _, net in NS),
            f"--decode-workers={dec.addr}"], "router")
        wait_for(lambda: metric(router.metrics(), "chunkserve:workers_usable", 'role="prefill"') == 2,
                 30, "both prefill replicas usable")
        # the same settings, two names
        senders = []
        for _, _, net in NS:
            ch = grpc.insecure_channel(f"{net}.2:{PREFILL_PORT}")
            st = pb.cluster_pb2_grpc.WorkerStub(ch).GetStatus(
                pb.cluster_pb2.WorkerStatusRequest(), timeout=10, metadata=rpc_token(SECRET))
            ch.close()
            senders.append(st.kv_sender)
        assert senders[0] != senders[1] and all(s.startswith("prefill-") for s in senders), senders

        stub = pb.generation_pb2_grpc.GenerationStub(grpc.insecure_channel(router.addr))
        errors, done = [], [0]
        t_end = time.monotonic() + RUN_S

        def client(k):
            i = 0
            while time.monotonic() < t_end:
                ids = [(k * 97 + i * 13 + j) % 300 + 1 for j in range(48)]
                try:
                    msgs = list(stub.Generate(g.GenerateRequest(
                        token_ids=g.TokenIds(ids=ids),
                        sampling=g.SamplingParams(max_tokens=4, ignore_eos=True)), timeout=60))
                    assert sum(len(m.token_ids) for m in msgs) == 4
                    done[0] += 1
                except Exception as e:  # noqa: BLE001 - collected and reported below
                    errors.append(repr(e))
                i += 1

        threads = [threading.Thread(target=client, args=(k,)) for k in range(4)]
        for t in threads:
            t.start()
        # every 15 s window: both replicas completed transfers
        last = [0.0, 0.0]
        for _ in range(RUN_S // 15):
            time.sleep(15)
            now = [metric(http_metrics(u), "chunkserve:kv_transfers_completed_total") for u in urls]
            assert all(n > l for n, l in zip(now, last)), f"a replica stopped delivering: {last} -> {now}"
            last = now
        for t in threads:
            t.join()
        assert not errors, errors[:5]
        for u in urls:
            assert metric(http_metrics(u), "chunkserve:kv_transfers_failed_total") == 0
        err = dec.stderr()
        assert "stale incarnation" not in err and "reconnected" not in err, err[-3000:]
        print(f"{done[0]} requests in {RUN_S} s; transfers per replica: {last}")
    finally:
        bad = []
        for p in [router, *pre, dec]:
            if p and p.stop() != 0:
                bad.append(f"{p.name}: {p.stderr()[-2000:]}")
        assert not bad, bad

