"""Ray's internals that taas uses are there in this Ray, and read as taas reads them."""

from __future__ import annotations

import pytest

from taas_magic.launch.cluster import ray_private

ray = pytest.importorskip("ray")


def test_every_internal_of_rays_that_taas_uses_is_in_this_ray():
    assert ray_private.missing() == [], (
        f"Ray {ray.__version__} lacks {ray_private.missing()}: see taas_magic/launch/cluster/ray_private.py for "
        "what each is used for and what happens without it"
    )


def test_the_gitignore_rules_match_as_ray_packs():
    rules = ray_private.gitignore_rules(["*.ckpt", "data/", "!keep.ckpt"])
    assert rules.match_file("model.ckpt") and rules.match_file("data/train.bin")
    assert not rules.match_file("keep.ckpt") and not rules.match_file("train.py")


def test_the_packaging_functions_take_what_taas_passes():
    import inspect

    packaging = ray_private.packaging()
    assert "excludes" in inspect.signature(packaging.get_uri_for_directory).parameters
    assert "excludes" in inspect.signature(packaging.create_package).parameters
    assert len(inspect.signature(packaging.download_and_unpack_package).parameters) >= 3


def test_only_a_dashboard_started_in_the_block_gets_the_variables(monkeypatch):
    import importlib
    import inspect

    services = importlib.import_module("ray._private.services")
    dashboard = importlib.import_module("ray._private.ray_constants").PROCESS_TYPE_DASHBOARD
    assert {"process_type", "env_updates"} <= set(inspect.signature(services.start_ray_process).parameters)
    started = []

    def start_ray_process(command, process_type, fate_share, env_updates=None, cwd=None):
        started.append((command, process_type, env_updates))

    monkeypatch.setattr(services, "start_ray_process", start_ray_process)
    with ray_private.dashboard_environment({"HOME": "/home/local"}):
        services.start_ray_process(["dashboard"], dashboard, fate_share=False)
        services.start_ray_process(["raylet"], "raylet", False, {"A": "1"})
        services.start_ray_process(["dashboard"], dashboard, False, {"A": "1"}, cwd="/")
    services.start_ray_process(["dashboard"], dashboard, fate_share=False)
    assert started == [
        (["dashboard"], dashboard, {"HOME": "/home/local"}),
        (["raylet"], "raylet", {"A": "1"}),
        (["dashboard"], dashboard, {"A": "1", "HOME": "/home/local"}),
        (["dashboard"], dashboard, None),
    ]
