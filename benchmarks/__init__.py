"""Measurements behind benchmarks/RESULTS.md, each run from the repository's root as
`python -m benchmarks.NAME`; h200/ holds the shell drivers of the H200 runs, plots/ the
figures RESULTS shows."""
