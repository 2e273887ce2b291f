"""In the kernel: one run's state machine, with no I/O: events and the clock in, actions out, and the frozen result
that every message about the run is worded from."""
