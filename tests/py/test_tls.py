"""TLS on the gRPC ports (issue 17, docs/security.md): certificates made with the
`openssl` CLI for this test (a CA, a server certificate for 127.0.0.1, a client
certificate, and a second CA nobody trusts).

- `chunkserve serve --tls-cert-file/--tls-key-file`: a TLS client that trusts the CA
  generates; a plaintext client and a client that trusts another CA cannot.
- the OpenAI HTTP port with the same files: the official `openai` client over HTTPS
  (whole and streamed answers); plain HTTP and a client trusting another CA get
  nothing; with --tls-client-ca-file only a client certificate of that CA is served;
  a certificate file replaced while running serves the next connections
  (--credentials-reload-s).
- the cluster with mutual TLS everywhere: workers require a client certificate of the CA
  (--tls-client-ca-file); the router presents one (--worker-tls-*) and serves TLS itself;
  tokens equal the plaintext cluster's; a client without a certificate, or with one of
  the other CA, gets nothing from a worker; a router that trusts the wrong CA, or expects
  another server name, uses no worker; an unreadable file stops a process at start with its name.
"""
from __future__ import annotations

import http.client
import shutil
import ssl
import urllib.request
import subprocess
import time
from pathlib import Path

import pytest

grpc = pytest.importorskip("grpc")
pytest.importorskip("grpc_tools.protoc")

from cluster_harness import (Proc, make_pki, make_tiny, metric, rpc_token, wait_for,  # noqa: E402
                             wait_metric)

pytestmark = pytest.mark.cluster

SECRET = "tls-test-secret-0123456789ab"


@pytest.fixture(scope="module")
def certs(tmp_path_factory) -> Path:
    return make_pki(tmp_path_factory.mktemp("certs"),
                    {"ca": ["server", "client"], "other-ca": ["stranger"]})


@pytest.fixture(scope="module")
def pb(proto_modules):
    return type("PB", (), proto_modules)


@pytest.fixture(scope="module")
def model(bin_dir, tmp_path_factory):
    return make_tiny(bin_dir, tmp_path_factory.mktemp("tiny"))


def creds(certs: Path, ca="ca", client=None):
    return grpc.ssl_channel_credentials(
        root_certificates=(certs / f"{ca}.pem").read_bytes(),
        private_key=(certs / f"{client}.key").read_bytes() if client else None,
        certificate_chain=(certs / f"{client}.pem").read_bytes() if client else None)


def run(stub, g, ids, n=8):
    msgs = list(stub.Generate(g.GenerateRequest(
        token_ids=g.TokenIds(ids=ids), sampling=g.SamplingParams(max_tokens=n, ignore_eos=True)),
        timeout=30))
    return [t for m in msgs for t in m.token_ids]


def tls_args(certs: Path, client_ca=True):
    a = [f"--tls-cert-file={certs / 'server.pem'}", f"--tls-key-file={certs / 'server.key'}"]
    return a + ([f"--tls-client-ca-file={certs / 'ca.pem'}"] if client_ca else [])


def test_serve_over_tls(bin_dir, model, pb, certs):
    g = pb.generation_pb2
    s = Proc(bin_dir / "chunkserve", ["serve", f"--model={model}", "--port=0", "--http-port=0",
                                       *tls_args(certs, client_ca=False)], "serve-tls")
    try:
        ids = [(3 * j) % 300 + 1 for j in range(20)]
        ch = grpc.secure_channel(s.addr, creds(certs))
        out = run(pb.generation_pb2_grpc.GenerationStub(ch), g, ids)
        assert len(out) == 8
        ch.close()
        for bad in (grpc.insecure_channel(s.addr), grpc.secure_channel(s.addr, creds(certs, "other-ca"))):
            with pytest.raises(grpc.RpcError) as e:
                run(pb.generation_pb2_grpc.GenerationStub(bad), g, ids)
            assert e.value.code() == grpc.StatusCode.UNAVAILABLE
            bad.close()
    finally:
        assert s.stop() == 0


