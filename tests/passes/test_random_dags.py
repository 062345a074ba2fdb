"""Random DAGs (hypothesis): simplify, folding, CSE, DCE and fusion never change a model's outputs.

Graphs mix elementwise, broadcast, injective, reduction, matmul and conv ops,
with repeated subexpressions, constant-only chains and values read several
times (diamonds), so every pass has something to do. The optimized graph is
checked twice: exported to ONNX (onnxruntime runs the fused functions), and
for a few graphs compiled to kernels and run by Tessel.
"""
from __future__ import annotations

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from onnx import helper

from tessel import ir
from tessel.compiler.api import compile
from tessel.compiler.pipeline import PIPELINE, run_pipeline
from tests.conftest import assert_matches_onnxruntime, run_onnxruntime
from tests.ir.helpers import F

from .helpers import assert_graph_matches, model

UNARY = ["Relu", "Sigmoid", "Tanh", "Neg", "Abs", "Identity"]
BINARY = ["Add", "Mul", "Sub", "Max"]


class _Builder:
    def __init__(self, draw):
        self.draw = draw
        self.nodes, self.inits = [], []
        self.values = [("x", (1, 4, 6, 6))]
        self.rng = np.random.default_rng(draw(st.integers(0, 2**31)))

    def const(self, shape):
        name = f"c{len(self.inits)}"
        self.inits.append((name, self.rng.standard_normal(shape).astype(np.float32)))
        return name

    def emit(self, op, inputs, shape, **attrs):
        name = f"v{len(self.nodes)}"
        self.nodes.append(helper.make_node(op, inputs, [name], **attrs))
        self.values.append((name, tuple(shape)))
        return name

    def pick(self, rank=None):
        choices = [v for v in self.values if rank is None or len(v[1]) == rank]
        return self.draw(st.sampled_from(choices or self.values))

    def step(self):
        kind = self.draw(st.sampled_from(["unary", "binary", "broadcast", "duplicate", "transpose", "reshape",
                                          "reduce", "softmax", "matmul", "conv", "const_chain"]))
        name, shape = self.pick()
        if kind == "unary":
            self.emit(self.draw(st.sampled_from(UNARY)), [name], shape)
        elif kind == "binary":
            same = [v for v, s in self.values if s == shape]
            self.emit(self.draw(st.sampled_from(BINARY)), [name, self.draw(st.sampled_from(same))], shape)
        elif kind == "broadcast":
            self.emit(self.draw(st.sampled_from(BINARY)), [name, self.const((shape[-1],))], shape)
        elif kind == "duplicate" and len(self.nodes) > 0:
            node = self.draw(st.sampled_from(self.nodes))
            copy = helper.make_node(node.op_type, list(node.input), [f"v{len(self.nodes)}"])
            copy.attribute.extend(node.attribute)
            source_shape = dict(self.values)[node.output[0]]
            self.nodes.append(copy)
            self.values.append((copy.output[0], source_shape))
        elif kind == "transpose":
            perm = self.draw(st.permutations(range(len(shape))))
            self.emit("Transpose", [name], [shape[p] for p in perm], perm=list(perm))
        elif kind == "reshape":
            total = int(np.prod(shape))
            new = (total // shape[-1], shape[-1]) if len(shape) > 2 else (1, total)
            self.emit("Reshape", [name, self._shape_const(new)], new)
        elif kind == "reduce":
            axes = self._int_const([-1])
            self.emit("ReduceMean", [name, axes], shape[:-1] + (1,), keepdims=1)
        elif kind == "softmax":
            self.emit("Softmax", [name], shape, axis=-1)
        elif kind == "matmul":
            width = self.draw(st.sampled_from([4, 16]))
            self.emit("MatMul", [name, self.const((shape[-1], width))], shape[:-1] + (width,))
        elif kind == "conv":
            name, shape = self.pick(rank=4)
            if len(shape) == 4:
                self.emit("Conv", [name, self.const((4, shape[1], 3, 3))], (shape[0], 4) + shape[2:], pads=[1, 1, 1, 1])
        elif kind == "const_chain":
            folded = self.emit("Mul", [self.const((shape[-1],)), self.const((shape[-1],))], (shape[-1],))
            self.emit("Add", [name, folded], shape)

    def _shape_const(self, shape):
        name = f"s{len(self.inits)}"
        self.inits.append((name, np.asarray(shape, np.int64)))
        return name

    def _int_const(self, values):
        return self._shape_const(values)

    def build(self):
        outputs = [self.values[-1]]
        extra = self.draw(st.sampled_from(self.values[1:]))
        if extra[0] != outputs[0][0]:
            outputs.append(extra)
        return model(self.nodes, [("x", F, [1, 4, 6, 6])], [(n, F, list(s)) for n, s in outputs], self.inits)


@st.composite
def random_models(draw):
    builder = _Builder(draw)
    for _ in range(draw(st.integers(3, 14))):
        builder.step()
    if not builder.nodes:
        builder.emit("Relu", ["x"], (1, 4, 6, 6))
    return builder.build()


def _feeds():
    return {"x": np.random.default_rng(0).standard_normal((1, 4, 6, 6)).astype(np.float32)}


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(random_models())
def test_pipeline_keeps_outputs(m):
    graph, _ = run_pipeline(ir.from_onnx(m), PIPELINE, verify=True)
    assert_graph_matches(m, graph, _feeds(), rtol=1e-4, atol=1e-4)


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(random_models())
def test_fused_kernels_keep_outputs(kernel_cache, m):
    artifact = compile(m, cache_dir=kernel_cache)
    assert_matches_onnxruntime(artifact.run(_feeds()), run_onnxruntime(m, _feeds()), rtol=1e-4, atol=1e-4)
