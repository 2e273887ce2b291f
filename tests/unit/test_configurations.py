"""The configuration catalog: what ships, how a TAAS_CONFIG file extends it, and how bad files are reported."""

from __future__ import annotations

import os
import time

import pytest

from taas_magic.configurations import ENV_VAR, MAX_FILE_BYTES, Configuration, load_catalog
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
    path = write(
        tmp_path / "lab.yaml",
        """
configurations:
  g2.8: {cpus: 96}
  lab.2: {gpus: 2, cpus: 24, memory_gb: 128, gpu_model: RTX 4090}
""",
    )
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
        pytest.param(
            "configurations:\n  g2.8: {gpus: many}\n", "configuration 'g2.8' has a bad field", id="field-not-a-number"
        ),
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


# Bounds: whatever the file says, loading ends quickly in a catalog or a one-line usage error.


def load_error(path) -> str:
    started = time.monotonic()
    with pytest.raises(TaasUsageError) as raised:
        load_catalog({ENV_VAR: str(path)})
    assert time.monotonic() - started < 5
    message = str(raised.value)
    assert "\n" not in message and len(message) < 400
    return message


@pytest.mark.parametrize(
    ("fields", "expected"),
    [
        pytest.param(
            "{gpus: 100000000000000000000, cpus: 8}",
            "has gpus: 100000000000000000000, cpus: 8, memory_gb: 0 in",
            id="gpus-1e20",
        ),
        pytest.param("{gpus: 65}", "has gpus: 65, cpus: 1, memory_gb: 0 in", id="gpus-65"),
        pytest.param("{cpus: 4097}", "has gpus: 0, cpus: 4097, memory_gb: 0 in", id="cpus-4097"),
        pytest.param("{gpus: 1, memory_gb: .nan}", "has gpus: 1, cpus: 1, memory_gb: nan in", id="memory-nan"),
        pytest.param("{gpus: 1, memory_gb: .inf}", "has gpus: 1, cpus: 1, memory_gb: inf in", id="memory-inf"),
        pytest.param(
            "{gpus: 1, memory_gb: 1000001}", "has gpus: 1, cpus: 1, memory_gb: 1000001 in", id="memory-too-large"
        ),
    ],
)
def test_counts_beyond_any_node_are_refused_naming_value_and_range(tmp_path, fields: str, expected: str) -> None:
    message = load_error(write(tmp_path / "big.yaml", f"configurations:\n  big: {fields}\n"))
    assert message.startswith(f"configuration 'big' {expected}")
    assert message.endswith(": use gpus 0-64, cpus 1-4096 and memory_gb 0-1000000")


BAD_FIELD = "configuration 'big' has a bad field"
BAD_MAX_NODES = "max_nodes has a bad value"


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        pytest.param(
            "configurations:\n  big: {gpus: .inf}\n", f"{BAD_FIELD} (gpus: inf is not a whole number)", id="gpus-inf"
        ),
        pytest.param(
            "configurations:\n  big: {cpus: .nan}\n", f"{BAD_FIELD} (cpus: nan is not a whole number)", id="cpus-nan"
        ),
        pytest.param(
            "configurations:\n  big: {gpus: 2.0}\n", f"{BAD_FIELD} (gpus: 2.0 is not a whole number)", id="gpus-float"
        ),
        pytest.param(
            "configurations:\n  big: {memory_gb: '12'}\n",
            f"{BAD_FIELD} (memory_gb: '12' is not a number)",
            id="memory-text",
        ),
        pytest.param(
            "configurations:\n  big: {gpu_model: [a, b]}\n",
            f"{BAD_FIELD} (gpu_model: ['a', 'b'] is not text)",
            id="model-list",
        ),
        pytest.param(
            "configurations:\n  big: {gpus: '" + "9" * 100 + "'}\n",
            f"{BAD_FIELD} (gpus: '{'9' * 39}... is not a whole number)",
            id="long-value-cut",
        ),
        pytest.param(
            "max_nodes: .inf\n", f"{BAD_MAX_NODES} (max_nodes: inf is not a whole number)", id="max-nodes-inf"
        ),
        pytest.param(
            "max_nodes: .nan\n", f"{BAD_MAX_NODES} (max_nodes: nan is not a whole number)", id="max-nodes-nan"
        ),
        pytest.param(
            "max_nodes: 2.5\n", f"{BAD_MAX_NODES} (max_nodes: 2.5 is not a whole number)", id="max-nodes-float"
        ),
        pytest.param(
            "max_nodes: true\n", f"{BAD_MAX_NODES} (max_nodes: True is not a whole number)", id="max-nodes-bool"
        ),
        pytest.param(
            "max_nodes: 1025\n", "max_nodes: 1025 in configurations.yaml (shipped), ", id="max-nodes-too-many"
        ),
        pytest.param("max_nodes: 0\n", "max_nodes: 0 in configurations.yaml (shipped), ", id="max-nodes-0"),
    ],
)
def test_values_that_are_not_plain_counts_are_refused(tmp_path, text: str, expected: str) -> None:
    path = write(tmp_path / "odd.yaml", text)
    message = load_error(path)
    assert message.startswith(expected)
    assert path in message
    if expected.startswith("max_nodes: "):
        assert message.endswith(": use 1-1024")


