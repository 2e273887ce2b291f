"""The configuration catalog: what ships, how a TAAS_CONFIG file extends it, and how bad files are reported."""

from __future__ import annotations

import os

import pytest

from taas_magic.configurations import ENV_VAR, Configuration, load_catalog
from taas_magic.errors import TaasUsageError

SHIPPED = ["c1.4", "c1.8", "c1.32", "c1.80", "g1.1", "g1.2", "g1.4", "g2.1", "g2.2", "g2.4", "g2.8"]


def write(path, text: str) -> str:
    path.write_text(text, encoding="utf-8")
    return str(path)


def test_shipped_names_in_natural_order() -> None:
    catalog = load_catalog({})
    assert catalog.names() == SHIPPED
    assert catalog.sources == ("configurations.yaml (shipped)",)
    assert catalog.max_nodes == 4


@pytest.mark.parametrize(
    ("name", "gpus", "cpus"),
    [("c1.4", 0, 4), ("c1.80", 0, 80), ("g1.1", 1, 8), ("g1.4", 4, 32), ("g2.1", 1, 28), ("g2.8", 8, 224)],
)
def test_shipped_configurations(name: str, gpus: int, cpus: int) -> None:
    configuration = load_catalog({}).get(name)
    assert (configuration.name, configuration.gpus, configuration.cpus) == (name, gpus, cpus)


def test_describe_says_what_a_node_offers() -> None:
    catalog = load_catalog({})
    assert catalog.get("g2.8").describe() == "g2.8: 8 GPUs (NVIDIA A100), 224 vCPUs, 952 GB per node"
    assert catalog.get("g1.1").describe() == "g1.1: 1 GPU (NVIDIA V100), 8 vCPUs, 96 GB per node"
    assert catalog.get("c1.4").describe() == "c1.4: 0 GPUs, 4 vCPUs, 32 GB per node"


def test_membership_and_unknown_names() -> None:
    catalog = load_catalog({})
    assert "g2.8" in catalog and "g9.9" not in catalog and 3 not in catalog
    with pytest.raises(TaasUsageError) as raised:
        catalog.get("g9.9")
    assert str(raised.value) == f"unknown configuration 'g9.9': known are {', '.join(SHIPPED)}"


def test_user_file_adds_a_configuration_and_overrides_one_field(tmp_path) -> None:
    path = write(tmp_path / "lab.yaml", """
configurations:
  g2.8: {cpus: 96}
  lab.2: {gpus: 2, cpus: 24, memory_gb: 128, gpu_model: RTX 4090}
""")
    catalog = load_catalog({ENV_VAR: path})
    assert catalog.get("g2.8") == Configuration("g2.8", gpus=8, cpus=96, memory_gb=952.0, gpu_model="NVIDIA A100")
    assert catalog.get("lab.2") == Configuration("lab.2", gpus=2, cpus=24, memory_gb=128.0, gpu_model="RTX 4090")
    assert set(SHIPPED) < set(catalog.names())
    assert catalog.get("g1.1") == load_catalog({}).get("g1.1")
    assert catalog.sources == ("configurations.yaml (shipped)", path)
    # The shipped catalog itself is untouched by the merge.
    assert load_catalog({}).get("g2.8").cpus == 224


def test_user_file_can_change_max_nodes(tmp_path) -> None:
    path = write(tmp_path / "nodes.yaml", "max_nodes: 2\n")
    catalog = load_catalog({ENV_VAR: path})
    assert catalog.max_nodes == 2
    assert catalog.names() == SHIPPED


def test_empty_file_and_empty_variable_mean_the_shipped_catalog(tmp_path) -> None:
    assert load_catalog({ENV_VAR: write(tmp_path / "empty.yaml", "")}).names() == SHIPPED
    assert load_catalog({ENV_VAR: ""}).sources == ("configurations.yaml (shipped)",)


def test_default_environment_is_os_environ(tmp_path, monkeypatch) -> None:
    path = write(tmp_path / "env.yaml", "configurations:\n  mine.1: {gpus: 1, cpus: 2}\n")
    monkeypatch.setenv(ENV_VAR, path)
    assert "mine.1" in load_catalog()
    monkeypatch.delenv(ENV_VAR)
    assert "mine.1" not in load_catalog()


