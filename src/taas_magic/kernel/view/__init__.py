"""In the kernel: what a cell shows while its ranks run and after: the live view, the ranks' output in the cell,
tidied, and every message about how a run ended."""
