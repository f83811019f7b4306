"""megatron-muon benchmarks: ``python -m benchmarks [--quick]`` (or ``make bench``).

Prints a table and writes ``bench_out/results.json``; see ``docs/benchmarks.md`` for what each
figure means and for recorded results.
"""
