"""In the kernel: the ``%%taas`` magic and everything behind it, in layers that import only downwards.

magics.py                      the magic's entry: a cell or a line command to the code that runs it
runner.py                      one cell from its options to its names back in the notebook
settings.py, cluster_link.py   what ``%taas`` shows and the defaults; the notebook's Ray cluster
sessions/                      a session's ranks kept from cell to cell, and what the kernel keeps of them
running/                       one run driven to its end: the pump, the ranks' environment, names back
view/ | debugging/             what a cell shows; ranks in the notebook's visual debugger
run/                           the run state machine, without I/O, and its result
header/ | diagnosis/           the cell's header and options; where stuck ranks are and why
"""
