"""Lab scripts: GPU benchmarks and diagnostics run from the repository root
(`python -m bench.lab.bench_engine`). They stay in git but are not installed with pdserve."""
