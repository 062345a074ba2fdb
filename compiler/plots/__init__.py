"""The report charts, drawn with matplotlib (Agg, headless) as PNG and SVG.

One module per chart: gantt.py (the placement's schedule per worker),
memory_timeline.py (live bytes per step per worker), algo_selection.py (the
chosen algorithms against the best single one), placement_alternatives.py (the
predicted time of each placement planner), training_curves.py (a training
run's loss and accuracy). style.py holds what they share:
the lazy matplotlib import, the palette and the writer. Importing these
modules does not import matplotlib; drawing the first chart does.
"""
