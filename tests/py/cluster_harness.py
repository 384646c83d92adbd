"""Real processes for the cluster tests: prefill and decode workers and the
router on loopback, started, killed (-9) and restarted on purpose.

Each process's stderr goes to a temporary file (a pipe nobody reads would
block it); its first stdout lines give its gRPC and HTTP ports."""
from __future__ import annotations

import hashlib
import hmac
import os
import re
import signal
import socket
import subprocess
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

import grpc
import pytest


class Proc:
    def __init__(self, exe: Path, args: list, name: str):
        self.exe, self.args, self.name = exe, [str(a) for a in args], name
        self.proc = None
        self.port = None
        self.err = None
        self.earlier = ""  # the stderr of earlier incarnations (before a restart)
        self.paused = False
        self.killed = False  # by kill9(), since the last start
        self.start()

    def start(self, port: int | None = None):
        args = list(self.args)
        if port is not None:  # a restart keeps the port the router knows
            args = [a for a in args if not a.startswith("--port=")] + [f"--port={port}"]
        if self.err is not None:
            self.earlier = self.stderr()
            self.err.close()
        self.paused = self.killed = False
        self.err = tempfile.TemporaryFile()
        self.proc = subprocess.Popen([str(self.exe), *args], stdout=subprocess.PIPE, stderr=self.err)
        lines = [self.proc.stdout.readline().decode() for _ in range(2)]
        m = re.match(r"listening on (\S+):(\d+)$", lines[0].strip())
        h = re.match(r"http listening on (\S+):(\d+)$", lines[1].strip())
        if not m or not h:
            self.proc.kill()
            pytest.fail(f"{self.name}: unexpected start lines {lines!r}; stderr: {self.stderr()[-3000:]}")
        self.port = int(m.group(2))
        self.addr = f"{m.group(1)}:{self.port}"
        self.http = f"http://{h.group(1)}:{h.group(2)}"

    def stderr(self) -> str:
        """Everything the process wrote on stderr, earlier incarnations first."""
        self.err.seek(0)
        return self.earlier + self.err.read().decode(errors="replace")

    def kill9(self):
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)
        self.paused = False
        self.killed = True

    def pause(self):
        """SIGSTOP: a hung process (its sockets stay open, nothing answers)."""
        self.proc.send_signal(signal.SIGSTOP)
        self.paused = True

    def resume(self):
        """SIGCONT after pause()."""
        self.proc.send_signal(signal.SIGCONT)
        self.paused = False

    def stop(self, timeout=30.0) -> int:
        if self.proc.poll() is not None:
            return self.proc.returncode
        if self.paused:
            self.resume()
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            pytest.fail(f"{self.name} did not exit within {timeout}s of SIGTERM; "
                        f"stderr: {self.stderr()[-3000:]}")

    def metric(self, name: str, labels: str = "") -> float:
        """One series of this process's /metrics (0 when absent)."""
        return metric(self.metrics(), name, labels)

    def metrics(self) -> dict:
        """Prometheus text as {'name{labels}': value}."""
        with urllib.request.urlopen(self.http + "/metrics", timeout=10) as r:
            text = r.read().decode()
        out = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                k, v = line.rsplit(" ", 1)
                out[k] = float(v)
        return out


def exported_series(metrics: dict) -> set:
    """The series of a /metrics snapshot, histograms by their family name."""
    out = set()
    for key in metrics:
        name, _, labels = key.partition("{")
        for suffix in ("_bucket", "_sum", "_count"):
            if name.endswith(suffix):
                name, labels = name[:-len(suffix)], ""  # a histogram (ours have no labels)
        out.add(name + ("{" + labels if labels else ""))
    return out


def spec_counters(http: str) -> dict:
    """The chunkserve:spec_decode_* counters of the process whose ops port is `http`
    (host:port), settled: a step's counters are published after its events, so read
    until two reads 100 ms apart agree (at most 5 s)."""
    def read():
        with urllib.request.urlopen(f"http://{http}/metrics", timeout=10) as r:
            return {k: float(v) for k, v in (line.split() for line in r.read().decode().splitlines()
                                             if line.startswith("chunkserve:spec_decode_"))}
    prev = read()
    for _ in range(50):
        time.sleep(0.1)
        cur = read()
        if cur == prev:
            return cur
        prev = cur
    return prev


def metric(m: dict, name: str, labels: str = "") -> float:
    return m.get(f"{name}{{{labels}}}" if labels else name, 0.0)


def make_tiny(bin_dir: Path, out: Path, *flags) -> Path:
    """A tiny random-weight model from chunkserve-mktiny (flags: --qwen2, --layers N, ...)
    in out/; returns out/tiny.gguf."""
    out.mkdir(parents=True, exist_ok=True)
    subprocess.run([str(bin_dir / "chunkserve-mktiny"), "--out", str(out), *map(str, flags)],
                   check=True, capture_output=True)
    return out / "tiny.gguf"


