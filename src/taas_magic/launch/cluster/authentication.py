"""Ray's token authentication, as a notebook connecting to a cluster meets it.

A Ray cluster started with ``RAY_AUTH_MODE=token`` (Ray 2.52 and later; Ray's default for new local
clusters from 2.59) serves only processes that present its token. The notebook's side uses Ray's own
variables, read by Ray itself: ``RAY_AUTH_MODE=token``, and the token in ``RAY_AUTH_TOKEN``, in the file
``RAY_AUTH_TOKEN_PATH`` names, or in ``~/.ray/auth_token`` (Ray's order). taas neither stores nor
passes tokens: it asks the cluster once before connecting (``ray_private.ask_gcs``) and, when the
cluster refuses, says in one line which of these is missing or wrong. The nodes' own processes
(agents, fork servers, ranks) run under the cluster's raylets, which hold the token already.
"""

from __future__ import annotations

import os
from typing import Mapping

MODE = "RAY_AUTH_MODE"
TOKEN = "RAY_AUTH_TOKEN"
TOKEN_PATH = "RAY_AUTH_TOKEN_PATH"
DEFAULT_PATH = os.path.join("~", ".ray", "auth_token")
WHERE = f"{TOKEN}, a file {TOKEN_PATH} names, or {DEFAULT_PATH}"
HEAD = "`ray get-auth-token` on the cluster's head prints it"


def token_source(environ: Mapping[str, str]) -> str | None:
    """Where Ray would read this notebook's token from (as Ray looks: the variable, the file it names,
    the default file); None where there is none, or only blanks."""
    if environ.get(TOKEN, "").strip():
        return TOKEN
    path = environ.get(TOKEN_PATH)
    if path:
        return f"{path} ({TOKEN_PATH})" if _holds_a_token(path) else None
    return DEFAULT_PATH if _holds_a_token(DEFAULT_PATH) else None


def _holds_a_token(path: str) -> bool:
    try:
        with open(os.path.expanduser(path), "rb") as file:
            return bool(file.read(4096).strip())
    except OSError:  # absent, a folder, unreadable
        return False


def missing_token(address: str, environ: Mapping[str, str]) -> str | None:
    """The one line for ``RAY_AUTH_MODE=token`` with no token anywhere Ray looks; None otherwise. Said before
    Ray is asked anything: Ray's own check of it ends the process it runs in (a C++ abort), which is the
    notebook's kernel."""
    if token_mode(environ) and token_source(environ) is None:
        return refused(address, environ)
    return None


def token_mode(environ: Mapping[str, str]) -> bool:
    return environ.get(MODE, "").lower() == "token"


def refused(address: str, environ: Mapping[str, str]) -> str:
    """The one line for a cluster that refused this notebook's token authentication: what is missing, or
    that the token is not the cluster's."""
    source = token_source(environ)
    if not token_mode(environ):
        found = f" (a token is in {source})" if source else f" and its token ({WHERE}; {HEAD})"
        return (
            f"the Ray cluster at {address} requires token authentication: set {MODE}=token{found} before "
            f"connecting, e.g. %env {MODE}=token"
        )
    if source is None:
        return f"the Ray cluster at {address} requires a token and this notebook has none: put it in {WHERE} ({HEAD})"
    return (
        f"the Ray cluster at {address} refused this notebook's token (from {source}): it is not the cluster's ({HEAD})"
    )


def client_hint(environ: Mapping[str, str]) -> str:
    """What to add to a Ray Client connection's failure, whose cause Ray does not say: its token, perhaps."""
    source = token_source(environ)
    if token_mode(environ) and source:
        return f" (if the cluster requires token authentication, is this notebook's token from {source} its own?)"
    return f" (if the cluster requires token authentication: {MODE}=token and its token in {WHERE})"
