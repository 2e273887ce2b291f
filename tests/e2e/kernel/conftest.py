"""The end-to-end kernel tier: real Jupyter kernels with the extension loaded, driven as a notebook
drives them (``tests/e2e/conftest.py`` holds their fixtures)."""

from support.tiers import marks_for

pytest_itemcollected = marks_for(__file__, "e2e", "kernel")
