"""Benchmarks behind ``diloco bench``: measured numbers, never timed tests."""
