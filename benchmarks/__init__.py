"""megatron-muon benchmarks: ``python -m benchmarks [--quick]`` (or ``make bench``).

Prints a table and writes ``bench_out/results.json``; see ``docs/benchmarks.md`` for what each
figure means and for recorded results.
"""

import logging
import warnings

# Megatron's import-time notices (Transformer Engine / Apex not installed, experimental APIs): said
# once by the run instead (``benchmarks.machine.LIBRARY_NOTICE``); the ranks silence theirs.
warnings.filterwarnings("ignore", category=UserWarning, module=r"megatron")
warnings.filterwarnings("ignore", category=SyntaxWarning, module=r"megatron")
# torch.utils.cpp_extension, imported by megatron, warns "No CUDA runtime is found" on a machine
# without a GPU: true and harmless here (the CPU run needs none); ``choose_ns_precision`` does the
# same for the ranks' launcher (TORCH_LOGS).
logging.getLogger("torch.utils.cpp_extension").setLevel(logging.ERROR)
