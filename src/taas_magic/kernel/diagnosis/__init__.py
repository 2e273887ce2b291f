"""In the kernel: where a run's ranks are and why they do not move on: their stacks, cut to the user's code, and
the hang doctor's diagnosis from the ranks' samples."""
