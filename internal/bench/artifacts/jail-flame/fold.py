#!/usr/bin/env python3
"""Fold `perf script` output into flame graph stacks: comm;outer;...;leaf count."""
import re, sys, collections
counts = collections.Counter()
comm = None; frames = []
def flush():
    if comm is not None and frames:
        counts[";".join([comm] + frames[::-1])] += 1
for line in sys.stdin:
    line = line.rstrip("\n")
    if not line.strip():
        flush(); comm = None; frames = []; continue
    if not line.startswith((" ", "\t")):
        flush(); frames = []
        comm = line.split()[0] if line.split() else "?"
        comm = re.sub(r"\d+$", "N", comm) if comm.startswith("kworker") else comm
        continue
    parts = line.strip().split(None, 1)
    if len(parts) < 2: continue
    sym = parts[1]
    sym = re.sub(r"\+0x[0-9a-f]+", "", sym)
    sym = re.sub(r" \(.*\)$", "", sym)
    if sym == "[unknown]": sym = "[unknown]"
    frames.append(sym.replace(";", ":"))
flush()
for k, v in sorted(counts.items()):
    print(k, v)
