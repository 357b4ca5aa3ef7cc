"""The canonical form of a round: chunks grouped by holder set, and its cache key.

Chunks with the same holder set ("class": e.g. the shards one DP group wrote)
are interchangeable except for their size, so the LP and the rounding work
per class.  The canonical order sorts chunks by holder set, then by size
(largest first); two rounds with the same multiset of (size, holders) have
the same canonical form and the same ``key``, whatever order the caller
listed the chunks in: that is what the plan cache keys on.
"""

import hashlib
from dataclasses import dataclass

import numpy as np

from ._types import PlanInput


@dataclass(frozen=True, eq=False)
class Pattern:
    order: np.ndarray  # (C,) caller index of canonical chunk k
    sizes: np.ndarray  # (C,) int64, canonical order
    cls: np.ndarray  # (C,) class of canonical chunk k
    class_start: np.ndarray  # (K+1,) canonical chunks of class k are class_start[k]:class_start[k+1]
    class_holders: np.ndarray  # (K, N) bool
    class_bytes: np.ndarray  # (K,) float64
    class_hcount: np.ndarray  # (K,) int64 holders per class
    key: bytes  # hash of the pattern, the node bandwidths and replicas (not DRAM)

    @property
    def classes(self) -> int:
        return self.class_bytes.shape[0]


def _holder_words(holders: np.ndarray) -> np.ndarray:
    """Each row's holder bitmap as uint64 words, (C, W)."""
    c, n = holders.shape
    packed = np.packbits(holders, axis=1)
    width = -(-packed.shape[1] // 8) * 8
    if width != packed.shape[1]:
        packed = np.concatenate([packed, np.zeros((c, width - packed.shape[1]), np.uint8)], axis=1)
    return np.ascontiguousarray(packed).view(">u8")  # big-endian: word order = node order


def pattern_of(inp: PlanInput) -> Pattern:
    sizes = inp.chunk_bytes
    words = _holder_words(inp.holders)
    # np.lexsort: the last key is the primary one.
    keys = [-sizes] + [words[:, w] for w in range(words.shape[1] - 1, -1, -1)]
    order = np.lexsort(keys)
    s_sizes = sizes[order]
    s_words = words[order]
    if len(order):
        new_class = np.ones(len(order), dtype=bool)
        new_class[1:] = np.any(s_words[1:] != s_words[:-1], axis=1)
        firsts = np.flatnonzero(new_class)
    else:
        new_class = np.zeros(0, dtype=bool)
        firsts = np.zeros(0, dtype=np.int64)
    cls = np.cumsum(new_class) - 1
    class_start = np.append(firsts, len(order)).astype(np.int64)
    class_holders = inp.holders[order[firsts]] if len(firsts) else np.zeros((0, inp.nodes), bool)
    class_bytes = np.add.reduceat(s_sizes.astype(np.float64), firsts) if len(firsts) else np.zeros(0)
    h = hashlib.blake2b(digest_size=16)
    h.update(np.array([inp.nodes, inp.replicas, len(order)], np.int64).tobytes())
    for arr in (inp.send_bw, inp.recv_bw, inp.snic_bw, np.array([inp.backend_bw])):
        h.update(np.ascontiguousarray(arr, np.float64).tobytes())
    h.update(np.ascontiguousarray(s_words).tobytes())
    h.update(np.ascontiguousarray(s_sizes).tobytes())
    return Pattern(
        order=order,
        sizes=s_sizes,
        cls=cls,
        class_start=class_start,
        class_holders=class_holders,
        class_bytes=class_bytes,
        class_hcount=class_holders.sum(axis=1).astype(np.int64),
        key=h.digest(),
    )
