"""The ONNX RNN op (a plain recurrent layer: H_t = f(X_t·Wᵀ + H_{t-1}·Rᵀ + Wb + Rb)) as TE, one stage per time
step. Sequences are the static length of X; sequence_lens, when given, stops each batch row at its length
(its state stays, its outputs are zero past the end), as ONNX's reference does."""
from __future__ import annotations

from ..tvm_env import tvm
from .context import LowerContext

_tvm = tvm()
te, topi, tir = _tvm.te, _tvm.topi, _tvm.tirx

_ACTIVATIONS = {
    "tanh": lambda v: tir.tanh(v),
    "relu": lambda v: tir.max(v, tir.const(0, v.dtype)),
    "sigmoid": lambda v: tir.const(1, v.dtype) / (tir.const(1, v.dtype) + tir.exp(-v)),
}


def _rnn(ctx: LowerContext):
    x, w, r, bias, initial = ctx.input(0), ctx.input(1), ctx.input(2), ctx.input(3), ctx.input(5)
    layout = ctx.attr("layout", 0)
    if layout:
        x = topi.transpose(x, [1, 0, 2])
        initial = topi.transpose(initial, [1, 0, 2]) if initial is not None else None
    steps, batch, inputs = (int(d) for d in x.shape)
    directions, hidden = int(w.shape[0]), int(w.shape[1])
    lengths = ctx.data(4)
    names = [a.lower() for a in (ctx.attr("activations") or ["Tanh"] * directions)]
    if any(n not in _ACTIVATIONS for n in names) or ctx.attr("clip") is not None:
        raise ctx.fail(f"activations {names} or clip are not supported (Tanh, Relu, Sigmoid are)")
    reverse = ctx.attr("direction", "forward") == "reverse"
    dtype = x.dtype
    zero = tir.const(0, dtype)
    outputs, finals = [], []
    for d in range(directions):
        backwards = reverse or d == 1
        activation = _ACTIVATIONS[names[d]]
        state = (te.compute((batch, hidden), lambda b, j: initial[d, b, j], name=f"h0_{d}") if initial is not None
                 else te.compute((batch, hidden), lambda b, j: zero, name=f"h0_{d}"))
        per_step = [None] * steps
        for step in range(steps):
            t = steps - 1 - step if backwards else step
            state = _step(x, w, r, bias, lengths, state, activation, d, t, hidden)
            per_step[t] = state
        outputs.append(per_step)
        finals.append(state)

    def y(t, d, b, j):
        value = outputs[0][0][b, j]
        for dd in range(directions):
            for tt in range(steps):
                value = tir.Select(tir.all(t == tt, d == dd), outputs[dd][tt][b, j], value)
        if lengths is not None:
            value = tir.Select(t < _length(lengths, b), value, zero)
        return value

    results = [te.compute((steps, directions, batch, hidden), y, name="rnn_y"),
               te.compute((directions, batch, hidden), lambda d, b, j: _pick(finals, d, b, j), name="rnn_y_h")]
    if layout:
        results = [topi.transpose(results[0], [2, 0, 1, 3]), topi.transpose(results[1], [1, 0, 2])]
    return [result if ctx.output_types[i] is not None else None for i, result in enumerate(results)][:len(ctx.output_types)]


def _step(x, w, r, bias, lengths, state, activation, d: int, t: int, hidden: int):
    """The state after time step t of direction d."""
    batch, inputs = int(x.shape[1]), int(x.shape[2])
    k = te.reduce_axis((0, inputs), name=f"k{d}_{t}")
    m = te.reduce_axis((0, hidden), name=f"m{d}_{t}")
    projected = te.compute((batch, hidden), lambda b, j: te.sum(x[t, b, k] * w[d, j, k], axis=k), name=f"rnn_x_{d}_{t}")
    recurrent = te.compute((batch, hidden), lambda b, j: te.sum(state[b, m] * r[d, j, m], axis=m), name=f"rnn_r_{d}_{t}")

    def update(b, j):
        value = projected[b, j] + recurrent[b, j]
        if bias is not None:
            value = value + bias[d, j] + bias[d, hidden + j]
        value = activation(value)
        if lengths is None:
            return value
        return tir.Select(t < _length(lengths, b), value, state[b, j])

    return te.compute((batch, hidden), update, name=f"rnn_h_{d}_{t}")


def _length(lengths, b):
    value = tir.const(int(lengths.reshape(-1)[0]), "int32")
    for row, length in enumerate(lengths.reshape(-1)):
        value = tir.Select(b == row, tir.const(int(length), "int32"), value)
    return value


def _pick(finals, d, b, j):
    value = finals[0][b, j]
    for index in range(1, len(finals)):
        value = tir.Select(d == index, finals[index][b, j], value)
    return value


RULES = {"RNN": _rnn}
STATIC_INPUTS = {"RNN": {4}}
