#!/usr/bin/env python3
"""Turns the stacks a fault-injection build prints (CS_FAULT_TRACE=1: "fault
injection: this allocation fails:" then one "binary(+0xoffset)" line a frame)
into function and file:line with addr2line.  Usage: symbolize_fault_traces.py LOG [LAST]
(LAST: only the last LAST stacks; default all)."""
import re
import subprocess
import sys


def main() -> None:
    lines = open(sys.argv[1], errors="replace").read().split("\n")
    starts = [i for i, ln in enumerate(lines) if "this allocation fails" in ln]
    if len(sys.argv) > 2:
        starts = starts[-int(sys.argv[2]):]
    for i in starts:
        print(f"--- stack at log line {i + 1}")
        for ln in lines[i + 1:i + 25]:
            m = re.search(r"(/\S+)\(\+(0x[0-9a-f]+)\)", ln)
            if not m:
                break
            if "lib" in m.group(1).rsplit("/", 1)[-1][:3]:
                continue  # shared libraries: libc, libuv, libasan
            out = subprocess.run(["addr2line", "-f", "-i", "-e", m.group(1),
                                  hex(int(m.group(2), 16) - 1)],
                                 capture_output=True, text=True).stdout.split("\n")
            for fn, loc in zip(out[0::2], out[1::2]):
                print(f"  {fn}  {loc}")


if __name__ == "__main__":
    main()
