#!/usr/bin/env python3
"""Copies a checkpoint directory and damages it in one named way, for the importer's bad-input tests.

usage: mutate_checkpoint.py SRC DST MUTATION [ARGS...]
  copy                              an unchanged copy
  remove-file FILE                  delete a file (a shard, the index, config.json)
  truncate FILE BYTES               cut FILE to its first BYTES bytes
  offset-past-end TENSOR            move TENSOR's data_offsets past the end of its shard
  reshape TENSOR D0,D1,...          give TENSOR another shape with the same number of elements
  retype TENSOR DTYPE D0,D1,...     relabel TENSOR's bytes as another dtype and shape (same byte size)
  drop-tensor TENSOR                remove TENSOR from its shard header and from the index
  set-config KEY JSON               set a (dotted) config.json field, e.g. model_type '"llama"'
  delete-config KEY                 remove a (dotted) config.json field
  write FILE TEXT                   replace FILE's content with TEXT
"""
import json
import os
import shutil
import struct
import sys


def read_shard(path):
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
        data = f.read()
    return header, data


def write_shard(path, header, data):
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        f.write(data)


def shard_of(dst, tensor):
    with open(os.path.join(dst, "model.safetensors.index.json")) as f:
        return os.path.join(dst, json.load(f)["weight_map"][tensor])


def edit_config(dst, key, value=None, delete=False):
    path = os.path.join(dst, "config.json")
    with open(path) as f:
        config = json.load(f)
    *parents, last = key.split(".")
    node = config
    for part in parents:
        node = node.setdefault(part, {})
    if delete:
        node.pop(last, None)
    else:
        node[last] = value
    with open(path, "w") as f:
        json.dump(config, f, indent=2)


def main(argv):
    src, dst, mutation, *args = argv
    if os.path.exists(dst):
        shutil.rmtree(dst)
    shutil.copytree(src, dst)
    if mutation == "copy":
        return
    if mutation == "remove-file":
        os.remove(os.path.join(dst, args[0]))
    elif mutation == "truncate":
        with open(os.path.join(dst, args[0]), "r+b") as f:
            f.truncate(int(args[1]))
    elif mutation == "offset-past-end":
        path = shard_of(dst, args[0])
        header, data = read_shard(path)
        begin, end = header[args[0]]["data_offsets"]
        header[args[0]]["data_offsets"] = [len(data) - (end - begin) + 64, len(data) + 64]
        write_shard(path, header, data)
    elif mutation == "reshape":
        path = shard_of(dst, args[0])
        header, data = read_shard(path)
        header[args[0]]["shape"] = [int(d) for d in args[1].split(",")]
        write_shard(path, header, data)
    elif mutation == "retype":
        path = shard_of(dst, args[0])
        header, data = read_shard(path)
        header[args[0]]["dtype"] = args[1]
        header[args[0]]["shape"] = [int(d) for d in args[2].split(",")]
        write_shard(path, header, data)
    elif mutation == "drop-tensor":
        path = shard_of(dst, args[0])
        header, data = read_shard(path)
        del header[args[0]]
        write_shard(path, header, data)
        index_path = os.path.join(dst, "model.safetensors.index.json")
        with open(index_path) as f:
            index = json.load(f)
        del index["weight_map"][args[0]]
        with open(index_path, "w") as f:
            json.dump(index, f, indent=2)
    elif mutation == "set-config":
        edit_config(dst, args[0], json.loads(args[1]))
    elif mutation == "delete-config":
        edit_config(dst, args[0], delete=True)
    elif mutation == "write":
        with open(os.path.join(dst, args[0]), "w") as f:
            f.write(args[1])
    else:
        sys.exit(f"unknown mutation {mutation}")


if __name__ == "__main__":
    main(sys.argv[1:])
