"""One node of the testbed's ``load`` scenario: load a Hugging Face-style model directory as a framework does.

    python benchmarks/_load_reader.py EXPECTED_JSON MODEL_DIR [--evict]

Started by ``benchmarks/_load.py``, one process per reading node, with
MODEL_DIR under that node's mountpoint.  Imports numpy and safetensors
(with ``--evict``, untimed: drops the kernel's page cache of every file in
MODEL_DIR, so a second load asks the filesystem again rather than the pages
the first one left), prints ``{"ready": true}`` and waits for a line on
stdin; then, timed:
reads ``config.json``, ``tokenizer.json``, ``tokenizer_config.json`` and
``model.safetensors.index.json`` (json.load, as transformers does), and
opens every shard the index names, in name order (transformers'), with
``safetensors.safe_open(path, framework="np")`` (it maps the file and reads
the header through the mapping) and takes every tensor (``get_tensor``
copies it out of the mapping) into a checksum.  After the clock stops the
checksums and the json files' sha256 are compared with EXPECTED_JSON (what
was uploaded); one JSON line on stdout answers:

    {"start", "end", "first_byte_s", "tensors", "bytes", "wrong": [names...]}

``start``/``end`` are ``time.monotonic()`` (one clock for every process on
the host).  ``first_byte_s``: from the call that opens the first shard until
it returned, i.e. until the first read of the file (its header) came back.
Any error prints a traceback to stderr and exits non-zero.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time

import numpy as np
from safetensors import safe_open

JSON_FILES = ("config.json", "tokenizer.json", "tokenizer_config.json", "model.safetensors.index.json")
INDEX = "model.safetensors.index.json"
PAGE_BYTES = 4096


def checksum(arr: np.ndarray) -> list[int]:
    """[sum of the elements as unsigned ints, sum of each 4 KiB page's first element times its page number].

    Touches every byte (the first term) at memory speed; the second term
    also catches pages read in the wrong order.  A checksum, not a hash.
    """
    flat = arr.reshape(-1).view(f"u{arr.itemsize}")
    pages = flat[:: max(1, PAGE_BYTES // arr.itemsize)].astype(np.uint64)
    return [int(flat.sum(dtype=np.uint64)), int((pages * np.arange(len(pages), dtype=np.uint64)).sum(dtype=np.uint64))]


def load(model_dir: str) -> tuple[dict, dict[str, bytes], float, int]:
    """Read the json files and every tensor of every shard; (tensor -> checksum, json bytes, first-byte s, bytes)."""
    texts = {}
    for name in JSON_FILES:
        with open(os.path.join(model_dir, name), "rb") as f:
            texts[name] = f.read()
        json.loads(texts[name])
    weight_map = json.loads(texts[INDEX])["weight_map"]
    sums, first_byte_s, total = {}, None, 0
    for shard in sorted(set(weight_map.values())):  # as transformers does: model-00001-of-0000M first
        t0 = time.monotonic()
        with safe_open(os.path.join(model_dir, shard), framework="np") as f:
            if first_byte_s is None:
                first_byte_s = time.monotonic() - t0
            for name in f.keys():
                arr = f.get_tensor(name)
                sums[name] = checksum(arr)
                total += arr.nbytes
    return sums, texts, first_byte_s or 0.0, total


def evict(model_dir: str) -> None:
    """posix_fadvise(DONTNEED) on every file: the kernel forgets their cached pages (nothing is read)."""
    for name in sorted(os.listdir(model_dir)):
        fd = os.open(os.path.join(model_dir, name), os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def main() -> int:
    expected_path, model_dir = sys.argv[1:3]
    with open(expected_path) as f:
        expected = json.load(f)
    if "--evict" in sys.argv[3:]:
        evict(model_dir)
    print(json.dumps({"ready": True}), flush=True)
    sys.stdin.readline()
    start = time.monotonic()
    sums, texts, first_byte_s, total = load(model_dir)
    end = time.monotonic()
    wrong = sorted(n for n, s in expected["tensors"].items() if sums.get(n) != s)
    wrong += sorted(n for n in sums if n not in expected["tensors"])
    wrong += [n for n, digest in expected["json_sha256"].items() if hashlib.sha256(texts[n]).hexdigest() != digest]
    print(json.dumps({"start": start, "end": end, "first_byte_s": first_byte_s, "tensors": len(sums), "bytes": total,
                      "wrong": wrong}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
