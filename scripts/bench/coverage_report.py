"""`make coverage`'s figures: line and branch coverage of pipeline/ (pipeline/tools/coverage_report.py)."""

from pipeline.tools.coverage_report import cli

cli()