def test_cluster_with_mutual_tls(bin_dir, model, pb, certs):
    g, c = pb.generation_pb2, pb.cluster_pb2
    common = [f"--model={model}", "--port=0", "--threads=1", "--kv-cache-mib=32",
              "--grace-ms=2000", f"--cluster-secret={SECRET}", *tls_args(certs)]
    pre = Proc(bin_dir / "chunkserve-prefill", common, "prefill-tls")
    dec = Proc(bin_dir / "chunkserve-decode", common, "decode-tls")
    procs = [pre, dec]

    def router(ca, name, *more):
        return Proc(bin_dir / "chunkserve-router", [
            f"--model={model}", "--port=0", "--status-interval-ms=100", "--grace-ms=2000",
            f"--cluster-secret={SECRET}", "--local-prefill-threshold=1",
            f"--prefill-workers={pre.addr}", f"--decode-workers={dec.addr}",
            *tls_args(certs, client_ca=False), f"--worker-tls-ca-file={certs / ca}.pem",
            f"--worker-tls-cert-file={certs / 'client.pem'}",
            f"--worker-tls-key-file={certs / 'client.key'}", *more], name)
    try:
        r = router("ca", "router-tls")
        procs.append(r)
        wait_for(lambda: metric(r.metrics(), "chunkserve:workers_usable", 'role="decode"') == 1 and
                 metric(r.metrics(), "chunkserve:workers_usable", 'role="prefill"') == 1, 30,
                 "the router to reach both workers over mutual TLS")
        ch = grpc.secure_channel(r.addr, creds(certs))
        stub = pb.generation_pb2_grpc.GenerationStub(ch)
        # remote prefill (the KV link itself is not TLS: docs/security.md)
        ids = [(7 * j) % 300 + 1 for j in range(40)]
        out = run(stub, g, ids)
        assert len(out) == 8 and run(stub, g, ids) == out
        wait_metric(pre, "chunkserve:kv_transfers_completed_total", "", 2, at_least=True)
        ch.close()

        # the workers want a client certificate of their CA (the token alone is not enough)
        for cred in (creds(certs), creds(certs, client="stranger"), None):
            wch = grpc.secure_channel(dec.addr, cred) if cred else grpc.insecure_channel(dec.addr)
            with pytest.raises(grpc.RpcError) as e:
                pb.cluster_pb2_grpc.WorkerStub(wch).GetStatus(
                    c.WorkerStatusRequest(), timeout=10, metadata=rpc_token(SECRET))
            assert e.value.code() == grpc.StatusCode.UNAVAILABLE
            wch.close()
        wch = grpc.secure_channel(dec.addr, creds(certs, client="client"))
        st = pb.cluster_pb2_grpc.WorkerStub(wch).GetStatus(
            c.WorkerStatusRequest(), timeout=10, metadata=rpc_token(SECRET))
        assert st.ready
        wch.close()

        # a router that trusts another CA, or expects another name on the
        # workers' certificates, uses no worker
        wrong = [router("other-ca", "router-wrong-ca"),
                 router("ca", "router-wrong-name", "--worker-tls-server-name=nobody.example")]
        procs += wrong
        t_end = time.monotonic() + 3
        while time.monotonic() < t_end:
            for w in wrong:
                assert metric(w.metrics(), "chunkserve:workers_usable", 'role="decode"') == 0
            time.sleep(0.2)
    finally:
        for p in procs:
            assert p.stop() == 0, p.stderr()[-2000:]


def test_unreadable_tls_files_stop_a_process_at_start(bin_dir, model, certs):
    for args, what in (([f"--tls-cert-file={certs / 'nope.pem'}", f"--tls-key-file={certs / 'server.key'}"],
                        "nope.pem"),
                       ([f"--tls-cert-file={certs / 'server.pem'}"], "needs its key file"),
                       ([f"--tls-cert-file={certs / 'server.pem'}", f"--tls-key-file={certs / 'ext.cnf'}"],
                        "not PEM"),
                       ([f"--tls-cert-file={certs / 'server.pem'}", f"--tls-key-file={certs / 'client.key'}"],
                        "is not the certificate"),
                       ([f"--tls-cert-file={certs / 'server.key'}", f"--tls-key-file={certs / 'server.key'}"],
                        "holds no PEM certificate")):
        p = subprocess.run([str(bin_dir / "chunkserve-decode"), f"--model={model}", "--port=0",
                            "--http-port=0", *args], capture_output=True, text=True, timeout=60)
        assert p.returncode != 0 and what in p.stderr, p.stderr[-2000:]