def make_pki(d: Path, cas: dict) -> Path:
    """Certificates made with the `openssl` CLI in d: for each CA name in cas (d/CA.pem,
    d/CA.key), its leaves (d/LEAF.pem, d/LEAF.key) for 127.0.0.1 and localhost, usable by
    servers and clients alike. Returns d."""
    def openssl(*args):
        subprocess.run(["openssl", *args], cwd=d, check=True, capture_output=True)
    (d / "ext.cnf").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n"
                               "extendedKeyUsage=serverAuth,clientAuth\n")
    for ca, leaves in cas.items():
        openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", f"{ca}.key",
                "-out", f"{ca}.pem", "-days", "2", "-subj", f"/CN=chunkserve test {ca}")
        for name in leaves:
            openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", f"{name}.key", "-out",
                    f"{name}.csr", "-subj", f"/CN={name}")
            openssl("x509", "-req", "-in", f"{name}.csr", "-CA", f"{ca}.pem", "-CAkey",
                    f"{ca}.key", "-CAcreateserial", "-out", f"{name}.pem", "-days", "2",
                    "-extfile", "ext.cnf")
    return d


def rpc_token(secret: str | None) -> list:
    """The metadata worker RPCs carry under a cluster secret (base/src/secret.c): the hex
    HMAC-SHA256 of a fixed label keyed by the secret; [] without one."""
    if not secret:
        return []
    tok = hmac.new(secret.encode(), b"chunkserve worker rpc v1", hashlib.sha256).hexdigest()
    return [("x-chunkserve-token", tok)]


def worker_status(pb, p: Proc, timeout=10, secret: str | None = None):
    """Worker/GetStatus of one worker process."""
    ch = grpc.insecure_channel(p.addr)
    try:
        return pb.cluster_pb2_grpc.WorkerStub(ch).GetStatus(pb.cluster_pb2.WorkerStatusRequest(),
                                                            timeout=timeout,
                                                            metadata=rpc_token(secret))
    finally:
        ch.close()


def wait_idle(pb, procs, timeout=30.0, secret: str | None = None):
    """Every live (not killed, not paused) worker of procs idle with every page free: no
    request running or waiting (the failure contract)."""
    t_end = time.monotonic() + timeout
    while True:
        bad = []
        for p in procs:
            if p.proc.poll() is not None or p.paused:
                continue
            s = worker_status(pb, p, secret=secret)
            if s.kv_pages_free != s.kv_pages_total or s.num_running or s.num_waiting:
                bad.append((p.name, s.kv_pages_free, s.kv_pages_total, s.num_running, s.num_waiting))
        if not bad:
            return
        if time.monotonic() > t_end:
            pytest.fail(f"workers not idle with all pages free: {bad}")
        time.sleep(0.1)


