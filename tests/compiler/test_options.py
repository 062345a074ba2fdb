"""CompileOptions: frozen, checked when made, the one source of the CLI's choices and defaults."""
from __future__ import annotations

import dataclasses

import pytest

from tessel.compiler.cli import build_parser
from tessel.compiler.options import CompileError, CompileOptions
from tessel.passes.placement import CHOICES


def test_defaults_are_one_cpu_device_and_the_whole_pipeline():
    options = CompileOptions()
    assert (options.target, options.devices, options.placement, options.microbatches) == ("llvm", 1, "auto", 1)
    assert options.blocked_layout and options.passes


def test_options_are_frozen_and_normalized():
    options = CompileOptions(input_shapes={"x": [1, 3, 8, 8]}, pins=".*=0", device_memory="2KiB", skip_passes=["fuse"])
    assert options.input_shapes == {"x": (1, 3, 8, 8)} and options.pins == (".*=0",)
    assert options.device_memory == 2048 and options.skip_passes == ("fuse",)
    with pytest.raises(dataclasses.FrozenInstanceError):
        options.devices = 2  # type: ignore[misc]
    with pytest.raises(TypeError):
        options.input_shapes["y"] = (1,)  # type: ignore[index]


@pytest.mark.parametrize("overrides, match", [
    ({"devices": 0}, "devices=0"),
    ({"microbatches": 0}, "microbatches=0"),
    ({"placement": "random"}, "--placement random: use one of auto"),
    ({"conv_layout": "nhwc"}, "--conv-layout nhwc: use one of blocked, nchw"),
    ({"skip_passes": ["warp"]}, "warp"),
    ({"dump_after": ["warp"]}, "--dump-after warp: no such pass"),
    ({"pins": ["nonsense"]}, "--pin 'nonsense'"),
    ({"device_memory": "lots"}, "--device-memory"),
    ({"workspace_limit": "64MiB"}, "add --algo-select"),
    ({"algo_select": "dp", "devices": 2}, "chooses kernels for one device"),
    ({"batch": 0}, "--batch 0"),
    ({"precision": "fp16"}, "--precision fp16: use one of fp32, fp64, bf16, auto"),
    ({"precision": "fp64", "target": "cuda:sm_80"}, "--precision fp64 compiles for CPU targets"),
    ({"precision": "bf16", "target": "cuda:sm_80"}, "--precision bf16: the bf16 kernels are CPU"),
    ({"fast": True}, "unknown compile option 'fast'"),
])
def test_a_bad_option_is_one_compile_error(overrides, match):
    with pytest.raises(CompileError, match=match):
        CompileOptions.create(**overrides)


def test_create_keeps_the_base_and_applies_overrides():
    base = CompileOptions(devices=2, placement="pipeline")
    derived = CompileOptions.create(base, microbatches=4)
    assert (derived.devices, derived.placement, derived.microbatches) == (2, "pipeline", 4)
    assert CompileOptions.create(base) is base


def test_the_cli_takes_its_choices_and_defaults_from_the_options():
    compile_parser = build_parser()._subparsers._group_actions[0].choices["compile"]  # noqa: SLF001
    actions = {a.dest: a for a in compile_parser._actions}  # noqa: SLF001
    for flag, option in (("placement", "placement"), ("algo_select", "algo_select"), ("batch_policy", "batch_policy"),
                         ("conv_layout", "conv_layout"), ("skip_pass", "skip_passes"), ("dump_after", "dump_after"),
                         ("precision", "precision")):
        assert tuple(actions[flag].choices) == CompileOptions.CHOICES[option]
    for flag in ("target", "devices", "placement", "microbatches", "conv_layout", "algo_select", "batch_policy",
                 "precision"):
        assert actions[flag].default == CompileOptions.default(flag)
    assert CompileOptions.CHOICES["placement"] == CHOICES
