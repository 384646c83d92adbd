"""Dequantization, bit for bit against the gguf Python package's own dequantizer.

Every block type chunkserve loads (F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K,
Q6_K) is written into a GGUF file with gguf's GGUFWriter: random block bytes (every bit
pattern of the quants, scales and mins occurs) with finite fp16 scales. `chunkserve tensor`
reads each back as fp32, as an --exact load dequantizes it, and the result must equal
gguf.quants.dequantize of the same bytes bitwise. Then: a non-finite scale is refused naming
the tensor; types we do not support are refused at load naming the tensor and the type.
"""
from __future__ import annotations

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")
Q = gguf.GGMLQuantizationType

# (type, offsets of the fp16 scales inside one block)
BLOCK_TYPES = [
    (Q.Q4_0, [0]), (Q.Q4_1, [0, 2]), (Q.Q5_0, [0]), (Q.Q5_1, [0, 2]), (Q.Q8_0, [0]),
    (Q.Q4_K, [0, 2]), (Q.Q5_K, [0, 2]), (Q.Q6_K, [208]),
]
ROWS, COLS = 6, 512


def random_blocks(rng, qtype, scale_offs, rows, cols, bad_block=None):
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    n_blocks = rows * cols // block
    raw = rng.integers(0, 256, size=(n_blocks, size), dtype=np.uint8)
    for off in scale_offs:  # finite fp16 scales of both signs, some tiny, some subnormal
        mag = rng.uniform(-12, 2, size=n_blocks)
        scale = (np.sign(rng.uniform(-1, 1, size=n_blocks)) * 2.0 ** mag).astype(np.float16)
        scale[::17] = np.float16(3e-6)  # fp16 subnormal
        raw[:, off:off + 2] = scale.view(np.uint8).reshape(n_blocks, 2)
    if bad_block is not None:
        raw[bad_block, scale_offs[-1]:scale_offs[-1] + 2] = np.array([0x00, 0x7e], np.uint8)
    return raw.reshape(rows, cols // block * size)


def write_gguf(path, tensors):
    w = gguf.GGUFWriter(str(path), "llama")
    for name, (qtype, data) in tensors.items():
        w.add_tensor(name, data, raw_dtype=qtype)  # quantized: data is the rows' bytes
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def read_back(chunkserve_bin, path, name, tmp_path):
    from conftest import run_cli
    out = tmp_path / f"{name}.f32"
    run_cli(chunkserve_bin, ["tensor", "--model", path, "--tensor", name, "--out", out])
    return np.fromfile(out, dtype=np.float32)


def test_every_type_equals_gguf_dequantizer(chunkserve_bin, tmp_path):
    rng = np.random.default_rng(35)
    tensors = {f"t.{qt.name.lower()}": (qt, random_blocks(rng, qt, offs, ROWS, COLS))
               for qt, offs in BLOCK_TYPES}
    f32 = rng.standard_normal((ROWS, COLS)).astype(np.float32)
    tensors["t.f32"] = (Q.F32, f32)
    tensors["t.f16"] = (Q.F16, f32.astype(np.float16))
    bf16 = (f32.view(np.uint32) >> 16).astype(np.uint16)  # bf16 bits, truncated
    tensors["t.bf16"] = (Q.BF16, bf16.view(np.uint8).reshape(ROWS, COLS * 2))
    path = tmp_path / "types.gguf"
    write_gguf(path, tensors)
    checked = []
    for name, (qt, data) in tensors.items():
        got = read_back(chunkserve_bin, path, name, tmp_path)
        want = gguf.quants.dequantize(data, qt).astype(np.float32).reshape(-1)
        assert got.shape == want.shape, name
        diff = np.flatnonzero(got.view(np.uint32) != want.view(np.uint32))
        assert diff.size == 0, (f"{name}: {diff.size} of {got.size} values differ from gguf's "
                                f"dequantizer; first at {diff[0]}: {got[diff[0]]!r} != "
                                f"{want[diff[0]]!r}")
        checked.append(qt.name)
    print(f"\nbitwise equal to gguf {gguf.__version__ if hasattr(gguf, '__version__') else ''}: "
          f"{', '.join(checked)}")


@pytest.mark.parametrize("qt,offs", BLOCK_TYPES[:1] + BLOCK_TYPES[5:], ids=lambda v: str(v))
def test_non_finite_scale_is_refused(chunkserve_bin, tmp_path, qt, offs):
    rng = np.random.default_rng(7)
    path = tmp_path / "bad.gguf"
    write_gguf(path, {"blk.3.ffn_down.weight": (qt, random_blocks(rng, qt, offs, 2, COLS,
                                                                    bad_block=1))})
    import subprocess
    p = subprocess.run([str(chunkserve_bin), "tensor", "--model", str(path), "--tensor",
                        "blk.3.ffn_down.weight", "--out", str(tmp_path / "x")],
                       capture_output=True, text=True, timeout=60)
    assert p.returncode != 0
    assert "blk.3.ffn_down.weight" in p.stderr and "NaN" in p.stderr, p.stderr
    assert not (tmp_path / "x").exists()


@pytest.mark.parametrize("qt", [Q.Q2_K, Q.Q3_K, Q.IQ4_XS, Q.IQ2_XXS, Q.TQ1_0])
def test_unsupported_types_are_refused_by_name(chunkserve_bin, tmp_path, qt):
    block, size = gguf.GGML_QUANT_SIZES[qt]
    data = np.zeros((2, COLS // block * size), dtype=np.uint8)
    path = tmp_path / "unsupported.gguf"
    write_gguf(path, {"blk.0.attn_v.weight": (qt, data)})
    import subprocess
    p = subprocess.run([str(chunkserve_bin), "tensor", "--model", str(path), "--tensor",
                        "blk.0.attn_v.weight", "--out", str(tmp_path / "x")],
                       capture_output=True, text=True, timeout=60)
    assert p.returncode != 0
    name = qt.name.lower() if not qt.name.endswith("_K") else qt.name[:-2].lower() + "_K"
    assert "blk.0.attn_v.weight" in p.stderr and name in p.stderr, p.stderr


def test_gemma3_file_loads_with_its_window_pattern(chunkserve_bin, named_model):
    """The real Gemma-3-270M Q4_K_M (scripts/fetch-model.sh gemma3-270m): its hyperparameters
    come from the file's metadata, and those the GGUF does not carry take Gemma 3's values
    (a global layer after every 5 windowed ones, RoPE base 10000 on the windowed layers).
    tests/unit/test_model.c refuses files with an impossible window or pattern."""
    import json
    import subprocess
    p = subprocess.run([str(chunkserve_bin), "info", "--model", str(named_model("gemma3-270m"))],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    info = json.loads(p.stdout)
    assert info["arch"] == "gemma3" and info["sliding_window"] == 512
    assert info["layer_windows"] == ([512] * 5 + [0]) * 3
    assert info["rope_theta"] == 1e6 and info["rope_theta_swa"] == 1e4
    assert info["qk_norm"] and info["post_norms"] and info["activation"] == "gelu_tanh"
    assert abs(info["embed_scale"] - 640 ** 0.5) < 1e-4 and info["attn_scale"] == 0.0625
