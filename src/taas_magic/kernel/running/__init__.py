"""In the kernel: one run driven to its end: the pump between the ranks' events and the run state machine, the
ranks' environment, the registered loaders a cell uses, its names back in the notebook, its merged traces."""