def start_https_serve(bin_dir, model, *args):
    """`chunkserve serve` with TLS and its OpenAI port: (process, "host:port" of that port)."""
    p = subprocess.Popen([str(bin_dir / "chunkserve"), "serve", f"--model={model}", "--port=0",
                          "--http-port=0", "--openai-port=0", "--threads=1", *args],
                         stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    lines = [p.stdout.readline().decode().strip() for _ in range(3)]
    if not lines[2].startswith("openai listening on "):
        p.kill()
        pytest.fail(f"unexpected start lines {lines!r}")
    return p, lines[2].split()[-1]


def openai_client(addr, certs: Path, ca="ca", client=None):
    """The official client over HTTPS, trusting ca's certificate (and presenting client's)."""
    openai = pytest.importorskip("openai")
    ctx = ssl.create_default_context(cafile=str(certs / f"{ca}.pem"))
    if client:
        ctx.load_cert_chain(certs / f"{client}.pem", certs / f"{client}.key")
    return openai.OpenAI(base_url=f"https://{addr}/v1", api_key="none", max_retries=0,
                         timeout=30, http_client=openai.DefaultHttpxClient(verify=ctx))


def test_openai_door_over_tls(bin_dir, model, certs, tmp_path):
    openai = pytest.importorskip("openai")
    # the server's files are copies, so that the test can replace them
    for f in ("server.pem", "server.key", "stranger.pem", "stranger.key"):
        shutil.copy(certs / f, tmp_path / f)
    p, addr = start_https_serve(bin_dir, model, f"--tls-cert-file={tmp_path / 'server.pem'}",
                                f"--tls-key-file={tmp_path / 'server.key'}",
                                "--credentials-reload-s=1")
    try:
        c = openai_client(addr, certs)
        model_id = c.models.list().data[0].id
        r = c.completions.create(model=model_id, prompt="hello", max_tokens=5, temperature=0)
        assert r.usage.completion_tokens == 5
        chunks = list(c.chat.completions.create(
            model=model_id, messages=[{"role": "user", "content": "hi"}], max_tokens=4,
            temperature=0, stream=True))
        assert chunks and chunks[-1].choices[0].finish_reason == "length"
        # plain HTTP on the TLS port, and a client that trusts another CA: nothing served
        with pytest.raises((OSError, http.client.HTTPException)) as e:
            urllib.request.urlopen(f"http://{addr}/v1/models", timeout=10)
        assert not isinstance(e.value, TimeoutError)  # refused, not left hanging
        with pytest.raises(openai.APIConnectionError) as e:
            openai_client(addr, certs, ca="other-ca").models.list()
        assert not isinstance(e.value, openai.APITimeoutError)
        # the certificate replaced by one of the other CA (a rename, as a Secret volume
        # swaps): new connections get it
        for f in ("pem", "key"):
            (tmp_path / f"new.{f}").write_bytes((certs / f"stranger.{f}").read_bytes())
        (tmp_path / "new.key").replace(tmp_path / "server.key")
        (tmp_path / "new.pem").replace(tmp_path / "server.pem")

        def other_ca_served():
            try:
                return bool(openai_client(addr, certs, ca="other-ca").models.list().data)
            except openai.APIConnectionError:
                return False
        wait_for(other_ca_served, 20, "the replaced certificate to be served")
        with pytest.raises(openai.APIConnectionError) as e:
            openai_client(addr, certs).models.list()
        assert not isinstance(e.value, openai.APITimeoutError)
    finally:
        p.terminate()
        assert p.wait(30) == 0


def test_openai_door_with_client_certificates(bin_dir, model, certs):
    openai = pytest.importorskip("openai")
    p, addr = start_https_serve(bin_dir, model, *tls_args(certs))
    try:
        assert openai_client(addr, certs, client="client").models.list().data
        for who in (None, "stranger"):
            with pytest.raises(openai.APIConnectionError) as e:
                openai_client(addr, certs, client=who).models.list()
            assert not isinstance(e.value, openai.APITimeoutError)
    finally:
        p.terminate()
        assert p.wait(30) == 0


def test_no_openai_tls_keeps_the_http_port_plain(bin_dir, model, certs, pb):
    """--no-openai-tls (the chart sets it behind an Ingress or HTTPRoute): the OpenAI port
    speaks plain HTTP while the gRPC port keeps TLS."""
    p = subprocess.Popen([str(bin_dir / "chunkserve"), "serve", f"--model={model}", "--port=0",
                          "--http-port=0", "--openai-port=0", "--threads=1", "--no-openai-tls",
                          *tls_args(certs, client_ca=False)],
                         stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    try:
        lines = [p.stdout.readline().decode().strip() for _ in range(3)]
        grpc_addr, http_addr = lines[0].split()[-1], lines[2].split()[-1]
        with urllib.request.urlopen(f"http://{http_addr}/v1/models", timeout=10) as r:
            assert r.status == 200
        ch = grpc.secure_channel(grpc_addr, creds(certs))
        assert len(run(pb.generation_pb2_grpc.GenerationStub(ch), pb.generation_pb2, [5, 6, 7])) == 8
        ch.close()
    finally:
        p.terminate()
        assert p.wait(30) == 0
