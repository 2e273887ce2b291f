"""The CUDA-safe backend: a fork server that imported torch and never touched CUDA forks the run's supervisor."""