def test_a_file_at_the_bounds_loads(tmp_path) -> None:
    path = write(
        tmp_path / "edge.yaml",
        "max_nodes: 1024\nconfigurations:\n"
        "  edge: {gpus: 64, cpus: 4096, memory_gb: 1000000.0}\n  none: {gpus: 0, cpus: 1, memory_gb: 0}\n",
    )
    catalog = load_catalog({ENV_VAR: path})
    assert catalog.max_nodes == 1024
    assert catalog.get("edge") == Configuration("edge", gpus=64, cpus=4096, memory_gb=1e6)


ALIAS_BOMB = """configurations:
  g2.8: {gpus: 8}
a: &a [lol, lol, lol, lol, lol, lol, lol, lol, lol]
b: &b [*a, *a, *a, *a, *a, *a, *a, *a, *a]
c: &c [*b, *b, *b, *b, *b, *b, *b, *b, *b]
d: &d [*c, *c, *c, *c, *c, *c, *c, *c, *c]
e: &e [*d, *d, *d, *d, *d, *d, *d, *d, *d]
f: &f [*e, *e, *e, *e, *e, *e, *e, *e, *e]
g: &g [*f, *f, *f, *f, *f, *f, *f, *f, *f]
h: &h [*g, *g, *g, *g, *g, *g, *g, *g, *g]
i: &i [*h, *h, *h, *h, *h, *h, *h, *h, *h]
max_nodes: *i
"""


def test_yaml_aliases_are_refused(tmp_path) -> None:
    path = write(tmp_path / "laughs.yaml", ALIAS_BOMB)
    message = load_error(path)
    assert message.startswith(f"TAAS_CONFIG={path!r} is not valid YAML: aliases (*name) are not allowed")
    assert "line 4, column" in message


def test_an_anchor_without_an_alias_is_plain_yaml(tmp_path) -> None:
    path = write(tmp_path / "anchor.yaml", "configurations:\n  lab.1: &lab {gpus: 1, cpus: 4}\n")
    assert load_catalog({ENV_VAR: path}).get("lab.1").cpus == 4


def test_deep_nesting_is_refused_not_recursed_into(tmp_path) -> None:
    path = write(tmp_path / "deep.yaml", "notes: " + "[" * 30_000 + "]" * 30_000 + "\n")
    assert "is not valid YAML: more than 10 levels of nesting" in load_error(path)


def test_an_integer_too_long_to_convert_is_refused(tmp_path) -> None:
    path = write(tmp_path / "digits.yaml", "configurations:\n  big: {gpus: " + "9" * 5000 + "}\n")
    assert "is not valid YAML: Exceeds the limit" in load_error(path)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        pytest.param(
            "configurations:\n  big: {gpus: 0x" + "f" * 5000 + "}\n",
            "configuration 'big' has gpus: a number of 20000 bits, cpus: 1",
            id="hex",
        ),
        pytest.param(
            "configurations:\n  big: {cpus: " + ":".join(["59"] * 3000) + "}\n",
            "configuration 'big' has gpus: 0, cpus: a number of 17721 bits",
            id="base-60",
        ),
        pytest.param("max_nodes: 0" + "7" * 5000 + "\n", "max_nodes: a number of 15000 bits in", id="octal"),
    ],
)
def test_huge_integers_in_other_bases_are_one_line_naming_their_size(tmp_path, text: str, expected: str) -> None:
    """PyYAML caps decimal integers at Python's 4300 digits, not hex, octal or base 60 ones,
    which Python then refuses to write out in an error message."""
    message = load_error(write(tmp_path / "huge.yaml", text))
    assert message.startswith(expected) and "\n" not in message


