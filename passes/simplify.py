"""Simplification: local rewrites that remove or merge nodes exporters leave behind.

Each rewrite looks at one node and either rewrites it (returning the name of
what it did, counted in the pass's stats) or returns None. The pass runs the
rewrites to a fixed point; nodes a rewrite leaves unread go to DCE.
"""
from __future__ import annotations

from typing import Callable

from tessel.ir.graph import Graph, Node

from .base import Pass, PassResult, can_replace, graphs_in, retire
from .constant_fold import fold_weight
from .fold_batchnorm import fold_batchnorm
from .linear import matmul_add_to_gemm
from .layout import collapse_transposes, collapse_views, sink_views, split_to_slices
from .recognize import recognize_gelu, recognize_layer_norm
from .unroll_rnn import unroll_rnn

MAX_ROUNDS = 8

Rewrite = Callable[[Node], "str | None"]


def remove_identity(node: Node) -> str | None:
    """Identity, and Dropout in inference mode, pass their input through."""
    if node.op_type == "Dropout":
        training = node.inputs[2] if len(node.inputs) > 2 else None
        mask = node.outputs[1] if len(node.outputs) > 1 else None
        if training is not None and not (training.is_constant and not training.const.any()):
            return None
        if mask is not None and (mask.uses or mask.is_graph_output):
            return None
    elif node.op_type != "Identity":
        return None
    source, out = node.inputs[0], node.outputs[0]
    if not can_replace(out, source):
        return None
    retire(node, {0: source})
    return f"{node.op_type.lower()}_removed"


def unroll_peephole_lstm(node: Node) -> str | None:
    """An LSTM with peephole weights (input P) becomes its unrolled primitive ops: the LSTM kernel has no
    peephole terms, and the unrolled form is the one training already differentiates."""
    if node.op_type != "LSTM" or len(node.inputs) < 8 or node.inputs[7] is None:
        return None
    unroll_rnn(node.graph, node)
    return "peephole_lstm_unrolled"


# Weights computed from constants are folded first: the rewrites after it (BatchNorm folding) need them constant.
REWRITES: tuple[Rewrite, ...] = (
    fold_weight, remove_identity, unroll_peephole_lstm, collapse_views, collapse_transposes, fold_batchnorm, matmul_add_to_gemm,
    recognize_gelu, recognize_layer_norm, sink_views, split_to_slices,
)


def simplify(graph: Graph, rewrites: tuple[Rewrite, ...] = REWRITES) -> PassResult:
    """Apply the rewrites to every node until none fires; returns how often each fired."""
    stats: dict[str, int] = {}
    for _ in range(MAX_ROUNDS):
        fired = False
        for g in graphs_in(graph):
            alive = set(map(id, g.nodes))
            for node in list(g.nodes):
                if id(node) not in alive:
                    continue
                for rewrite in rewrites:
                    what = rewrite(node)
                    if what is not None:
                        stats[what] = stats.get(what, 0) + 1
                        fired = True
                        alive = set(map(id, g.nodes))
                        break
        if not fired:
            break
    return PassResult(graph, bool(stats), stats)


SIMPLIFY = Pass("simplify", simplify)
