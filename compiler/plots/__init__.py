"""The report charts, written as PNG and SVG.

One module per chart: gantt.py (the placement's schedule per worker),
memory_timeline.py (live bytes per step per worker), algo_selection.py (the
chosen algorithms against the best single one), placement_alternatives.py (the
predicted time of each placement planner), step_gantt.py (one training step
per worker), training_curves.py (a training run's loss and accuracy).
The memory timeline, drawn on every compile, is drawn on canvas.py's surface
(Pillow for the PNG, the SVG written by hand; frame.py lays out its axes) in
milliseconds; the others with matplotlib, whose shared set-up (its import on
first use, no pyplot), palette and writer are in style.py. Importing these
modules does not import matplotlib; drawing the first matplotlib chart does.
"""
