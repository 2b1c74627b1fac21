#!/usr/bin/env python3
"""The library's folders include each other in one direction only (docs/design.md,
"Folders, and which way includes run"): every #include "llmpar/<folder>/..." in
include/llmpar/<a>/ names a folder below <a> in LAYERS. A folder missing from LAYERS,
or an include that runs back up, fails naming the file, the line and the two folders.
It checks itself first: an include from core/ up to train/ must be refused."""
import os
import re
import sys

LAYERS = ["core", "math", "precision", "data", "backend", "comm", "nn", "optim", "pipeline", "parallel",
          "models", "checkpoint", "train", "plan", "testing"]
INCLUDE = re.compile(r'#include\s+[<"]llmpar/([a-z_]+)/')


def violations(files):
    """files: (path relative to include/llmpar, text) pairs -> list of messages."""
    bad = []
    for path, text in files:
        if "/" not in path:
            continue  # the umbrella header and config.hpp sit above every folder
        folder = path.split("/")[0]
        if folder not in LAYERS:
            bad.append(f"{path}: folder '{folder}' is not in LAYERS; place it in the order")
            continue
        for n, line in enumerate(text.splitlines(), 1):
            m = INCLUDE.search(line)
            if m and m.group(1) != folder and m.group(1) in LAYERS and LAYERS.index(m.group(1)) > LAYERS.index(folder):
                bad.append(f"{path}:{n}: {folder}/ includes {m.group(1)}/, which is above it: {line.strip()}")
    return bad


def main():
    root = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "include", "llmpar")
    if not violations([("core/x.hpp", '#include "llmpar/train/trainer.hpp"\n')]):
        sys.exit("test_include_layers: the self-check accepted core/ including train/")
    files = []
    for dirpath, _, names in os.walk(root):
        for name in names:
            path = os.path.relpath(os.path.join(dirpath, name), root)
            with open(os.path.join(dirpath, name), encoding="utf-8") as f:
                files.append((path, f.read()))
    bad = violations(files)
    for b in bad:
        print("FAIL:", b)
    print(f"test_include_layers: {len(files)} headers, {len(bad)} includes that run back up")
    sys.exit(1 if bad else 0)


main()
