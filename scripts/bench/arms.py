"""Ablation arms over one base run's store, in parallel (pipeline/tools/arms.py says how)."""

from pipeline.tools.arms import main

main()