@pytest.mark.parametrize("name", ["a\\nb", "red\\x1b[31m", "two words", "", ".hidden"])
def test_a_name_no_header_could_hold_is_refused_in_one_line(tmp_path, name: str) -> None:
    message = load_error(write(tmp_path / "names.yaml", f'configurations:\n  "{name}": {{gpus: 1}}\n'))
    assert message.startswith("configuration name ") and "\n" not in message and "\x1b" not in message
    assert message.endswith("use letters, digits, '.', '_' and '-'")


@pytest.mark.parametrize("device", ["/dev/zero", "/dev/null", "/dev/urandom"])
def test_devices_are_refused_without_reading_them(device: str) -> None:
    assert load_error(device) == f"TAAS_CONFIG={device!r} does not name a readable file (not a regular file)"


def test_a_fifo_is_refused_without_waiting_for_a_writer(tmp_path) -> None:
    fifo = tmp_path / "pipe.yaml"
    os.mkfifo(fifo)
    assert load_error(fifo) == f"TAAS_CONFIG={str(fifo)!r} does not name a readable file (not a regular file)"


def test_a_file_larger_than_the_cap_is_refused_without_reading_it_all(tmp_path) -> None:
    path = tmp_path / "large.yaml"
    with open(path, "wb") as file:
        file.truncate(64 * 1024**2)  # 64 MiB of NULs, sparse: no disk used
    started = time.monotonic()
    assert load_error(path) == f"TAAS_CONFIG={str(path)!r} is larger than 64 KiB: a configurations file is a few lines"
    assert time.monotonic() - started < 1
    path.write_text("# padding\n" * (MAX_FILE_BYTES // 10 + 1))
    assert "is larger than 64 KiB" in load_error(path)


def test_a_file_at_the_cap_is_read(tmp_path) -> None:
    body = "configurations:\n  lab.1: {gpus: 1}\n"
    path = write(tmp_path / "full.yaml", body + "#" * (MAX_FILE_BYTES - len(body) - 1) + "\n")
    assert "lab.1" in load_catalog({ENV_VAR: path})


def test_a_file_that_is_not_utf8_is_refused(tmp_path) -> None:
    path = tmp_path / "latin.yaml"
    path.write_bytes(b"configurations:\n  caf\xe9: {gpus: 1}\n")
    assert load_error(path) == (
        f"TAAS_CONFIG={str(path)!r} does not name a readable file (not UTF-8 text: invalid continuation byte)"
    )


def test_a_broken_file_is_parsed_once_while_it_is_unchanged(tmp_path, monkeypatch) -> None:
    """The transformer asks on many cells: a broken file must not cost a parse each time."""
    from taas_magic import configurations

    path = write(tmp_path / "broken.yaml", "configurations: [\n")
    parses: list[str] = []
    real_parse = configurations._parse
    monkeypatch.setattr(
        configurations, "_parse", lambda text, origin: parses.append(origin) or real_parse(text, origin)
    )
    first, second = load_error(path), load_error(path)
    assert first == second and "is not valid YAML" in first
    assert len([origin for origin in parses if path in origin]) == 1


def test_odd_names_keep_the_natural_order_working(tmp_path) -> None:
    path = write(
        tmp_path / "names.yaml",
        "configurations:\n  g.\u00b2: {gpus: 1}\n  g.\u0662: {gpus: 1}\n  ? g." + "1" * 5000 + "\n  : {gpus: 1}\n",
    )  # a long explicit key
    names = load_catalog({ENV_VAR: path}).names()
    assert "g.\u00b2" in names and "g.\u0662" in names and len(names) == len(SHIPPED) + 3
