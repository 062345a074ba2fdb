"""Op traits: one answer per op type, read the same from the schema."""
from __future__ import annotations

from tessel.ir.op_traits import Pattern, op_traits
from tessel.ir.schema import FUSED, TESSEL_DOMAIN, get_schema


def test_views_and_shape_views_are_distinct():
    for op in ("Reshape", "Flatten", "Squeeze", "Unsqueeze"):
        assert op_traits(op).view and op_traits(op).shape_view
    for op in ("Identity", "Dropout"):
        assert op_traits(op).view and not op_traits(op).shape_view  # views, but no chain of them is a Reshape
    assert not op_traits("Transpose").view


def test_patterns_anchors_and_per_sample_ops():
    assert op_traits("Add").pattern == Pattern.ELEMWISE and op_traits("Add").elementwise
    assert op_traits("Transpose").pattern == Pattern.INJECTIVE and not op_traits("Transpose").fusion_anchor
    assert op_traits("Conv").fusion_anchor and op_traits("Softmax").fusion_anchor
    assert op_traits("Conv").per_sample and not op_traits("Softmax").per_sample
    assert op_traits("LSTM").pattern == Pattern.OPAQUE


def test_effects_transfers_and_kernels():
    assert op_traits("Send").transfer and op_traits("Send").side_effects
    assert op_traits("Unreachable").side_effects and not op_traits("Unreachable").transfer
    assert not op_traits("If").kernel and not op_traits("Unreachable").kernel and op_traits(FUSED).kernel
    assert not op_traits("RandomNormal").deterministic and op_traits("Relu").deterministic
    assert op_traits("Add").commutative and not op_traits("Sub").commutative


def test_the_schema_carries_the_traits_of_its_op():
    assert get_schema("Dropout", "").traits is op_traits("Dropout")
    assert get_schema("Recv", TESSEL_DOMAIN).traits.transfer
