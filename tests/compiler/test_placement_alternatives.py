"""compiler/plots/placement_alternatives.py on a synthetic list of alternatives."""
from __future__ import annotations

from tessel.compiler.plots.placement_alternatives import write_placement_chart
from tests.compiler.chart_checks import assert_chart


def test_every_alternative_with_its_source_and_the_pick_marked(tmp_path):
    alternatives = [{"name": "single", "predicted_ms": 50.0, "source": "measured"},
                    {"name": "pipeline", "predicted_ms": 31.25, "source": "measured"},
                    {"name": "data", "predicted_ms": 28.0, "source": "estimated"}]
    paths = write_placement_chart(tmp_path / "placement_alternatives", alternatives, "pipeline", "tiny")
    assert_chart(paths, ["tiny: placement alternatives", "single", "pipeline", "data", "50.00 ms (measured)",
                         "31.25 ms (measured)  ← chosen", "28.00 ms (estimated)", "predicted time per batch (ms)",
                         "from estimated node times", "chosen"], min_height=150)
