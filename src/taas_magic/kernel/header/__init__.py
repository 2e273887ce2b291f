"""In the kernel: the cell's header and its options: the ``#!``/``#pragma taas`` line read, the options parsed and
checked (each bad value one line, before anything starts), the launch spec they make, the line commands' words."""
