#!/usr/bin/env python3
"""Convert a llama-family GGUF file to a Hugging Face model directory
(config.json, model.safetensors, tokenizer.json, tokenizer_config.json).

Weights are dequantized with the `gguf` package and written as F32 (or
--dtype bf16/f16); llama q/k rows are un-permuted back to Hugging Face order.
chunkserve's tests use it to load the real default model through its
safetensors path and check the logits equal the GGUF path's bit for bit.

    python3 tools/gguf_to_hf.py models/SmolLM2-135M-Instruct.Q4_1.gguf OUT_DIR
"""
import argparse
import json
import os
import struct
import sys

import numpy as np
from gguf import GGUFReader, GGMLQuantizationType
from gguf.quants import dequantize

PRE_TOKENIZERS = {
    "smollm": {"type": "Sequence", "pretokenizers": [
        {"type": "Digits", "individual_digits": True},
        {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}]},
    "gpt2": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True},
}


def field(r, key, default=None):
    f = r.fields.get(key)
    return default if f is None else f.contents()


def unpermute(w, n_heads):
    # inverse of llama.cpp's convert permute: (n_head, 2, hd/2) <- (n_head, hd/2, 2)
    rows = w.shape[0]
    hd = rows // n_heads
    return w.reshape(n_heads, hd // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("gguf")
    ap.add_argument("out")
    ap.add_argument("--dtype", choices=["f32", "bf16", "f16"], default="f32")
    a = ap.parse_args()
    r = GGUFReader(a.gguf)
    arch = field(r, "general.architecture")
    if arch != "llama":
        sys.exit(f"gguf_to_hf: only llama GGUF files are supported, not {arch}")
    n_heads = field(r, f"{arch}.attention.head_count")
    n_kv = field(r, f"{arch}.attention.head_count_kv", n_heads)
    dim = field(r, f"{arch}.embedding_length")
    tokens = field(r, "tokenizer.ggml.tokens")
    os.makedirs(a.out, exist_ok=True)

    names = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
             "output.weight": "lm_head.weight"}
    per_layer = {"attn_norm.weight": "input_layernorm.weight", "attn_q.weight": "self_attn.q_proj.weight",
                 "attn_k.weight": "self_attn.k_proj.weight", "attn_v.weight": "self_attn.v_proj.weight",
                 "attn_output.weight": "self_attn.o_proj.weight", "ffn_norm.weight": "post_attention_layernorm.weight",
                 "ffn_gate.weight": "mlp.gate_proj.weight", "ffn_up.weight": "mlp.up_proj.weight",
                 "ffn_down.weight": "mlp.down_proj.weight"}
    tensors = {}
    for t in r.tensors:
        if t.name in names:
            hf = names[t.name]
        else:
            parts = t.name.split(".", 2)
            if parts[0] != "blk" or parts[2] not in per_layer:
                continue
            hf = f"model.layers.{parts[1]}.{per_layer[parts[2]]}"
        shape = tuple(int(x) for x in reversed(t.shape))  # ggml ne order -> PyTorch order
        w = dequantize(t.data, GGMLQuantizationType(t.tensor_type)).astype(np.float32).reshape(shape)
        if t.name.endswith("attn_q.weight"):
            w = unpermute(w, n_heads)
        elif t.name.endswith("attn_k.weight"):
            w = unpermute(w, n_kv)
        tensors[hf] = w
    tied = "lm_head.weight" not in tensors

    # model.safetensors
    st_dtype = {"f32": "F32", "bf16": "BF16", "f16": "F16"}[a.dtype]
    header, blobs, off = {"__metadata__": {"format": "pt"}}, [], 0
    for name, w in tensors.items():
        if a.dtype == "f32":
            b = w.astype("<f4").tobytes()
        elif a.dtype == "f16":
            b = w.astype("<f2").tobytes()
        else:  # bf16, round to nearest even
            u = w.astype("<f4").view("<u4").astype(np.uint64)
            b = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype("<u2").tobytes()
        header[name] = {"dtype": st_dtype, "shape": list(w.shape), "data_offsets": [off, off + len(b)]}
        blobs.append(b)
        off += len(b)
    hj = json.dumps(header, separators=(",", ":")).encode()
    hj += b" " * ((8 - len(hj) % 8) % 8)
    with open(os.path.join(a.out, "model.safetensors"), "wb") as f:
        f.write(struct.pack("<Q", len(hj)))
        f.write(hj)
        for b in blobs:
            f.write(b)

    cfg = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": len(tokens),
           "hidden_size": dim, "intermediate_size": field(r, f"{arch}.feed_forward_length"),
           "num_hidden_layers": field(r, f"{arch}.block_count"), "num_attention_heads": n_heads,
           "num_key_value_heads": n_kv, "max_position_embeddings": field(r, f"{arch}.context_length"),
           "rms_norm_eps": float(field(r, f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)),
           "rope_theta": float(field(r, f"{arch}.rope.freq_base", 10000.0)), "tie_word_embeddings": tied,
           "bos_token_id": field(r, "tokenizer.ggml.bos_token_id"), "eos_token_id": field(r, "tokenizer.ggml.eos_token_id"),
           "torch_dtype": {"f32": "float32", "bf16": "bfloat16", "f16": "float16"}[a.dtype]}
    with open(os.path.join(a.out, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)

    pre = field(r, "tokenizer.ggml.pre", "gpt2")
    if pre not in PRE_TOKENIZERS:
        sys.exit(f"gguf_to_hf: pre-tokenizer {pre} not mapped")
    types = field(r, "tokenizer.ggml.token_type")
    added = [{"id": i, "content": tokens[i], "single_word": False, "lstrip": False, "rstrip": False,
              "normalized": False, "special": True} for i in range(len(tokens)) if types[i] == 3]
    tj = {"version": "1.0", "truncation": None, "padding": None, "added_tokens": added, "normalizer": None,
          "pre_tokenizer": PRE_TOKENIZERS[pre], "post_processor": None,
          "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
          "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                    "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False,
                    "vocab": {t: i for i, t in enumerate(tokens)},
                    "merges": list(field(r, "tokenizer.ggml.merges"))}}
    with open(os.path.join(a.out, "tokenizer.json"), "w", encoding="utf-8") as f:
        json.dump(tj, f, ensure_ascii=False)
    tc = {"add_bos_token": bool(field(r, "tokenizer.ggml.add_bos_token", False)),
          "bos_token": tokens[field(r, "tokenizer.ggml.bos_token_id")],
          "eos_token": tokens[field(r, "tokenizer.ggml.eos_token_id")],
          "chat_template": field(r, "tokenizer.chat_template")}
    with open(os.path.join(a.out, "tokenizer_config.json"), "w", encoding="utf-8") as f:
        json.dump(tc, f, ensure_ascii=False, indent=2)
    print(f"gguf_to_hf: wrote {a.out} ({len(tensors)} tensors, {a.dtype})", file=sys.stderr)


if __name__ == "__main__":
    main()