class FaultProxy:
    """A TCP proxy in front of target (one thread per direction per connection) that can
    partition silently: after cut() it stops passing bytes but keeps every socket open, so
    neither end sees an error or a FIN (as behind a failed switch); heal() lets the bytes
    flow again.  When either end closes, the proxy closes the other; a target that does
    not answer closes the client's connection.  With rate (bytes/s) each direction of
    each connection passes at most that many bytes a second, through 64 KiB socket
    buffers on the proxy's side (a slow link, not a deep queue in front of one)."""

    def __init__(self, target: str, listen=("127.0.0.1", 0), rate: float | None = None):
        self.host, port = target.rsplit(":", 1)
        self.target = (self.host, int(port))
        self.rate = rate
        self.lis = socket.socket()
        self.lis.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if rate:  # inherited by the accepted sockets: the sender's window stays small
            self.lis.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 << 10)
            self.lis.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 64 << 10)
        self.lis.bind(listen)
        self.lis.listen(64)
        self.addr = f"{listen[0]}:{self.lis.getsockname()[1]}"
        self.cut_ = threading.Event()
        self.closing = threading.Event()
        self.socks = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self):
        while not self.closing.is_set():
            try:
                c, _ = self.lis.accept()
            except OSError:
                return
            try:
                u = socket.socket()
                if self.rate:
                    u.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 << 10)
                    u.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 64 << 10)
                u.settimeout(5)
                u.connect(self.target)
            except OSError:
                c.close()
                continue
            self.socks += [c, u]
            for a, b in ((c, u), (u, c)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    def _pump(self, a, b):
        a.settimeout(0.2)
        t_next = time.monotonic()  # with a rate: when the next byte may pass
        while not self.closing.is_set():
            if self.cut_.is_set():
                time.sleep(0.05)
                continue
            try:
                data = a.recv(int(self.rate) // 50 or 1 if self.rate else 65536)
            except socket.timeout:
                continue
            except OSError:
                break
            if not data:
                break
            if self.rate:
                t_next = max(t_next, time.monotonic()) + len(data) / self.rate
                time.sleep(max(0.0, t_next - time.monotonic()))
            try:
                b.sendall(data)
            except OSError:
                break
        for s in (a, b):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def cut(self):
        self.cut_.set()

    def heal(self):
        self.cut_.clear()

    def close(self):
        self.closing.set()
        self.lis.close()
        for s in self.socks:
            try:
                s.close()
            except OSError:
                pass


class Flood:
    """n long token-id prompts (n_tokens each, 2 output tokens) sent at once, one thread each,
    through stub (a GenerationStub) with metadata and GenerateRequest fields; the ones that
    ended well in `done`, in order, the failures in `errors`. seed varies the prompts."""

    def __init__(self, stub, g, n: int, n_tokens: int, seed=0, metadata=None, **fields):
        self.done: list[int] = []
        self.errors: list[BaseException] = []
        self._lock = threading.Lock()

        def one(i):
            try:
                ids = [(7 * (seed + i) + k) % 300 + 3 for k in range(n_tokens)]
                req = g.GenerateRequest(token_ids=g.TokenIds(ids=ids), sampling=g.SamplingParams(
                    max_tokens=2, ignore_eos=True), **fields)
                list(stub.Generate(req, timeout=300, metadata=metadata))
                with self._lock:
                    self.done.append(i)
            except BaseException as e:  # noqa: BLE001 - the caller asserts on errors
                self.errors.append(e)

        self._threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
        for t in self._threads:
            t.start()

    def n_done(self) -> int:
        with self._lock:
            return len(self.done)

    def join(self, timeout=300.0):
        for t in self._threads:
            t.join(timeout)
        assert not self.errors, self.errors


def wait_for(cond, timeout: float, what: str, interval=0.05):
    """Polls cond() until it returns something true (returned); fails the test, naming
    `what`, after timeout seconds."""
    t_end = time.monotonic() + timeout
    while True:
        v = cond()
        if v:
            return v
        if time.monotonic() > t_end:
            pytest.fail(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(interval)


def wait_metric(p, name: str, labels: str, value: float, at_least=False, timeout=30.0):
    """Waits for p's series to reach value (or at least value): a sender's transfer
    counters move when the receiver's acknowledgement reaches it, which can come after
    the client's last token."""
    ok = (lambda v: v >= value) if at_least else (lambda v: v == value)
    wait_for(lambda: ok(p.metric(name, labels)), timeout,
             f"{p.name}'s {name}{{{labels}}} {'>=' if at_least else '=='} {value}")


class Cluster:
    """n_prefill + n_decode workers behind a router, on loopback."""

    def __init__(self, bin_dir: Path, model: Path, pb, n_prefill=2, n_decode=2, threads=1,
                 router_args=(), worker_args=(), decode_args=(), prefill_args=(), kv_cache_mib=512,
                 secret: str | None = None, prefill_knows_decode="list", decode_each=()):
        """decode_each: more arguments for decode worker i (entry i; a shorter list: none)."""
        self.pb = pb
        self.secret = secret
        sec = [f"--cluster-secret={secret}"] if secret else []
        common = [f"--model={model}", "--port=0", f"--threads={threads}", f"--kv-cache-mib={kv_cache_mib}",
                  "--grace-ms=3000", *sec, *worker_args]
        each = lambda i: list(decode_each[i]) if i < len(decode_each) else []
        self.decode = [Proc(bin_dir / "chunkserve-decode", [*common, *decode_args, *each(i)],
                            f"decode-{i}") for i in range(n_decode)]
        # as deployed: a prefill worker sends KV pages only to the decode
        # workers it polls itself (their advertised KV endpoints), listed
        # ("list") or found by DNS ("dns": localhost:port, one decode worker)
        known = []
        if self.decode and prefill_knows_decode == "list":
            known = ["--decode-workers=" + ",".join(p.addr for p in self.decode)]
        elif self.decode and prefill_knows_decode == "dns":
            assert len(self.decode) == 1, "one name:port is one decode worker here"
            port = self.decode[0].addr.rsplit(":", 1)[1]
            known = [f"--decode-dns=localhost:{port}", "--dns-refresh-ms=500"]
        if known:
            known.append("--status-interval-ms=100")
        self.prefill = [Proc(bin_dir / "chunkserve-prefill", [*common, *known, *prefill_args], f"prefill-{i}")
                        for i in range(n_prefill)]
        rargs = [f"--model={model}", "--port=0", "--status-interval-ms=100", "--grace-ms=3000",
                 "--decode-workers=" + ",".join(p.addr for p in self.decode), *sec, *router_args]
        if self.prefill:
            rargs.append("--prefill-workers=" + ",".join(p.addr for p in self.prefill))
        self.router = Proc(bin_dir / "chunkserve-router", rargs, "router")
        self.channel = grpc.insecure_channel(self.router.addr)
        self.stub = pb.generation_pb2_grpc.GenerationStub(self.channel)
        self.wait_usable(n_prefill, n_decode)

    def worker_stub(self, p: Proc):
        return self.pb.cluster_pb2_grpc.WorkerStub(grpc.insecure_channel(p.addr))

    def status(self, p: Proc):
        ch = grpc.insecure_channel(p.addr)
        try:
            return self.pb.cluster_pb2_grpc.WorkerStub(ch).GetStatus(
                self.pb.cluster_pb2.WorkerStatusRequest(), timeout=10,
                metadata=rpc_token(self.secret))
        finally:
            ch.close()

    def wait_usable(self, n_prefill, n_decode, timeout=60.0):
        t_end = time.monotonic() + timeout
        while True:
            m = self.router.metrics()
            if (metric(m, "chunkserve:workers_usable", 'role="prefill"') == n_prefill and
                    metric(m, "chunkserve:workers_usable", 'role="decode"') == n_decode):
                return
            if time.monotonic() > t_end:
                pytest.fail(f"router sees {m} usable workers, want {n_prefill}+{n_decode}; "
                            f"router stderr: {self.router.stderr()[-3000:]}")
            time.sleep(0.1)

    def wait_idle(self, timeout=30.0):
        """Every live worker idle with every page free (the failure contract)."""
        t_end = time.monotonic() + timeout
        while True:
            bad = []
            for p in self.prefill + self.decode:
                if p.proc.poll() is not None:
                    continue
                s = self.status(p)
                if s.kv_pages_free != s.kv_pages_total or s.num_running or s.num_waiting:
                    bad.append((p.name, s.kv_pages_free, s.kv_pages_total, s.num_running, s.num_waiting))
            if not bad:
                return
            if time.monotonic() > t_end:
                pytest.fail(f"workers not idle with all pages free: {bad}")
            time.sleep(0.1)

    def stop(self):
        self.channel.close()
        errs = []
        for p in [self.router, *self.prefill, *self.decode]:
            rc = p.stop()
            err = p.stderr()
            if rc not in (0, -9) or "Sanitizer" in err or "runtime error:" in err:
                errs.append(f"{p.name} exit {rc}: {err[-3000:]}")
        assert not errs, "\n".join(errs)


def generate(stub, g, prompt=None, ids=None, max_tokens=16, timeout=300, **sampling):
    """(ids, text, finish, messages) of one finished stream."""
    inp = dict(prompt=prompt) if prompt is not None else dict(token_ids=g.TokenIds(ids=ids))
    msgs = list(stub.Generate(g.GenerateRequest(
        **inp, sampling=g.SamplingParams(max_tokens=max_tokens, **sampling)), timeout=timeout))
    return ([t for m in msgs for t in m.token_ids], "".join(m.text for m in msgs),
            msgs[-1].finish_reason, msgs)


class Reference:
    """Single-process ids: `chunkserve serve` (exe) on a model, ignore_eos (greedy unless
    sampling parameters with a seed are given)."""

    def __init__(self, exe: Path, model: Path, pb, *args):
        self.g = pb.generation_pb2
        self.err = tempfile.TemporaryFile()
        self.proc = subprocess.Popen([str(exe), "serve", "--model", str(model), "--port", "0",
                                      "--threads", "1", "--kv-cache-mib", "16", *args],
                                     stdout=subprocess.PIPE, stderr=self.err)
        line = self.proc.stdout.readline().decode()
        if not line.startswith("listening on "):
            self.proc.kill()
            pytest.fail(f"chunkserve serve: unexpected first line {line!r}")
        self.channel = grpc.insecure_channel(line.split()[-1])
        self.stub = pb.generation_pb2_grpc.GenerationStub(self.channel)
        self.cache = {}

    def __call__(self, prompt, n, **sampling):
        """(ids, text) of the continuation of prompt (token ids), n tokens."""
        key = (tuple(prompt), n, tuple(sorted(sampling.items())))
        if key not in self.cache:
            ids, text, finish, _ = generate(self.stub, self.g, ids=list(prompt), max_tokens=n,
                                            timeout=300, ignore_eos=True, **sampling)
            assert len(ids) == n and finish == self.g.FINISH_REASON_LENGTH
            self.cache[key] = (ids, text)
        return self.cache[key]

    def stop(self):
        self.channel.close()
        self.proc.send_signal(signal.SIGTERM)
        rc = self.proc.wait(timeout=30)
        self.err.seek(0)
        err = self.err.read().decode(errors="replace")
        assert rc == 0 and "Sanitizer" not in err and "runtime error:" not in err, err[-3000:]
