"""LSTM and GRU unrolled through time into primitive ops, so generic gradient rules differentiate them.

Follows the ONNX definitions (gate order iofc for LSTM, zrh for GRU; W and R per
direction; B = [Wb, Rb]; linear_before_reset; directions forward, reverse and
bidirectional; optional initial_h, initial_c and LSTM peepholes P; outputs Y,
Y_h, Y_c in layout 0). Per direction the input projection of every time step is
one MatMul; each step then adds the recurrent product and applies the gates.
"""
from __future__ import annotations

import functools
from typing import Callable

from tessel.ir.errors import ModelImportError
from tessel.ir.graph import Graph, Node, Value

from .base import retire
from .emitter import Emitter

_DEFAULT_ACTIVATIONS = {"LSTM": ["sigmoid", "tanh", "tanh"], "GRU": ["sigmoid", "tanh"]}


def unroll_rnn(graph: Graph, node: Node) -> None:
    """Replace an LSTM or GRU node by the equivalent unrolled primitive ops."""
    _check_supported(node)
    inputs = list(node.inputs) + [None] * (8 - len(node.inputs))
    x = inputs[0]
    steps, batch, _ = x.type.shape
    hidden = node.attrs["hidden_size"]
    direction = node.attrs["direction"]
    dirs = 2 if direction == "bidirectional" else 1
    em = Emitter(graph, node, node.name)

    def per_dir(value: Value | None, shape: list[int]) -> list[Value | None]:
        """The value's part for each direction (axis 0), reshaped to `shape`."""
        if value is None:
            return [None] * dirs
        return [em.reshape(part, shape) for part in em.split(value, 0, [1] * dirs)]

    gates = 4 if node.op_type == "LSTM" else 3
    weights = per_dir(inputs[1], [gates * hidden, x.type.shape[2]])
    recurrent = per_dir(inputs[2], [gates * hidden, hidden])
    biases = per_dir(inputs[3], [2 * gates * hidden])
    initial_h = per_dir(inputs[5], [batch, hidden])
    initial_c = per_dir(inputs[6], [batch, hidden]) if node.op_type == "LSTM" else [None] * dirs
    peepholes = per_dir(inputs[7], [3 * hidden]) if node.op_type == "LSTM" else [None] * dirs
    flat_x = em.reshape(x, [steps * batch, x.type.shape[2]])
    step = _lstm_step if node.op_type == "LSTM" else _gru_step(node.attrs["linear_before_reset"])
    outputs: list[tuple[list[Value], Value, Value | None]] = []
    for d in range(dirs):
        reverse = direction == "reverse" or d == 1
        w_bias, r_bias = em.split(biases[d], 0, [gates * hidden] * 2) if biases[d] is not None else (None, None)
        if node.op_type == "LSTM" and w_bias is not None:
            w_bias, r_bias = em.op("Add", w_bias, r_bias), None
        projected = em.op("MatMul", flat_x, em.op("Transpose", weights[d], perm=[1, 0]))
        if w_bias is not None:
            projected = em.op("Add", projected, w_bias)
        projected = em.split(em.reshape(projected, [steps, batch * gates * hidden]), 0, [1] * steps)
        cell = _Cell(em, hidden, em.op("Transpose", recurrent[d], perm=[1, 0]), r_bias, peepholes[d])
        h, c = initial_h[d], initial_c[d]
        hs: list[Value | None] = [None] * steps
        for t in (reversed(range(steps)) if reverse else range(steps)):
            h, c = step(cell, em.reshape(projected[t], [batch, gates * hidden]), h, c)
            hs[t] = h
        outputs.append((hs, h, c))
    wanted = [i for i, v in enumerate(node.outputs) if v is not None and (v.uses or v.is_graph_output)]
    replacements = {}
    if 0 in wanted:
        y = [em.concat([em.reshape(h, [1, 1, batch, hidden]) for h in hs], 0) for hs, _, _ in outputs]
        replacements[0] = em.concat(y, 1)
    if 1 in wanted:
        replacements[1] = em.concat([em.reshape(h, [1, batch, hidden]) for _, h, _ in outputs], 0)
    if 2 in wanted:
        replacements[2] = em.concat([em.reshape(c, [1, batch, hidden]) for _, _, c in outputs], 0)
    retire(node, replacements)


