"""Credential rotation with real processes under traffic (issue 39; docs/security.md,
"Rotating credentials"): a router, a prefill and a decode worker with mutual TLS on every
internal gRPC port and a cluster secret, all reading their files from one directory laid
out as a Kubernetes Secret volume (`..data` a symlink swapped atomically). While a
client streams requests through remote prefill without pause, the directory moves in
three steps from CA 1 + secret "old" to CA 2 + secret "new":

  1. CA bundle 1+2, certificates of CA 1;  secret file "old\\nnew" (prove old, accept both)
  2. CA bundle 1+2, certificates of CA 2;  secret file "new\\nold" (prove new, accept both)
  3. CA bundle 2,   certificates of CA 2;  secret file "new"

Workers close connections every 1.5 s (--grpc-max-connection-age-ms), so the router
keeps making new TLS handshakes with whatever the files hold. Checked: no request fails
and each gives the tokens of the first; every process proves the same key id after each
step; a bad secret file in the middle is refused (counted, the old secret kept); the KV
channel authenticated under the old secret is replaced once the old secret is rotated out,
no transfer failing. At the end a router with only the old credentials (or the new TLS
files and the old secret) uses no worker, one with only the new ones serves, and a new
prefill worker holding only the new secret hands KV pages to the decode worker.
"""
from __future__ import annotations

import hashlib
import os
import threading
import time
from pathlib import Path

import pytest

grpc = pytest.importorskip("grpc")
pytest.importorskip("grpc_tools.protoc")

from cluster_harness import Proc, make_pki, make_tiny, metric, wait_for, wait_metric  # noqa: E402

pytestmark = pytest.mark.deploy

OLD, NEW = "old-cluster-secret-0123456789", "new-cluster-secret-9876543210"
FILES = ("cluster-secret", "tls.crt", "tls.key", "ca.crt")


def key_id(secret: str) -> float:
    """chunkserve:cluster_secret_key_id of a process proving secret (base/src/secret.c)."""
    v = int.from_bytes(hashlib.pbkdf2_hmac("sha256", secret.encode(), b"chunkserve key id",
                                           100000, 6), "big")
    return float(v or 1)


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> Path:
    """Two CAs, each with a node certificate for 127.0.0.1 usable by servers and clients."""
    return make_pki(tmp_path_factory.mktemp("pki"), {"ca1": ["node1"], "ca2": ["node2"]})


class SecretVolume:
    """A directory as the kubelet writes a Secret volume: FILE -> ..data/FILE, ..data ->
    ..vN, a new version written beside it and ..data swapped by one rename."""

    def __init__(self, root: Path):
        self.root, self.version = root, 0
        root.mkdir(parents=True, exist_ok=True)

    def write(self, files: dict):
        self.version += 1
        v = self.root / f"..v{self.version}"
        v.mkdir()
        for name, data in files.items():
            (v / name).write_bytes(data)
        tmp = self.root / "..data_tmp"
        tmp.symlink_to(v.name)
        os.replace(tmp, self.root / "..data")
        for name in files:
            link = self.root / name
            if not link.is_symlink():
                link.symlink_to(f"..data/{name}")

    def path(self, name: str) -> Path:
        return self.root / name


def contents(pki: Path, cas, node: int, secret: str) -> dict:
    return {"cluster-secret": secret.encode() + b"\n",
            "tls.crt": (pki / f"node{node}.pem").read_bytes(),
            "tls.key": (pki / f"node{node}.key").read_bytes(),
            "ca.crt": b"".join((pki / f"ca{i}.pem").read_bytes() for i in cas)}


