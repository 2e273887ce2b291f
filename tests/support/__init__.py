"""What the tiers' tests share: the kernel they drive, the notebook values they send, the cells they
run in more than one module, and the marking of each tier by its folder."""

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]  # the repository: src/, docs/, examples/
