"""In the kernel: the magic, run control, sessions, the live view and output tidying."""