def creds_args(vol: SecretVolume, server=True, client=True) -> list:
    """The cluster secret, TLS on the gRPC port (server) and to workers (client)."""
    a = [f"--cluster-secret-file={vol.path('cluster-secret')}", "--credentials-reload-s=1"]
    if client:
        a += [f"--worker-tls-ca-file={vol.path('ca.crt')}",
              f"--worker-tls-cert-file={vol.path('tls.crt')}",
              f"--worker-tls-key-file={vol.path('tls.key')}"]
    if server:
        a += [f"--tls-cert-file={vol.path('tls.crt')}", f"--tls-key-file={vol.path('tls.key')}",
              f"--tls-client-ca-file={vol.path('ca.crt')}"]
    return a


def test_credentials_rotate_under_traffic(bin_dir, proto_modules, pki, tmp_path):
    pb = type("PB", (), proto_modules)
    g = pb.generation_pb2
    model = make_tiny(bin_dir, tmp_path / "tiny")
    vol = SecretVolume(tmp_path / "creds")
    vol.write(contents(pki, (1,), 1, OLD))
    worker = [f"--model={model}", "--port=0", "--http-port=0", "--threads=1",
              "--kv-cache-mib=32", "--grace-ms=3000", "--grpc-max-connection-age-ms=1500",
              "--grpc-max-connection-age-grace-ms=30000"]
    dec = Proc(bin_dir / "chunkserve-decode", [*worker, *creds_args(vol, client=False)], "decode")
    pre = Proc(bin_dir / "chunkserve-prefill", [*worker, *creds_args(vol),
                                                f"--decode-workers={dec.addr}"], "prefill")
    procs = [dec, pre]
    stop = threading.Event()

    def router(name, *args, prefill=None):
        return Proc(bin_dir / "chunkserve-router", [
            f"--model={model}", "--port=0", "--http-port=0", "--status-interval-ms=100",
            "--grace-ms=3000", "--local-prefill-threshold=1",
            f"--prefill-workers={(prefill or pre).addr}", f"--decode-workers={dec.addr}", *args],
            name)

    def usable(r, role):
        return metric(r.metrics(), "chunkserve:workers_usable", f'role="{role}"')

    try:
        r = router("router", *creds_args(vol, server=False))
        procs.append(r)
        wait_for(lambda: usable(r, "prefill") == 1 and usable(r, "decode") == 1, 30,
                 "the router to reach both workers over mutual TLS")
        ids = [(11 * j) % 300 + 1 for j in range(40)]  # remote prefill: over the threshold

        def generate(router_proc, timeout=30):
            ch = grpc.insecure_channel(router_proc.addr)
            try:
                stub = pb.generation_pb2_grpc.GenerationStub(ch)
                msgs = stub.Generate(g.GenerateRequest(
                    token_ids=g.TokenIds(ids=ids),
                    sampling=g.SamplingParams(max_tokens=6, ignore_eos=True)), timeout=timeout)
                return [t for m in msgs for t in m.token_ids]
            finally:
                ch.close()

        want = generate(r)
        assert len(want) == 6

        # the traffic: one stream after another, the whole time
        done, failures = [0], []

        def traffic():
            while not stop.is_set():
                try:
                    out = generate(r)
                    if out != want:
                        failures.append(f"tokens {out} != {want}")
                    done[0] += 1
                except grpc.RpcError as e:
                    failures.append(f"{e.code()}: {e.details()}")

        t = threading.Thread(target=traffic, daemon=True)
        t.start()

        everyone = [dec, pre, r]

        def keys_everywhere(key_id, n):
            return all(p.metric("chunkserve:cluster_secret_key_id") == key_id and
                       p.metric("chunkserve:cluster_secret_keys") == n for p in everyone)

        old_id, new_id = key_id(OLD), key_id(NEW)
        assert keys_everywhere(old_id, 1)

        def step(cas, node, secret, proved_id, n):
            vol.write(contents(pki, cas, node, secret))
            wait_for(lambda: keys_everywhere(proved_id, n), 20,
                     f"every process to prove key {proved_id:.0f}, {n} accepted")
            # workers close connections every 1.5 s: wait for requests over new ones
            t_new = time.monotonic() + 3
            served = done[0]
            wait_for(lambda: time.monotonic() > t_new and done[0] >= served + 5, 60,
                     "requests to complete over connections made after the step")

        step((1, 2), 1, f"{OLD}\n{NEW}", old_id, 2)
        # a bad change is refused; the previous secret stays
        errors = {p.name: p.metric("chunkserve:cluster_secret_reload_errors_total")
                  for p in everyone}
        vol.write(contents(pki, (1, 2), 1, f"{OLD}\nshort"))
        wait_for(lambda: all(p.metric("chunkserve:cluster_secret_reload_errors_total") ==
                             errors[p.name] + 1 for p in everyone), 20,
                 "every process to refuse the bad secret file")
        assert keys_everywhere(old_id, 2)
        vol.write(contents(pki, (1, 2), 1, f"{OLD}\n{NEW}"))  # back to step 1

        step((1, 2), 2, f"{NEW}\n{OLD}", new_id, 2)
        step((2,), 2, NEW, new_id, 1)
        stop.set()
        t.join(60)
        assert not failures, failures[:5]
        assert done[0] >= 20, done[0]
        for p in everyone:
            assert p.metric("chunkserve:cluster_secret_reloads_total") == 3, p.name
            assert "cluster secret reloaded: proving key" in p.stderr()
        # the KV channel opened under the old secret was closed once idle and
        # replaced by one under the new secret, with no transfer lost
        assert "rotated out" in pre.stderr() + dec.stderr()
        assert pre.metric("chunkserve:kv_transfers_failed_total") == 0

        # the old credentials open nothing any more; the new ones do
        old_vol = SecretVolume(tmp_path / "old-creds")
        old_vol.write(contents(pki, (1,), 1, OLD))
        new_vol = SecretVolume(tmp_path / "new-creds")
        new_vol.write(contents(pki, (2,), 2, NEW))
        # (the new TLS files with the old secret: the token is refused)
        old_token_vol = SecretVolume(tmp_path / "old-token")
        old_token_vol.write(contents(pki, (2,), 2, OLD))
        unauth = dec.metric("chunkserve:rpc_unauthenticated_total")
        stale = router("router-old-creds", *creds_args(old_vol, server=False))
        stale_token = router("router-old-token", *creds_args(old_token_vol, server=False))
        fresh = router("router-new-creds", *creds_args(new_vol, server=False))
        procs += [stale, stale_token, fresh]
        wait_for(lambda: usable(fresh, "prefill") == 1 and usable(fresh, "decode") == 1, 30,
                 "a router with only the new credentials to reach both workers")
        assert generate(fresh) == want
        wait_for(lambda: dec.metric("chunkserve:rpc_unauthenticated_total") > unauth, 30,
                 "the decode worker to refuse the old secret's token")
        t_end = time.monotonic() + 3
        while time.monotonic() < t_end:
            for s in (stale, stale_token):
                assert usable(s, "decode") == 0 and usable(s, "prefill") == 0, s.name
            time.sleep(0.2)

        # a prefill worker with only the new secret: the decode worker's KV link takes it
        pre2 = Proc(bin_dir / "chunkserve-prefill", [*worker, *creds_args(new_vol),
                                                     f"--decode-workers={dec.addr}"], "prefill-new")
        procs.append(pre2)
        r2 = router("router-new-prefill", *creds_args(new_vol, server=False), prefill=pre2)
        procs.append(r2)
        wait_for(lambda: usable(r2, "prefill") == 1 and usable(r2, "decode") == 1, 30,
                 "the router to reach the new prefill worker")
        assert generate(r2) == want
        wait_metric(pre2, "chunkserve:kv_transfers_completed_total", "", 1, at_least=True)
    finally:
        stop.set()
        codes = {p.name: p.stop() for p in reversed(procs)}
        for p in procs:
            assert codes[p.name] == 0, p.stderr()[-3000:]
