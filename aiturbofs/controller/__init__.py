"""The control plane: membership, group rounds and their plans (docs/design.md, "Grouped I/O").

* ``RoundKeeper`` (``_rounds``): a group's rounds of file reports -> dedup
  (by full BLAKE3 hash, across files and against durable chunks) -> plan ->
  each file's share of the plan;
* ``ControllerServer`` / ``run_controller`` (``_server``): the cluster
  controller (``aiturbo controller``) on the fabric: join, heartbeat, dead
  node detection, rounds;
* ``EmbeddedController`` (``_embedded``): what a single-node daemon embeds.

This package imports fabric, messages, planner, meta, chunk, ``_limits``
and ``_errors``; never vfs, cluster, staging or node: the VFS reaches it
through the node's messages (``aiturbofs.messages``).
"""

import importlib

from ._embedded import EmbeddedController as EmbeddedController

# Loaded on first use: the planner brings cvxpy (over a second to import), and
# a single-node daemon that never plans a round should not wait for it.
_LAZY = {"RoundKeeper": "._rounds", "parse_report": "._rounds",
         "ControllerServer": "._server", "run_controller": "._server"}


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name], __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
