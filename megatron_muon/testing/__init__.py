"""Multi-rank unit tests on CPU: run a function on N gloo ranks from one process (``ranks``).

```python
from megatron_muon.testing import run_on_ranks

def body(rank, world_size, shape):    # module-level: it is pickled by reference
    ...                               # gloo is initialised, the CPU stand-ins are applied
    return some_tensor                # returned to the caller, in rank order

results = run_on_ranks(body, 3, (48, 16), timeout=60)
```

A rank that raises fails the call with ``RankFailure`` (every failed rank's traceback); ranks that
do not finish within ``timeout`` seconds fail it with ``RankTimeout`` naming them.
"""

from megatron_muon.testing.ranks import (
    DEFAULT_TIMEOUT_S,
    DeviceT,
    RankFailure,
    RankTimeout,
    run_on_ranks,
    set_launch_check,
)

__all__ = [
    "DEFAULT_TIMEOUT_S",
    "DeviceT",
    "RankFailure",
    "RankTimeout",
    "run_on_ranks",
    "set_launch_check",
]
