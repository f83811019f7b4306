"""Newton-Schulz on one full matrix: the methods and their registry (``methods``), Gram NS, split
NS, the FLOP cost model and matmul rates. May import ``common`` only."""
