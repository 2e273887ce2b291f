"""The fork backend: the kernel forks a run's supervisor, which forks the ranks."""
