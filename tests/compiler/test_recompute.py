"""The compile stage's recomputation hook (compiler/recompute.py): the activation budget is what the weights and
the training state leave of the device; the pass runs after CSE and DCE and before fusion."""
from __future__ import annotations

import numpy as np
import pytest

from tessel.compiler.optim import SGD
from tessel.compiler.pipeline import PIPELINE, run_pipeline
from tessel.compiler.recompute import place_recompute, recompute_for_budget, recompute_pass, resident_bytes
from tessel.compiler.training import build_step_graph
from tessel.ir.interpret import interpret
from tessel.passes.graph_memory import plan_graph_memory
from tessel.passes.recompute import COPY_SUFFIX, RecomputeError
from tests.passes.torch_steps import Step, exported


def test_hook_fits_the_step_into_device_memory():
    step = Step("cnn")
    resident = resident_bytes(step.graph, step.state)
    assert resident >= sum(a.nbytes for a in step.state.values())
    before = step.arena()
    graph, report = recompute_for_budget(step.graph, resident + int(0.9 * before), persistent=step.state)
    assert graph is step.graph and report["changed"]
    assert report["resident_bytes"] == resident and report["budget_bytes"] == int(0.9 * before)
    assert report["peak"]["source"] == report["flops"]["source"] == "estimated"
    assert report["peak"]["before_bytes"] == before
    assert step.arena() == report["peak"]["after_bytes"] <= report["budget_bytes"]
    assert report["summary"].startswith("recompute: ") and "estimated" in report["summary"]


def test_hook_on_a_step_graph_with_sgd_momentum_updates_keeps_every_output():
    optimizer = SGD(lr=0.1, momentum=0.9)
    step = build_step_graph(exported("cnn"), None, "cross_entropy", optimizer)
    graph, state = step.graph, set(step.state)
    rng = np.random.default_rng(0)
    feeds = dict(optimizer.step_scalars(0))
    feeds.update(step.state)
    feeds[step.label_input] = rng.integers(0, 10, graph.lookup(step.label_input).type.shape)
    feeds.update((v.name, rng.standard_normal(v.type.shape).astype(np.float32)) for v in graph.inputs
                 if v.name not in feeds)
    expected = interpret(graph, feeds)
    before = plan_graph_memory(graph, state).arena_bytes
    with pytest.raises(RecomputeError) as out_of_reach:
        recompute_for_budget(graph, resident_bytes(graph, state) + 1024, persistent=state, loss=step.loss_output)
    # The smallest peak recomputation reaches: the step's backward keeps little that is cheap to recompute.
    _, report = recompute_for_budget(graph, resident_bytes(graph, state) + out_of_reach.value.floor_bytes,
                                     persistent=state, loss=step.loss_output)
    assert report["changed"] and plan_graph_memory(graph, state).arena_bytes == report["peak"]["after_bytes"] < before
    got = interpret(graph, feeds)
    for name in expected:
        np.testing.assert_allclose(got[name], expected[name], rtol=1e-6, atol=1e-7, err_msg=name)


def test_hook_leaves_the_step_alone_without_device_memory_or_when_it_fits():
    step = Step("cnn")
    nodes = len(step.graph.nodes)
    assert recompute_for_budget(step.graph, None, persistent=step.state)[1]["changed"] is False
    roomy = resident_bytes(step.graph, step.state) + 2 * step.arena()
    assert recompute_for_budget(step.graph, roomy, persistent=step.state)[1]["changed"] is False
    assert len(step.graph.nodes) == nodes


def test_hook_refuses_a_device_too_small_even_with_recomputation():
    step = Step("cnn")
    with pytest.raises(RecomputeError, match="no room is left for activations"):
        recompute_for_budget(step.graph, 1024, persistent=step.state)
    resident = resident_bytes(step.graph, step.state)
    with pytest.raises(RecomputeError, match=r"of device memory less .* of weights and training state leaves 1.0 KiB "
                                             r"for activations, and the training step's activations need") as info:
        recompute_for_budget(step.graph, resident + 1024, persistent=step.state)
    assert info.value.budget_bytes == 1024 and info.value.floor_bytes > 1024


def test_pipeline_runs_recompute_after_cse_and_dce_and_before_fusion():
    step = Step("cnn")
    budget = resident_bytes(step.graph, step.state) + int(0.9 * step.arena())
    passes = place_recompute(PIPELINE, recompute_pass(budget, persistent=step.state))
    assert [p.name for p in passes] == ["simplify", "split_variadic", "constant_fold", "one_hot_gather", "pool_taps",
                                        "cse", "dce", "recompute", "pool_concat", "batch_gemms", "fuse"]
    graph, records = run_pipeline(step.graph, passes, verify=True)
    stats = records[passes.index(next(p for p in passes if p.name == "recompute"))].stats
    assert stats["nodes_copied"] > 0 and stats["peak_after_bytes"] < stats["peak_before_bytes"]
    assert any(COPY_SUFFIX in node.name for node in graph.walk_nodes())  # fusion keeps (and fuses) the copies
    plain = Step("cnn")
    without, _ = run_pipeline(plain.graph, PIPELINE)
    assert plan_graph_memory(graph, step.state).arena_bytes < plan_graph_memory(without, plain.state).arena_bytes
    with pytest.raises(ValueError, match="after cse and dce and before fuse"):
        place_recompute(list(reversed(PIPELINE)), recompute_pass(budget))

