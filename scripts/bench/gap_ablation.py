"""Issue #47: training's validation vs evaluate, one step at a time (pipeline/training/gap.py says how)."""

from pipeline.training.gap import main

main()
