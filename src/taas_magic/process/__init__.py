"""What every process taas starts does first, and how they are kept inside the run."""
