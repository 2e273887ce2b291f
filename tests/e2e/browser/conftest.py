"""The end-to-end browser tier: JupyterLab in a headless browser, as a person sees a taas cell."""

from support.tiers import marks_for

pytest_itemcollected = marks_for(__file__, "e2e", "browser", "kernel")
