"""The remapper's driver: visit the graph from its roots and apply the first pattern that
fits at each node; log every fusion made or refused.

With ``NUMBAFUSE_LOG=remap`` the log lines are also printed to stderr; they always go to the
``numbafuse.fusion`` logger.
"""
from __future__ import annotations

import dataclasses
import logging
import os
import sys

from .ir import Graph
from .patterns import PATTERNS, Matcher, Refusal, Rewrite

LOG_ENV = "NUMBAFUSE_LOG"      # NUMBAFUSE_LOG=remap prints the remap log to stderr
LOG_TOPIC = "remap"
logger = logging.getLogger("numbafuse.fusion")


def remap(graph: Graph) -> Graph:
    """Rewrite the fusable chains of ``graph`` into fused ops; a new Graph (``graph`` untouched).

    Nodes are visited from the roots back (reverse topological order, as Grappler does); at
    each node not yet fused, the patterns ending there are tried longest first. A pattern whose
    ops match but whose conditions fail is *refused* with its reason, and the next pattern is
    tried. ``Graph.log`` of the result has one line per fusion made or refused; with
    ``NUMBAFUSE_LOG=remap`` the lines are also printed to stderr.

    Examples
    --------
    >>> import numpy as np, numbafuse as nf
    >>> w, b = np.ones((2, 1, 3, 3)), np.zeros(2)
    >>> def f(x):
    ...     return nf.relu(nf.bias_add(nf.conv2d(x, w, padding=1), b))
    >>> g = nf.remap(nf.trace(f, np.ones((1, 1, 4, 4))))
    >>> g.ops
    ['conv_bias_relu']
    """
    m = Matcher(graph)
    replaced = {}                  # root node -> Rewrite
    events = []                    # Rewrite or Refusal, in the order decided
    for root in reversed(graph.nodes):
        if root in m.fused:
            continue
        for pattern in PATTERNS.get(root.op, ()):
            result = pattern(m, root)
            if result is None or _already_refused(result, events):
                continue
            events.append(result)
            if isinstance(result, Rewrite):
                replaced[root] = result
                m.fused.update(result.old)
                break
    nodes, folds = [], []
    for node in graph.nodes:
        if node in replaced:
            nodes.extend(replaced[node].new)
            folds.extend(replaced[node].folds)
        elif node not in m.fused:
            nodes.append(dataclasses.replace(node))
    old_names = {n: n.name for n in graph.nodes}
    new_graph = Graph(graph.inputs, nodes, graph.outputs, single_output=graph.single_output,
                      folds=folds, recording=graph.recording)
    new_graph.log = [_describe(e, old_names) for e in events]
    if LOG_TOPIC in os.environ.get(LOG_ENV, "").split(","):
        for line in new_graph.log:
            print(f"numbafuse.remap: {line}", file=sys.stderr)
    for line in new_graph.log:
        logger.info(line)
    return new_graph


def _already_refused(result, events):
    """A refusal already logged for a longer chain, with the same reason (say it once)."""
    return isinstance(result, Refusal) and any(
        isinstance(e, Refusal) and e.reason == result.reason and set(result.chain) <= set(e.chain)
        for e in events)


def _describe(event, old_names):
    if isinstance(event, Refusal):
        return (f"refused {'->'.join(n.op for n in event.chain)}: {event.reason} "
                f"[nodes {', '.join(old_names[n] for n in event.chain)}]")
    return (f"{event.title}: {', '.join(old_names[n] for n in event.old)} -> "
            f"{', '.join(n.name for n in event.new)}")
