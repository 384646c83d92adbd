#!/usr/bin/env python3
"""grpc_check.py: one greedy chunkserve.v1.Generation/Generate call from a real grpcio client.

Used by build-image.sh against the router of a cluster running inside the image (buildah's
chroot isolation shares the host's network, so the router is on 127.0.0.1). Stubs are
generated from proto/ with grpcio-tools, as tests/py/conftest.py does. Prints the streamed
token ids and text as one JSON object on stdout; exits non-zero when the call fails, streams
no token, or (with --want-file) the text differs from the expected one.

Not a test suite: tests/py covers the API; this only proves the image serves it.
"""
from __future__ import annotations

import argparse
import importlib
import json
import sys
import tempfile
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]


def load_stubs(out: Path):
    from grpc_tools import protoc

    include = Path(protoc.__file__).parent / "_proto"
    rc = protoc.main(["grpc_tools.protoc", f"-I{REPO_ROOT / 'proto'}", f"-I{include}",
                      f"--python_out={out}", f"--grpc_python_out={out}",
                      "chunkserve/v1/generation.proto"])
    if rc != 0:
        sys.exit("grpc_check: grpc_tools.protoc failed on chunkserve/v1/generation.proto")
    sys.path.insert(0, str(out))
    return (importlib.import_module("chunkserve.v1.generation_pb2"),
            importlib.import_module("chunkserve.v1.generation_pb2_grpc"))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--addr", required=True, help="router address, host:port")
    ap.add_argument("--prompt", default="The capital of France is")
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--timeout", type=float, default=120.0, help="deadline of the call, seconds")
    ap.add_argument("--want-file", help="file holding the expected text (`chunkserve generate` "
                    "stdout, its final newline dropped)")
    args = ap.parse_args()

    import grpc

    with tempfile.TemporaryDirectory(prefix="cs-grpc-stubs-") as d:
        g, g_grpc = load_stubs(Path(d))
        with grpc.insecure_channel(args.addr) as ch:
            grpc.channel_ready_future(ch).result(timeout=args.timeout)
            stub = g_grpc.GenerationStub(ch)
            req = g.GenerateRequest(prompt=args.prompt,
                                    sampling=g.SamplingParams(max_tokens=args.max_tokens))
            msgs = list(stub.Generate(req, timeout=args.timeout))
    ids = [t for m in msgs for t in m.token_ids]
    text = "".join(m.text for m in msgs)
    finish = msgs[-1].finish_reason if msgs else None
    print(json.dumps({"token_ids": ids, "text": text, "finish_reason": finish}))
    if not ids:
        print("grpc_check: the stream carried no token", file=sys.stderr)
        return 1
    if args.want_file:
        want = Path(args.want_file).read_text(encoding="utf-8")
        want = want[:-1] if want.endswith("\n") else want
        if text != want:
            print(f"grpc_check: cluster text {text!r} != single-process `generate` {want!r}",
                  file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
