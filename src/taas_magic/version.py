"""The version of taas-magic, written here alone: the build reads it (pyproject.toml's dynamic version),
``taas_magic.__version__`` is it, and `%taas` shows it on its first line."""

VERSION = "0.2.0"
