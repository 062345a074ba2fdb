"""The options of one compile: `CompileOptions`, frozen and checked when made.

`tessel.compile(model, **options)` and `tessel compile` both build one; the
CLI takes its choices and defaults from here. A bad option is a `CompileError`
with one line naming it, raised before any work starts.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, ClassVar, Mapping

from tessel.backends.target import TF32_SUFFIX, parse_target
from tessel.ir.errors import TesselError
from tessel.passes.algo_select import POLICIES
from tessel.passes.placement import CHOICES as PLACEMENTS
from tessel.passes.placement import PlacementError, parse_pins

from .pipeline import PASS_NAMES, select_passes
from .sizes import parse_bytes

ALGO_SELECT_MODES = ("off", "dp", "ilp")
CONV_LAYOUTS = ("blocked", "nchw")
# Training's precisions; a compile also takes bf16 and auto (compiler/precision.py).
PRECISIONS = ("fp32", "fp64")
COMPILE_PRECISIONS = PRECISIONS + ("bf16", "auto")


class CompileError(TesselError):
    """The compile request itself is invalid (e.g. an option Tessel does not offer yet)."""


def _tf32_target(target: str) -> str:
    """The cuda target with TF32 tensor cores allowed (a CompileError for a CPU target)."""
    spec = parse_target(target)
    if not spec.is_gpu:
        raise CompileError(f"--allow-tf32: TF32 tensor cores are a GPU feature; target {target} is a CPU "
                           "(compile with --target cuda:sm_80 or newer)")
    return str(parse_target(f"{spec.kind}:{spec.arch}{TF32_SUFFIX}"))


@dataclass(frozen=True)
class CompileOptions:
    """Everything a compile can be told, checked (`CompileError` on the first bad one).

    target: "llvm" (this CPU) or "cuda:sm_XX". input_shapes: NAME → dims for symbolic inputs.
    input_values: NAME → array for inputs known when compiling (they become constants, no longer inputs).
    batch: re-declares axis 0 of every input. devices > 1 places the model on that many workers
    (placement: auto, single, pipeline, list, data, hybrid; pins: 'REGEX=DEVICE'); microbatches K
    runs the batch as K micro-batches through them; machine: a JSON machine file (devices, memory,
    link) instead. profile / reprofile: time the kernels for placement (cached) / again.
    device_memory: bytes (or "512MiB") per device; the compile fails when the model does not fit.
    skip_passes, verify, dump_after: the optimization pipeline (compiler/pipeline.py).
    algo_select off/dp/ilp with workspace_limit, batch_policy and profile_budget: per-layer
    algorithm and micro-batch selection. conv_layout: activations between conv kernels in
    NCHW[16]c (blocked) or NCHW. keep_model: a copy of the model in the artifact (model.onnx; the weights are
    stored once otherwise). cache_dir: where kernels are cached (default: kernels/ under the cache root,
    $TESSEL_CACHE_DIR); jobs: kernels compiled at once. allow_tf32: cuda convolutions may run on TF32 tensor cores
    (the target becomes cuda:sm_XX+tf32). precision: "fp32" computes as the model is written; "fp64" computes
    the model's float32 tensors in float64 (ir/float64_model.py; CPU targets), its float inputs and outputs too;
    "bf16" runs the dense convs in bf16 with f32 accumulation (CPUs with avx512_bf16), "auto" does where the CPU
    has it and those convs hold most of the FLOPs (compiler/precision.py).
    """

    target: str = "llvm"
    input_shapes: Mapping[str, tuple[int, ...]] = field(default_factory=dict)
    input_values: Mapping[str, Any] = field(default_factory=dict)
    batch: int | None = None
    devices: int = 1
    placement: str = "auto"
    microbatches: int = 1
    pins: tuple[str, ...] = ()
    machine: str | None = None
    profile: bool = True
    reprofile: bool = False
    device_memory: int | None = None
    skip_passes: tuple[str, ...] = ()
    verify: bool = False
    dump_after: tuple[str, ...] = ()
    algo_select: str = "off"
    workspace_limit: int | None = None
    batch_policy: str = "powers-of-two"
    profile_budget: float | None = None
    conv_layout: str = "blocked"
    keep_model: bool = False
    cache_dir: str | None = None
    jobs: int | None = None
    allow_tf32: bool = False
    precision: str = "fp32"

    # The values an option may take, for the CLI's choices and the checks.
    CHOICES: ClassVar[Mapping[str, tuple[str, ...]]] = MappingProxyType({
        "placement": PLACEMENTS, "algo_select": ALGO_SELECT_MODES, "batch_policy": POLICIES,
        "conv_layout": CONV_LAYOUTS, "skip_passes": PASS_NAMES, "dump_after": PASS_NAMES, "precision": COMPILE_PRECISIONS,
    })

    def __post_init__(self) -> None:
        def normalize(name: str, value: Any) -> None:
            object.__setattr__(self, name, value)

        normalize("input_shapes", MappingProxyType({str(k): tuple(int(d) for d in v)
                                                    for k, v in dict(self.input_shapes or {}).items()}))
        normalize("input_values", MappingProxyType({str(k): v for k, v in dict(self.input_values or {}).items()}))
        for name in ("pins", "skip_passes", "dump_after"):
            value = getattr(self, name)
            normalize(name, (value,) if isinstance(value, str) else tuple(value))
        for name in ("machine", "cache_dir"):
            if getattr(self, name) is not None:
                normalize(name, str(getattr(self, name)))
        normalize("device_memory", _bytes("--device-memory", self.device_memory))
        normalize("workspace_limit", _bytes("--workspace-limit", self.workspace_limit))
        if self.allow_tf32:
            normalize("target", _tf32_target(self.target))
        self._check()

    def _check(self) -> None:
        parse_target(self.target)
        for name, value in (("devices", self.devices), ("microbatches", self.microbatches)):
            if value < 1:
                raise CompileError(f"{name}={value}: need at least one")
        if self.batch is not None and self.batch < 1:
            raise CompileError(f"--batch {self.batch}: must be at least 1")
        for name in ("placement", "algo_select", "batch_policy", "conv_layout", "precision"):
            value = getattr(self, name)
            if value not in self.CHOICES[name]:
                raise CompileError(f"--{name.replace('_', '-')} {value}: use one of {', '.join(self.CHOICES[name])}")
        unknown_dumps = sorted(set(self.dump_after) - set(PASS_NAMES))
        if unknown_dumps:
            raise CompileError(f"--dump-after {', '.join(unknown_dumps)}: no such pass; passes are {', '.join(PASS_NAMES)}")
        try:
            select_passes(self.skip_passes)
            parse_pins(self.pins)
        except (ValueError, PlacementError) as exc:
            raise CompileError(str(exc)) from None
        if self.precision == "fp64" and parse_target(self.target).kind != "llvm":
            raise CompileError(f"--precision fp64 compiles for CPU targets (llvm); {self.target}'s kernels are float32")
        if self.precision == "bf16":
            from .precision import bf16_unavailable

            why_not = bf16_unavailable(parse_target(self.target).kind)
            if why_not is not None:
                raise CompileError(f"--precision bf16: {why_not}; --precision auto falls back to fp32")
        if self.algo_select != "off" and self.devices > 1:
            raise CompileError(f"--algo-select {self.algo_select} chooses kernels for one device; compile with --devices 1")
        choosing = self.workspace_limit is not None or self.profile_budget is not None or self.batch_policy != "powers-of-two"
        if self.algo_select == "off" and choosing:
            raise CompileError("--workspace-limit, --batch-policy and --profile-budget choose algorithms: "
                               "add --algo-select dp or ilp")

    @classmethod
    def create(cls, base: CompileOptions | None = None, **overrides: Any) -> CompileOptions:
        """`base` (or the defaults) with `overrides`; an unknown option name is a CompileError."""
        names = [f.name for f in dataclasses.fields(cls)]
        unknown = sorted(set(overrides) - set(names))
        if unknown:
            raise CompileError(f"unknown compile option {unknown[0]!r}; the options are {', '.join(names)}")
        return dataclasses.replace(base or cls(), **overrides) if overrides else base or cls()

    @property
    def passes(self):
        """The optimization pipeline: every pass less those skipped."""
        return select_passes(self.skip_passes)

    @property
    def blocked_layout(self) -> bool:
        """Whether activations between conv kernels stay in NCHW[16]c."""
        return self.conv_layout == "blocked"

    @classmethod
    def default(cls, name: str) -> Any:
        """The default value of option `name` (for the CLI's help)."""
        fields = {f.name: f for f in dataclasses.fields(cls)}
        return fields[name].default


def _bytes(flag: str, value: int | str | None) -> int | None:
    if value is None:
        return None
    try:
        return parse_bytes(value) if isinstance(value, str) else int(value)
    except ValueError as exc:
        raise CompileError(f"{flag}: {exc}") from None
