"""What a notebook that a token-authenticated Ray cluster refused is told: one line, naming what it lacks."""

from __future__ import annotations

import os

import pytest
from hypothesis import given
from hypothesis import strategies as st

from taas_magic.errors import TaasUsageError
from taas_magic.launch.cluster import address_checks, authentication

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


@pytest.mark.parametrize("token_file", [None, "", "  \n", "a-token"])
def test_token_mode_without_a_token_is_said_before_ray_is_asked(tmp_path, monkeypatch, token_file):
    """Ray's own check ends the kernel's process when token mode finds no token: taas says it first, in one line.
    A file of blanks holds no token."""
    monkeypatch.setenv("HOME", str(tmp_path))
    if token_file is not None:
        (tmp_path / ".ray").mkdir()
        (tmp_path / ".ray" / "auth_token").write_text(token_file)
    environ = {"RAY_AUTH_MODE": "token"}
    line = authentication.missing_token(ADDRESS, environ)
    if token_file == "a-token":
        assert line is None
    else:
        assert line == authentication.refused(ADDRESS, environ) and "this notebook has none" in line
    assert authentication.missing_token(ADDRESS, {}) is None, "without token mode Ray asks for none"


def test_connecting_in_token_mode_without_a_token_fails_in_one_line_before_the_cluster_is_asked(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("RAY_AUTH_MODE", "token")
    monkeypatch.delenv("RAY_AUTH_TOKEN", raising=False)
    monkeypatch.delenv("RAY_AUTH_TOKEN_PATH", raising=False)
    monkeypatch.setattr(address_checks, "_check_answers", lambda address: pytest.fail("the cluster was asked"))
    with pytest.raises(TaasUsageError, match=r"^the Ray cluster at 127.0.0.1:1 requires a token and this notebook"):
        address_checks.check("127.0.0.1:1")


@pytest.mark.parametrize(
    "address, said",
    [
        ("http://127.0.0.1:6379", "leave out http:// (%taas cluster 127.0.0.1:6379)"),
        ("https://head:8265", "leave out https:// (%taas cluster head:8265)"),
        ("127.0.0.1", "is not HOST:PORT, ray://HOST:PORT or auto"),
        ("head:port", "is not HOST:PORT, ray://HOST:PORT or auto"),
    ],
)
def test_an_address_that_is_not_one_is_named_as_such_before_anything_is_asked(monkeypatch, address, said):
    monkeypatch.delenv("RAY_AUTH_MODE", raising=False)
    with pytest.raises(TaasUsageError) as raised:
        address_checks.check(address)
    assert str(raised.value).startswith(f"cluster address {address!r} is not HOST:PORT") and said in str(raised.value)
