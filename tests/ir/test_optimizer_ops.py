"""ir/optimizer_ops.py: the update ops' type inference (operand counts, types, outputs) and numpy references."""
from __future__ import annotations

import numpy as np
import pytest

from tessel.ir.interpret import REFERENCE
from tessel.ir.schema import TESSEL_DOMAIN, InferenceFailure, get_schema
from tessel.ir.types import TensorType

W = TensorType("float32", (3, 4))
SCALAR = TensorType("float32", ())


def _infer(op_type: str, attrs: dict, types: list[TensorType], num_outputs: int):
    schema = get_schema(op_type, TESSEL_DOMAIN)
    return schema.infer(schema.make_attributes(attrs, "test"), types, [None] * len(types), num_outputs)


def test_sgd_update_outputs_follow_momentum():
    assert _infer("SGDUpdate", {}, [W, W, SCALAR], 1) == [W]
    assert _infer("SGDUpdate", {"momentum": 0.9}, [W, W, SCALAR, W], 2) == [W, W]
    assert _infer("SGDUpdate", {"momentum": 0.9, "dampening": 0.1}, [W, W, SCALAR, W, SCALAR], 2) == [W, W]


@pytest.mark.parametrize("attrs, types, outputs, message", [
    ({"momentum": 0.9}, [W, W, SCALAR], 2, "takes 4 inputs, got 3"),
    ({"momentum": 0.9}, [W, W, SCALAR, W], 1, "has 2 output"),
    ({"nesterov": 1}, [W, W, SCALAR], 1, "Nesterov momentum requires a momentum"),
    ({}, [W, TensorType("float32", (4, 3)), SCALAR], 1, r"must be f32\[3,4\] like the parameter"),
    ({}, [W, W, W], 1, "must be 0-d floats"),
    ({}, [TensorType("int64", (3,))] * 2 + [SCALAR], 1, "updates float tensors"),
])
def test_sgd_update_rejects(attrs, types, outputs, message):
    with pytest.raises(InferenceFailure, match=message):
        _infer("SGDUpdate", attrs, types, outputs)


def test_adamw_update_types():
    assert _infer("AdamWUpdate", {}, [W] * 4 + [SCALAR] * 2, 3) == [W] * 3
    assert _infer("AdamWUpdate", {}, [W] * 4 + [SCALAR] * 3, 3) == [W] * 3
    with pytest.raises(InferenceFailure, match="3 outputs"):
        _infer("AdamWUpdate", {}, [W] * 4 + [SCALAR] * 2, 1)


def test_references_keep_float32():
    """In float32 the references compute in float32, as torch.optim does on float32 parameters."""
    schema = get_schema("AdamWUpdate", TESSEL_DOMAIN)
    arrays = [np.full((2,), v, np.float32) for v in (1.0, 0.5, 0.1, 0.2)] + [np.array(0.5, np.float32)] * 2
    outputs = REFERENCE["AdamWUpdate"](schema.make_attributes({}, "test"), arrays)
    assert [o.dtype for o in outputs] == [np.float32] * 3
    m = np.float32(0.1) + (np.float32(0.5) - np.float32(0.1)) * np.float32(0.1)
    np.testing.assert_array_equal(outputs[1], [m, m])
