"""The run's supervisor, shared by every backend: one process per run (per node) that forks the ranks, relays
them and ends them all."""
