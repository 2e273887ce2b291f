"""In the kernel: a session's ranks kept from cell to cell: the kernel's side of a session, its cells, what the
kernel keeps of it across cells and extension reloads, and modules reloaded in its ranks."""
