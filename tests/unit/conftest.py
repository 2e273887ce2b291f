"""The unit tier: no process is started. Pure functions, the state machine, the protocol, rendering,
and the cell runner and sessions over a scripted group of ranks. Folders mirror ``src/``."""

from support.tiers import marks_for

pytest_itemcollected = marks_for(__file__, "unit")
