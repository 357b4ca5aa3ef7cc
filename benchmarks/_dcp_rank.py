"""One rank of the testbed's DCP scenario: PyTorch DCP save and load through this node's mount.

    nsenter --net=/run/netns/<node ns> python benchmarks/_dcp_rank.py RANK WORLD MASTER_IP PORT SIZE_BYTES SHARD_BYTES

Started by ``benchmarks/_dcp.py``, one per node namespace, so the gloo
process group runs over the shaped fabric network.  Every rank builds the
same DP-replicated model and Adam state (seeded, bitwise identical on every
rank) plus, when SHARD_BYTES > 0, a tensor of its own, from the seed of each
command: every save gets fresh bytes, or chunks an earlier save left in the
pools or the bucket would be deduplicated against and flatter the later one.
Commands come one JSON object a line on stdin; each is answered with one
JSON line on stdout (stderr carries torch's own messages):

    {"op": "save", "dir": D, "seed": S, "dedup": true|false}  -> {"rank", "op", "start", "end"}
    {"op": "load", "dir": D, "seed": S}                        -> {"rank", "op", "start", "end", "tensors"}
    {"op": "exit"}

Times are ``time.monotonic()`` (one clock for every process on the host), so
the caller takes the slowest rank as ``max(end) - min(start)``.  Each command
starts after a barrier.  A load goes into a fresh, differently seeded state
and is compared tensor by tensor with the saved one; a difference is an
error.  Any error prints a traceback to stderr and exits non-zero: the other
ranks then hang in a collective and the caller kills them all.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import sys
import time

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultSavePlanner

LAYERS = 4  # Linear layers of the model; their width follows from the requested size
FRESH_SEED_OFFSET = 7919  # the state a load overwrites: other values, same shapes
PG_TIMEOUT_S = 900.0  # gloo collectives wait this long (a save waits for the slowest writer's close)


class NoDedupSavePlanner(DefaultSavePlanner):
    """Every rank writes every item of its state dict, the replicated ones included.

    ``DefaultSavePlanner`` removes replicated items from all plans but one
    (``dedup_save_plans``), and its global-plan builder refuses duplicates,
    so this planner builds the metadata from the deduplicated plans (each
    item is found in one file) and hands every rank back its full local plan.
    Every copy is byte-identical, so whichever file the metadata names holds
    the right bytes.
    """

    def create_global_plan(self, all_plans):
        deduped, metadata = super().create_global_plan(all_plans)
        full = [dataclasses.replace(d, items=list(p.items)) for d, p in zip(deduped, all_plans)]
        self.global_plan = full
        return full, metadata


def model_width(size_bytes: int) -> int:
    """Width of LAYERS square Linear layers whose float32 weights + Adam's two moments are ~size_bytes."""
    return max(8, int((size_bytes / (3 * 4 * LAYERS)) ** 0.5))


def build_state(size_bytes: int, shard_bytes: int, rank: int, seed: int) -> dict:
    """Model + Adam state (one step taken) from ``seed``; plus this rank's own tensor."""
    gen = torch.Generator().manual_seed(seed)
    width = model_width(size_bytes)
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(LAYERS)])
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen))
            p.grad = torch.randn(p.shape, generator=gen)  # elementwise Adam: bitwise the same on every rank
    optim = torch.optim.Adam(model.parameters(), lr=1e-3)
    optim.step()
    state = {"model": model.state_dict(), "optim": optim.state_dict()}
    if shard_bytes > 0:  # last in the dict: the replicated items keep the same file offsets on every rank
        own = torch.Generator().manual_seed(seed * 1000 + rank + 1)
        state[f"rank{rank}"] = torch.randn(shard_bytes // 4, generator=own)
    return state


def tensors(state, prefix: str = ""):
    """(name, tensor) of every tensor in a nested state dict."""
    items = state.items() if isinstance(state, dict) else enumerate(state) if isinstance(state, list) else ()
    for k, v in items:
        name = f"{prefix}{k}"
        if isinstance(v, torch.Tensor):
            yield name, v
        else:
            yield from tensors(v, name + ".")


def verify(loaded: dict, want: dict) -> int:
    """Number of tensors compared; raises naming the first tensor that differs."""
    got, expected = dict(tensors(loaded)), dict(tensors(want))
    if got.keys() != expected.keys():
        raise RuntimeError(f"loaded tensors {sorted(got.keys() ^ expected.keys())[:5]} differ in name from the saved ones")
    for name, t in expected.items():
        if not torch.equal(got[name], t):
            raise RuntimeError(f"tensor {name} loaded from the checkpoint differs from the one saved")
    return len(expected)


def reply(**fields) -> None:
    sys.stdout.write(json.dumps(fields) + "\n")
    sys.stdout.flush()


def main(argv: list[str]) -> int:
    rank, world, master, port, size_bytes, shard_bytes = argv[0], argv[1], argv[2], argv[3], argv[4], argv[5]
    rank, world, size_bytes, shard_bytes = int(rank), int(world), int(size_bytes), int(shard_bytes)
    torch.set_num_threads(1)  # two cores shared by every rank and daemon of the testbed
    dist.init_process_group("gloo", init_method=f"tcp://{master}:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=PG_TIMEOUT_S))
    reply(rank=rank, op="ready")
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["op"] == "exit":
            break
        state = build_state(size_bytes, shard_bytes, rank, cmd["seed"])
        dist.barrier()
        if cmd["op"] == "save":
            planner = DefaultSavePlanner() if cmd["dedup"] else NoDedupSavePlanner()
            start = time.monotonic()
            dcp.save(state, checkpoint_id=cmd["dir"], planner=planner)
            reply(rank=rank, op="save", start=start, end=time.monotonic())
        elif cmd["op"] == "load":
            fresh = build_state(size_bytes, shard_bytes, rank, cmd["seed"] + FRESH_SEED_OFFSET)
            start = time.monotonic()
            dcp.load(fresh, checkpoint_id=cmd["dir"])
            end = time.monotonic()
            reply(rank=rank, op="load", start=start, end=end, tensors=verify(fresh, state))
        else:
            raise ValueError(f"unknown command {cmd!r}")
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