def test_missing_file_is_a_usage_error_naming_it(tmp_path) -> None:
    path = str(tmp_path / "nowhere.yaml")
    with pytest.raises(TaasUsageError) as raised:
        load_catalog({ENV_VAR: path})
    assert str(raised.value) == f"TAAS_CONFIG={path!r} does not name a readable file"


def test_a_directory_is_a_usage_error_naming_it(tmp_path) -> None:
    with pytest.raises(TaasUsageError) as raised:
        load_catalog({ENV_VAR: str(tmp_path)})
    message = str(raised.value)
    assert message.startswith(f"TAAS_CONFIG={str(tmp_path)!r} does not name a readable file")
    assert "\n" not in message


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        pytest.param("configurations: [\n", "is not valid YAML", id="unclosed-list"),
        pytest.param("configurations:\n  g2.8: {gpus: 8\n", "is not valid YAML", id="unclosed-mapping"),
        pytest.param("a: b: c\n", "is not valid YAML", id="mapping-in-a-scalar"),
        pytest.param("- g2.8\n- g1.1\n", "must be a mapping", id="top-level-list"),
        pytest.param("configurations: [g2.8]\n", "must be a mapping", id="configurations-a-list"),
        pytest.param("configurations:\n  g2.8: 8\n", "must be a mapping", id="entry-a-number"),
        pytest.param("configurations:\n  g2.8: {gpus: many}\n", "configuration 'g2.8' has a bad field",
                     id="field-not-a-number"),
        pytest.param("max_nodes: lots\n", "max_nodes has a bad value", id="max-nodes-not-a-number"),
    ],
)
def test_bad_file_is_a_one_line_usage_error_naming_it(tmp_path, text: str, fragment: str) -> None:
    path = write(tmp_path / "bad.yaml", text)
    with pytest.raises(TaasUsageError) as raised:
        load_catalog({ENV_VAR: path})
    message = str(raised.value)
    assert path in message
    assert fragment in message
    assert "\n" not in message


def test_cache_keeps_the_catalog_while_the_file_is_unchanged(tmp_path) -> None:
    path = write(tmp_path / "cached.yaml", "configurations:\n  mine.1: {gpus: 1, cpus: 2}\n")
    assert load_catalog({ENV_VAR: path}) is load_catalog({ENV_VAR: path})
    assert load_catalog({}) is load_catalog({})


def test_cache_picks_up_a_changed_file(tmp_path) -> None:
    path = tmp_path / "changing.yaml"
    write(path, "configurations:\n  mine.1: {gpus: 1, cpus: 2}\n")
    stamp = os.stat(path).st_mtime
    before = load_catalog({ENV_VAR: str(path)})
    assert before.get("mine.1").cpus == 2

    write(path, "configurations:\n  mine.1: {gpus: 1, cpus: 6}\n  mine.2: {gpus: 2, cpus: 12}\n")
    os.utime(path, (stamp + 10, stamp + 10))
    after = load_catalog({ENV_VAR: str(path)})
    assert after.get("mine.1").cpus == 6
    assert "mine.2" in after

    write(path, "configurations: [\n")
    os.utime(path, (stamp + 20, stamp + 20))
    with pytest.raises(TaasUsageError, match="is not valid YAML"):
        load_catalog({ENV_VAR: str(path)})

    path.unlink()
    with pytest.raises(TaasUsageError, match="does not name a readable file"):
        load_catalog({ENV_VAR: str(path)})


@pytest.mark.parametrize("fields", ["{gpus: -1, cpus: 4}", "{gpus: 0, cpus: 0}", "{gpus: 1, cpus: 2, memory_gb: -5}"])
def test_impossible_machines_are_refused(tmp_path, fields):
    path = tmp_path / "odd.yaml"
    path.write_text(f"configurations:\n  odd: {fields}\n")
    with pytest.raises(TaasUsageError, match="configuration 'odd' has gpus"):
        load_catalog({"TAAS_CONFIG": str(path)})
