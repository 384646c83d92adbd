#!/usr/bin/env python3
"""Requantize a GGUF with llama.cpp (llama-cpp-python), every tensor but the 1-D ones to one type
(`pure`), for the speed comparisons of docs/perf.md on Q4_0 and Q8_0, where llama.cpp has its
fastest x86 paths. Needs `pip install llama-cpp-python` (a benchmark tool, not a dependency).

  python3 bench/requant.py models/SmolLM2-135M-Instruct.Q4_1.gguf /tmp/q4_0.gguf q4_0
"""
import ctypes
import sys

import llama_cpp

FTYPES = {"q4_0": llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_0, "q4_1": llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_1,
          "q8_0": llama_cpp.LLAMA_FTYPE_MOSTLY_Q8_0}


def main():
    if len(sys.argv) != 4 or sys.argv[3] not in FTYPES:
        sys.exit(__doc__)
    p = llama_cpp.llama_model_quantize_default_params()
    p.ftype = FTYPES[sys.argv[3]]
    p.allow_requantize = True
    p.pure = True
    p.nthread = 2
    r = llama_cpp.llama_model_quantize(sys.argv[1].encode(), sys.argv[2].encode(), ctypes.byref(p))
    sys.exit(f"llama_model_quantize failed ({r})" if r else 0)


if __name__ == "__main__":
    main()
