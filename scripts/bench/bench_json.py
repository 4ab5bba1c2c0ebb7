"""The results JSON of every benchmark: one home, pipeline/formats/bench_results.py."""

from pipeline.formats.bench_results import commit, header, read, write  # noqa: F401
