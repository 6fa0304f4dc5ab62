"""ddtop.core: what every side shares. The wire and its typed messages, the control
protocol, the run records and summary, the state fold and its helpers (hangs, blame,
stragglers), config and flags, the run directory, journal and keys, the printer and the
TensorBoard points. It imports none of ddtop's other parts, nor torch, nor textual
(tests/test_boundaries.py)."""
