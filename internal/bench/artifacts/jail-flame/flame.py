#!/usr/bin/env python3
"""Render folded stacks ("a;b;c N" lines) as a static flame graph SVG."""
import argparse, html, sys, zlib

def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("folded")
    ap.add_argument("--title", default="Flame graph")
    ap.add_argument("--width", type=int, default=1200)
    ap.add_argument("--min", type=float, default=0.1, help="hide frames narrower than this many pixels")
    a = ap.parse_args()
    root = {"n": 0, "kids": {}}
    for line in open(a.folded):
        line = line.rstrip("\n")
        if not line: continue
        stack, n = line.rsplit(" ", 1)
        n = int(n)
        node = root; node["n"] += n
        for f in stack.split(";"):
            node = node["kids"].setdefault(f, {"n": 0, "kids": {}})
            node["n"] += n
    total = root["n"] or 1
    W, H, pad = a.width, 16, 10
    scale = (W - 2 * pad) / total
    rects = []
    def depth(node):
        return 1 + max((depth(k) for k in node["kids"].values()), default=0)
    D = depth(root)
    def walk(node, name, x, d):
        w = node["n"] * scale
        if w < a.min: return
        if d >= 0:
            rects.append((name, x, d, w, node["n"]))
        cx = x
        for k in sorted(node["kids"]):
            kid = node["kids"][k]
            walk(kid, k, cx, d + 1)
            cx += kid["n"] * scale
    walk(root, "all", pad, -1)
    height = (D + 2) * H + 40
    out = ['<?xml version="1.0" standalone="no"?>',
           '<svg version="1.1" width="%d" height="%d" xmlns="http://www.w3.org/2000/svg" font-family="Verdana" font-size="11">' % (W, height),
           '<rect x="0" y="0" width="%d" height="%d" fill="#f8f8f0"/>' % (W, height),
           '<text x="%d" y="20" text-anchor="middle" font-size="15">%s</text>' % (W // 2, html.escape(a.title))]
    for name, x, d, w, n in rects:
        y = height - 10 - (d + 1) * H
        h = zlib.crc32(name.encode())
        kernel = not ("/" in name or name.startswith("[") or name[:1].isupper() or "Py" in name or name.startswith("_"))
        if kernel:
            col = "rgb(%d,%d,%d)" % (200 + h % 55, 90 + (h >> 8) % 80, 40 + (h >> 16) % 40)
        else:
            col = "rgb(%d,%d,%d)" % (80 + h % 60, 150 + (h >> 8) % 80, 200 + (h >> 16) % 55)
        label = "%s (%d samples, %.2f%%)" % (name, n, 100.0 * n / total)
        out.append('<g><title>%s</title><rect x="%.1f" y="%d" width="%.1f" height="%d" fill="%s" rx="2"/>' % (html.escape(label), x, y, w, H - 1, col))
        chars = int(w / 7)
        if chars >= 3:
            t = name if len(name) <= chars else name[:chars - 2] + ".."
            out.append('<text x="%.1f" y="%d">%s</text>' % (x + 3, y + H - 4, html.escape(t)))
        out.append('</g>')
    out.append('</svg>')
    sys.stdout.write("\n".join(out) + "\n")

main()
