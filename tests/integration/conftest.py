"""The integration tier: real supervisors, forks, fork servers and channels, and no Jupyter kernel."""

from support.tiers import marks_for

pytest_itemcollected = marks_for(__file__, "integration")
