#!/usr/bin/env python3
"""Checks that imported hybrid IR (stdin) references every tensor of a checkpoint exactly once.

usage: hybrid-compile DIR --emit=mlir | check_tensor_references.py DIR
Tensors of layers past num_hidden_layers (multi-token prediction) may stay unreferenced.
"""
import collections
import json
import os
import re
import sys


def main():
    ckpt = sys.argv[1]
    with open(os.path.join(ckpt, "model.safetensors.index.json")) as f:
        tensors = set(json.load(f)["weight_map"])
    with open(os.path.join(ckpt, "config.json")) as f:
        num_layers = json.load(f)["num_hidden_layers"]
    ir = sys.stdin.read()
    # #hybrid.weight<"NAME" : type> and its optional `scale "NAME"`.
    names = re.findall(r'#hybrid\.weight<"([^"]+)"', ir) + re.findall(r'scale "([^"]+)"', ir)
    counts = collections.Counter(names)
    problems = []
    for name, count in sorted(counts.items()):
        if count != 1:
            problems.append(f"{name}: referenced {count} times")
        if name not in tensors:
            problems.append(f"{name}: not in the checkpoint")
    for name in sorted(tensors - set(counts)):
        m = re.match(r"model\.layers\.(\d+)\.", name)
        if m and int(m.group(1)) >= num_layers:
            continue
        problems.append(f"{name}: never referenced")
    if problems:
        print("\n".join(problems))
        sys.exit(1)
    print(f"all {len(tensors)} tensors referenced exactly once")


if __name__ == "__main__":
    main()
