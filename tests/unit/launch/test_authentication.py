"""What a notebook that a token-authenticated Ray cluster refused is told: one line, naming what it lacks."""

from __future__ import annotations

import os

from hypothesis import given
from hypothesis import strategies as st

from taas_magic.launch.cluster import authentication

ADDRESS = "10.0.0.5:6379"


def test_without_token_mode_the_line_says_to_switch_it_on_and_where_the_token_goes(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    line = authentication.refused(ADDRESS, {})
    assert line.startswith(f"the Ray cluster at {ADDRESS} requires token authentication: set RAY_AUTH_MODE=token")
    assert "RAY_AUTH_TOKEN" in line and "ray get-auth-token" in line and "\n" not in line


def test_a_token_in_rays_default_file_is_named_when_only_the_mode_is_missing(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / ".ray").mkdir()
    (tmp_path / ".ray" / "auth_token").write_text("x" * 64)
    line = authentication.refused(ADDRESS, {})
    assert f"(a token is in {os.path.join('~', '.ray', 'auth_token')})" in line


def test_token_mode_without_a_token_says_the_notebook_has_none(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    line = authentication.refused(ADDRESS, {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(tmp_path / "nope")})
    assert line.startswith(f"the Ray cluster at {ADDRESS} requires a token and this notebook has none")


def test_a_refused_token_is_named_by_where_it_came_from(tmp_path):
    file = tmp_path / "token"
    file.write_text("y" * 64)
    by_variable = authentication.refused(ADDRESS, {"RAY_AUTH_MODE": "TOKEN", "RAY_AUTH_TOKEN": "z"})
    assert "refused this notebook's token (from RAY_AUTH_TOKEN): it is not the cluster's" in by_variable
    by_file = authentication.refused(ADDRESS, {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(file)})
    assert f"(from {file} (RAY_AUTH_TOKEN_PATH))" in by_file


@given(
    mode=st.sampled_from([None, "", "token", "Token", "disabled", "k8s"]),
    token=st.one_of(st.none(), st.text(max_size=8)),
)
def test_every_setting_gets_one_line_that_names_the_cluster(mode, token):
    environ = {name: value for name, value in (("RAY_AUTH_MODE", mode), ("RAY_AUTH_TOKEN", token)) if value is not None}
    line = authentication.refused(ADDRESS, environ)
    assert ADDRESS in line and "\n" not in line
    assert ("RAY_AUTH_MODE=token" in line) == (not authentication.token_mode(environ))
    hint = authentication.client_hint(environ)
    assert hint.startswith(" (") and "token authentication" in hint
