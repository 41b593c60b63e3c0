"""Benchmark harness: ``draftwise bench`` (harness), HF peers (peers), prompts, roofline, report."""

from .harness import BenchConfig, run_bench
from .report import aggregate, find_mismatches, write_outputs

__all__ = ["BenchConfig", "aggregate", "find_mismatches", "run_bench", "write_outputs"]
