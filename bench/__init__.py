"""Benchmarks (not tests): they print numbers and never fail on a timing. Each runs from the
repository root as ``python -m bench.<group>.<name>``; ``bench/README.md`` lists them."""