class _Cell:
    """One direction's recurrent weights (transposed), recurrent bias and peepholes."""

    def __init__(self, em: Emitter, hidden: int, recurrent_t: Value, bias: Value | None, peepholes: Value | None):
        self.em = em
        self.hidden = hidden
        self.recurrent_t = recurrent_t
        self.bias = bias
        self.peepholes = em.split(peepholes, 0, [hidden] * 3) if peepholes is not None else None

    @functools.cached_property
    def recurrent_parts(self) -> list[Value]:
        """The transposed GRU recurrent weights cut into the update/reset gates' and the candidate's."""
        return self.em.split(self.recurrent_t, 1, [2 * self.hidden, self.hidden])

    @functools.cached_property
    def bias_parts(self) -> list[Value | None]:
        """The recurrent bias cut per GRU gate (z, r, h)."""
        return self.em.split(self.bias, 0, [self.hidden] * 3) if self.bias is not None else [None] * 3


def _lstm_step(cell: _Cell, projected: Value, h: Value | None, c: Value | None) -> tuple[Value, Value]:
    """h, c after one LSTM step from the step's input projection (biases included)."""
    em = cell.em
    gates = projected if h is None else em.op("Add", projected, em.op("MatMul", h, cell.recurrent_t))
    i, o, f, g = em.split(gates, 1, [cell.hidden] * 4)
    if cell.peepholes is not None and c is not None:
        p_i, p_o, p_f = cell.peepholes
        i = em.op("Add", i, em.op("Mul", p_i, c))
        f = em.op("Add", f, em.op("Mul", p_f, c))
    new_c = em.op("Mul", em.op("Sigmoid", i), em.op("Tanh", g))
    if c is not None:
        new_c = em.op("Add", em.op("Mul", em.op("Sigmoid", f), c), new_c)
    if cell.peepholes is not None:
        o = em.op("Add", o, em.op("Mul", cell.peepholes[1], new_c))
    return em.op("Mul", em.op("Sigmoid", o), em.op("Tanh", new_c)), new_c


def _gru_step(linear_before_reset: int) -> Callable[[_Cell, Value, Value | None, None], tuple[Value, None]]:
    def step(cell: _Cell, projected: Value, h: Value | None, _c: None) -> tuple[Value, None]:
        """h after one GRU step from the step's input projection (input bias included)."""
        em, size = cell.em, cell.hidden
        x_z, x_r, x_h = em.split(projected, 1, [size] * 3)
        b_z, b_r, b_h = cell.bias_parts
        if h is None:  # a zero state: the recurrent products vanish, their biases stay
            h_z, h_r, h_h = b_z, b_r, b_h
        elif linear_before_reset:
            h_z, h_r, h_h = em.split(_add(em, em.op("MatMul", h, cell.recurrent_t), cell.bias), 1, [size] * 3)
        else:
            h_z, h_r = em.split(em.op("MatMul", h, cell.recurrent_parts[0]), 1, [size] * 2)
            h_z, h_r = _add(em, h_z, b_z), _add(em, h_r, b_r)
        z = em.op("Sigmoid", _add(em, x_z, h_z))
        r = em.op("Sigmoid", _add(em, x_r, h_r))
        if linear_before_reset:
            recurrent = None if h_h is None else em.op("Mul", r, h_h)
        elif h is None:
            recurrent = b_h
        else:
            recurrent = _add(em, em.op("MatMul", em.op("Mul", r, h), cell.recurrent_parts[1]), b_h)
        candidate = em.op("Tanh", _add(em, x_h, recurrent))
        new_h = em.op("Mul", em.op("Sub", em.scalar(1.0, z), z), candidate)
        if h is not None:
            new_h = em.op("Add", new_h, em.op("Mul", z, h))
        return new_h, None

    return step


def _add(em: Emitter, a: Value, b: Value | None) -> Value:
    return a if b is None else em.op("Add", a, b)


def _check_supported(node: Node) -> None:
    """Raise ModelImportError naming the node when it uses a feature the unrolling does not model."""
    where = f"node '{node.name}' ({node.op_type})"
    if len(node.inputs) > 4 and node.inputs[4] is not None:
        raise ModelImportError(f"{where}: sequence_lens is not supported for training; export the model without it "
                               "(pad the sequences to one length)")
    activations = [a.lower() for a in node.attrs.get("activations") or []]
    default = _DEFAULT_ACTIVATIONS[node.op_type]
    if activations and activations not in (default, default * 2):
        raise ModelImportError(f"{where}: activations {node.attrs['activations']} are not supported for training; "
                               f"only the defaults ({', '.join(default)})")
    for attr in ("clip", "activation_alpha", "activation_beta"):
        if node.attrs.get(attr) is not None:
            raise ModelImportError(f"{where}: attribute '{attr}' is not supported for training")
    if node.attrs.get("layout", 0) != 0:
        raise ModelImportError(f"{where}: layout=1 is not supported for training; export with layout 0 (time first)")
    if node.attrs.get("input_forget", 0):
        raise ModelImportError(f"{where}: input_forget=1 is not supported for training")
