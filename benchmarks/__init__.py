"""megatron-muon benchmarks: ``python -m benchmarks [--quick]`` (or ``make bench``).

Prints a table and writes ``bench_out/results.json``; see ``docs/benchmarks.md`` for what each
figure means and for recorded results.
"""

import warnings

# Megatron's import-time notices (Transformer Engine / Apex not installed, experimental APIs): said
# once by the run instead (``benchmarks.machine.LIBRARY_NOTICE``); the ranks silence theirs.
warnings.filterwarnings("ignore", category=UserWarning, module=r"megatron")
warnings.filterwarnings("ignore", category=SyntaxWarning, module=r"megatron")
