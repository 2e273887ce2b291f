"""`%%taas` options through the real parser into a LaunchSpec: what is accepted, and how bad input is reported."""

from __future__ import annotations

import argparse
import re
import time
from dataclasses import FrozenInstanceError, fields

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from IPython.core.error import UsageError

from taas_magic.configurations import load_catalog
from taas_magic.kernel.header import option_values, options, spec
from taas_magic.kernel.magics import TaasMagics
from taas_magic.process.machine import Machine

CATALOG = load_catalog({})
EIGHT_GPUS = Machine(cpus=16, cuda_devices=8)
NO_GPU = Machine(cpus=8, cuda_devices=0)


def build(line: str, machine: Machine = EIGHT_GPUS, environ: dict[str, str] | None = None, catalog=CATALOG):
    args = options.parse(TaasMagics.taas, line)
    return spec.build(args, catalog, machine, {} if environ is None else environ)


DEFAULTS = dict(cpus=None, units=None, output="all", timeout=None, configuration=None)

GOOD = [
    pytest.param(
        "", EIGHT_GPUS, {}, dict(world_size=1, ranks_per_node=1, device="cuda", threads_per_rank=16), id="defaults"
    ),
    pytest.param(
        "--gpus 4", EIGHT_GPUS, {}, dict(world_size=4, ranks_per_node=4, device="cuda", threads_per_rank=4), id="gpus"
    ),
    pytest.param(
        "--gpus 8",
        EIGHT_GPUS,
        {},
        dict(world_size=8, ranks_per_node=8, device="cuda", threads_per_rank=2),
        id="all-gpus",
    ),
    pytest.param(
        "--config g2.8",
        EIGHT_GPUS,
        {},
        dict(world_size=8, ranks_per_node=8, device="cuda", threads_per_rank=2, configuration="g2.8"),
        id="configuration-sets-gpus",
    ),
    pytest.param(
        "--config g2.8 --gpus 2",
        EIGHT_GPUS,
        {},
        dict(world_size=2, ranks_per_node=2, device="cuda", threads_per_rank=8, configuration="g2.8"),
        id="configuration-with-fewer-gpus",
    ),
    pytest.param(
        "--config g1.4 --gpus 3",
        EIGHT_GPUS,
        {},
        dict(world_size=3, ranks_per_node=3, device="cuda", threads_per_rank=5, configuration="g1.4"),
        id="part-of-a-node",
    ),
    pytest.param(
        "--gpus 3 --device cpu",
        NO_GPU,
        {},
        dict(world_size=3, ranks_per_node=3, device="cpu", threads_per_rank=2),
        id="cpu-ranks",
    ),
    pytest.param(
        "--gpus 32 --device cpu",
        Machine(cpus=4, cuda_devices=0),
        {},
        dict(world_size=32, ranks_per_node=32, device="cpu", threads_per_rank=1),
        id="more-ranks-than-cores-get-one-thread",
    ),
    pytest.param(
        "--gpus 256 --device cpu",
        NO_GPU,
        {},
        dict(world_size=256, ranks_per_node=256, device="cpu", threads_per_rank=1),
        id="most-cpu-ranks",
    ),
    pytest.param(
        "--config c1.4 --device cpu",
        NO_GPU,
        {},
        dict(world_size=1, ranks_per_node=1, device="cpu", threads_per_rank=8, configuration="c1.4"),
        id="cpu-configuration",
    ),
    pytest.param(
        "--config c1.8 --device cpu --gpus 8",
        NO_GPU,
        {},
        dict(world_size=8, ranks_per_node=8, device="cpu", threads_per_rank=1, configuration="c1.8"),
        id="cpu-configuration-full-node",
    ),
    pytest.param(
        "--gpus 2 --output rank0 --timeout 2.5 --cpus 0 --units 100",
        EIGHT_GPUS,
        {},
        dict(
            world_size=2,
            ranks_per_node=2,
            device="cuda",
            threads_per_rank=8,
            output="rank0",
            timeout=2.5,
            cpus=0,
            units=100,
        ),
        id="every-option",
    ),
    pytest.param(
        "--gpus=2 --timeout=1e-3 --cpus=8",
        EIGHT_GPUS,
        {},
        dict(world_size=2, ranks_per_node=2, device="cuda", threads_per_rank=8, timeout=0.001, cpus=8),
        id="equals-form",
    ),
    pytest.param(
        "",
        NO_GPU,
        {"TAAS_DEVICE": "cpu"},
        dict(world_size=1, ranks_per_node=1, device="cpu", threads_per_rank=8),
        id="TAAS_DEVICE-cpu",
    ),
    pytest.param(
        "",
        NO_GPU,
        {"TAAS_DEVICE": " CPU "},
        dict(world_size=1, ranks_per_node=1, device="cpu", threads_per_rank=8),
        id="TAAS_DEVICE-spaced-upper",
    ),
    pytest.param(
        "--device cuda --gpus 2",
        EIGHT_GPUS,
        {"TAAS_DEVICE": "cpu"},
        dict(world_size=2, ranks_per_node=2, device="cuda", threads_per_rank=8),
        id="option-beats-TAAS_DEVICE",
    ),
    pytest.param(
        "--gpus 2",
        EIGHT_GPUS,
        {"OMP_NUM_THREADS": "3"},
        dict(world_size=2, ranks_per_node=2, device="cuda", threads_per_rank=3),
        id="OMP_NUM_THREADS-kept",
    ),
    pytest.param(
        "--gpus 2",
        EIGHT_GPUS,
        {"OMP_NUM_THREADS": "0"},
        dict(world_size=2, ranks_per_node=2, device="cuda", threads_per_rank=8),
        id="OMP_NUM_THREADS-zero",
    ),
    pytest.param(
        "--gpus 2",
        EIGHT_GPUS,
        {"OMP_NUM_THREADS": "many"},
        dict(world_size=2, ranks_per_node=2, device="cuda", threads_per_rank=8),
        id="OMP_NUM_THREADS-word",
    ),
    pytest.param(
        "--gpus 2",
        EIGHT_GPUS,
        {"OMP_NUM_THREADS": "\u00b2"},
        dict(world_size=2, ranks_per_node=2, device="cuda", threads_per_rank=8),
        id="OMP_NUM_THREADS-superscript",
    ),
]


@pytest.mark.parametrize(("line", "machine", "environ", "expected"), GOOD)
def test_good_lines_build_the_expected_spec(line: str, machine: Machine, environ: dict, expected: dict) -> None:
    launch = build(line, machine, environ)
    wanted = {**DEFAULTS, **expected}
    got = {name: getattr(launch, name) for name in wanted}
    got["configuration"] = launch.configuration.name if launch.configuration else None
    assert got == wanted
    assert launch.nodes == 1
    assert launch.master_addr == "127.0.0.1"


def test_spec_flags_and_immutability() -> None:
    many = build("--gpus 2")
    assert many.show_rank_prefix and not many.data_options_given
    assert not build("--gpus 2 --output rank0").show_rank_prefix
    assert not build("").show_rank_prefix  # one rank: nothing to tell apart
    assert build("--cpus 0").data_options_given and build("--units 1").data_options_given
    with pytest.raises(FrozenInstanceError):
        many.world_size = 3  # type: ignore[misc]


def test_spec_checks_its_own_arithmetic() -> None:
    with pytest.raises(ValueError, match="world_size 3 != 1 nodes x 2"):
        spec.LaunchSpec(
            world_size=3,
            nodes=1,
            ranks_per_node=2,
            device="cpu",
            configuration=None,
            cpus=None,
            units=None,
            output="all",
            timeout=None,
            threads_per_rank=1,
        )


BAD = [
    pytest.param(
        "--foo",
        EIGHT_GPUS,
        {},
        ["'--foo'", "--gpus", "--cpus", "--units", "--config", "--device", "--output", "--timeout"],
        id="unknown-option",
    ),
    pytest.param("junk", EIGHT_GPUS, {}, ["'junk'", "--gpus"], id="positional-junk"),
    pytest.param("--gpus 2 junk", EIGHT_GPUS, {}, ["'junk'", "--gpus"], id="junk-after-options"),
    pytest.param("--gpus 0", EIGHT_GPUS, {}, ["0 is out of range", "1 or more"], id="gpus-0"),
    pytest.param("--gpus -2", EIGHT_GPUS, {}, ["-2 is out of range", "1 or more"], id="gpus-negative"),
    pytest.param("--gpus x", EIGHT_GPUS, {}, ["'x' is not a whole number", "1 or more"], id="gpus-word"),
    pytest.param("--gpus 2.5", EIGHT_GPUS, {}, ["'2.5' is not a whole number", "1 or more"], id="gpus-fraction"),
    pytest.param("--gpus", EIGHT_GPUS, {}, ["--gpus", "expected one argument"], id="gpus-without-value"),
    pytest.param(
        "--gpus 12 --config g2.8",
        EIGHT_GPUS,
        {},
        ["--gpus 12 does not fit g2.8 (8 GPUs per node): use 1-8, 16 or 32"],
        id="gpus-12-on-g2.8",
    ),
    pytest.param(
        "--gpus 16 --config g2.8",
        EIGHT_GPUS,
        {},
        ["--gpus 16 needs 2 nodes of g2.8", "multi-node runs need a cluster", "this machine is one node", "--gpus 1-8"],
        id="gpus-16-needs-a-cluster",
    ),
    pytest.param(
        "--gpus 32 --config g2.8", EIGHT_GPUS, {}, ["--gpus 32 needs 4 nodes", "cluster"], id="gpus-32-needs-a-cluster"
    ),
    pytest.param(
        "--gpus 64 --config g2.8",
        EIGHT_GPUS,
        {},
        ["--gpus 64 does not fit", "1-8, 16 or 32"],
        id="gpus-64-more-than-max-nodes",
    ),
    pytest.param(
        "--gpus 9 --config c1.8 --device cpu",
        NO_GPU,
        {},
        ["--gpus 9 does not fit c1.8 (8 vCPUs per node): use 1-8, 16 or 32"],
        id="cpu-configuration-too-big",
    ),
    pytest.param("--gpus 257 --device cpu", NO_GPU, {}, ["--gpus 257", "1-256"], id="too-many-cpu-ranks"),
    pytest.param("--cpus 9", EIGHT_GPUS, {}, ["9 is out of range", "0-8"], id="cpus-9"),
    pytest.param("--cpus -1", EIGHT_GPUS, {}, ["-1 is out of range", "0-8"], id="cpus-negative"),
    pytest.param("--units -1", EIGHT_GPUS, {}, ["-1 is out of range", "1 or more"], id="units-negative"),
    pytest.param("--units 0", EIGHT_GPUS, {}, ["0 is out of range", "1 or more"], id="units-0"),
    pytest.param("--timeout 0", EIGHT_GPUS, {}, ["0 is not allowed", "greater than 0"], id="timeout-0"),
    pytest.param("--timeout nan", EIGHT_GPUS, {}, ["nan is not allowed", "greater than 0"], id="timeout-nan"),
    pytest.param("--timeout inf", EIGHT_GPUS, {}, ["inf is not allowed", "greater than 0"], id="timeout-inf"),
    pytest.param(
        "--timeout abc", EIGHT_GPUS, {}, ["'abc' is not a number of seconds", "greater than 0"], id="timeout-word"
    ),
    pytest.param(
        "--config g9.9",
        EIGHT_GPUS,
        {},
        ["unknown configuration 'g9.9': known are c1.4, c1.8, c1.32, c1.80, g1.1, g1.2, g1.4, g2.1, g2.2, g2.4, g2.8"],
        id="unknown-configuration",
    ),
    pytest.param("--device gpu", EIGHT_GPUS, {}, ["'gpu'", "auto", "cuda", "cpu"], id="device-gpu"),
    pytest.param("--output none", EIGHT_GPUS, {}, ["'none'", "all", "rank0"], id="output-none"),
    pytest.param(
        "--gpus 'unclosed", EIGHT_GPUS, {}, ["cannot split the options", "No closing quotation"], id="unclosed-quote"
    ),
    pytest.param(
        "", NO_GPU, {}, ["no CUDA device is visible", "--device cpu", "TAAS_DEVICE=cpu"], id="auto-without-cuda"
    ),
    pytest.param(
        "--device cuda",
        NO_GPU,
        {},
        ["no CUDA device is visible", "--device cpu", "TAAS_DEVICE=cpu"],
        id="cuda-without-cuda",
    ),
    pytest.param(
        "--gpus 4 --device cuda",
        Machine(cpus=8, cuda_devices=2),
        {},
        ["--gpus 4 needs 4 CUDA devices, this machine has 2: use --gpus 1-2, or --device cpu"],
        id="more-gpus-than-devices",
    ),
    pytest.param(
        "--config g2.8",
        Machine(cpus=8, cuda_devices=2),
        {},
        ["--gpus 8 needs 8 CUDA devices"],
        id="configuration-larger-than-machine",
    ),
    pytest.param(
        "--config c1.4",
        EIGHT_GPUS,
        {},
        ["c1.4 has no GPUs: run its ranks on CPU with --device cpu"],
        id="cpu-configuration-on-cuda",
    ),
    pytest.param(
        "--config c1.4 --device cuda",
        EIGHT_GPUS,
        {},
        ["c1.4 has no GPUs", "--device cpu"],
        id="cpu-configuration-explicit-cuda",
    ),
    pytest.param(
        "",
        EIGHT_GPUS,
        {"TAAS_DEVICE": "gpu"},
        ["TAAS_DEVICE='gpu' is not allowed: use auto, cuda, cpu"],
        id="TAAS_DEVICE-gpu",
    ),
    pytest.param(
        "--gpus 2 --debug-ranks 5",
        EIGHT_GPUS,
        {},
        ["--debug-ranks 5: the run has ranks 0-1, not rank 5"],
        id="debug-ranks-outside-the-run",
    ),
    pytest.param(
        "--gpus 2 --debug-ranks",
        EIGHT_GPUS,
        {},
        ["--debug-ranks", "expected one argument"],
        id="debug-ranks-without-value",
    ),
    pytest.param("--gpus 2 --debug-ranks one", EIGHT_GPUS, {}, ["--debug-ranks", "'one'"], id="debug-ranks-word"),
]


@pytest.mark.parametrize(("line", "machine", "environ", "fragments"), BAD)
def test_bad_lines_are_one_line_usage_errors(line: str, machine: Machine, environ: dict, fragments: list[str]) -> None:
    with pytest.raises(UsageError) as raised:
        build(line, machine, environ)
    message = str(raised.value)
    assert "\n" not in message
    for fragment in fragments:
        assert fragment in message


def test_hidden_check_option_is_not_advertised() -> None:
    with pytest.raises(UsageError) as raised:
        build("--frobnicate")
    assert "--check" not in str(raised.value)
    assert options.parse(TaasMagics.taas, "--check g2.8").check == "g2.8"


def test_max_nodes_from_the_catalog_limits_the_suggestions(tmp_path) -> None:
    path = tmp_path / "two-nodes.yaml"
    path.write_text("max_nodes: 2\n")
    catalog = load_catalog({"TAAS_CONFIG": str(path)})
    with pytest.raises(UsageError, match=r"^--gpus 12 does not fit g2.8 \(8 GPUs per node\): use 1-8 or 16$"):
        build("--gpus 12 --config g2.8", catalog=catalog)
    with pytest.raises(UsageError, match=r"^--gpus 32 does not fit g2.8"):
        build("--gpus 32 --config g2.8", catalog=catalog)


# Property: whatever the line, the machine and the environment, the outcome is a spec or a UsageError.

OPTION_NAMES = [
    "--gpus",
    "--cpus",
    "--units",
    "--config",
    "--device",
    "--output",
    "--timeout",
    "--check",
    "--gp",
    "--c",
    "--foo",
    "-g",
    "-",
    "--",
    "-h",
]
VALUES = st.one_of(
    st.integers(-10, 3000).map(str),
    st.floats(allow_nan=True, allow_infinity=True).map(repr),
    st.sampled_from(
        CATALOG.names()
        + list(options.DEVICES)
        + list(options.OUTPUTS)
        + ["", "''", "nan", "-inf", "1e400", "'", '"', "\\", "{GPUS}", "$x", "\u00b2", "\u0663", "1_0"]
    ),
    st.text(max_size=6),
)
TOKENS = st.one_of(
    st.sampled_from(OPTION_NAMES),
    VALUES,
    st.builds(lambda name, value: f"{name}={value}", st.sampled_from(OPTION_NAMES), VALUES),
)
OPTION_LINES = st.lists(TOKENS, max_size=10).map(" ".join)
MACHINES = st.builds(Machine, cpus=st.integers(1, 256), cuda_devices=st.integers(0, 16))
ENVIRONS = st.fixed_dictionaries(
    {},
    optional={
        "TAAS_DEVICE": st.one_of(st.sampled_from(["cpu", "cuda", "auto", "gpu", "", " CPU "]), st.text(max_size=4)),
        "OMP_NUM_THREADS": st.one_of(
            st.integers(-2, 64).map(str), st.sampled_from([" 4", "4.0", "\u00b2", "\u0663"]), st.text(max_size=4)
        ),
    },
)


def spec_or_usage_error(line: str, machine: Machine, environ: dict[str, str]) -> None:
    try:
        launch = build(line, machine, environ)
    except UsageError as e:
        assert str(e)
        return
    assert isinstance(launch, spec.LaunchSpec)
    assert launch.device in ("cuda", "cpu")
    assert launch.world_size >= 1 and launch.nodes == 1 and launch.ranks_per_node == launch.world_size
    assert launch.threads_per_rank >= 1
    assert launch.output in options.OUTPUTS
    if launch.device == "cuda":
        assert launch.world_size <= machine.cuda_devices
    else:
        assert launch.world_size <= spec.MAX_CPU_RANKS


@settings(max_examples=300, deadline=None)
@given(line=st.text(max_size=40), machine=MACHINES, environ=ENVIRONS)
def test_any_text_gives_a_spec_or_a_usage_error(line: str, machine: Machine, environ: dict[str, str]) -> None:
    spec_or_usage_error(line, machine, environ)


@settings(max_examples=300, deadline=None)
@given(line=OPTION_LINES, machine=MACHINES, environ=ENVIRONS)
def test_any_option_like_line_gives_a_spec_or_a_usage_error(
    line: str, machine: Machine, environ: dict[str, str]
) -> None:
    spec_or_usage_error(line, machine, environ)


def test_quotes_group_words_and_are_removed():
    from taas_magic.kernel.header import options as opts
    from taas_magic.kernel.magics import TaasMagics

    assert opts.parse(TaasMagics.taas, "--config 'g2.8' --return 'a, b'").config == "g2.8"
    assert opts.parse(TaasMagics.taas, "--return 'a, b'").return_names == ("a", "b")


def test_abbreviated_options_are_not_guessed():
    from IPython.core.error import UsageError

    from taas_magic.kernel.header import options as opts
    from taas_magic.kernel.magics import TaasMagics

    with pytest.raises(UsageError, match="unknown option '--gp'"):
        opts.parse(TaasMagics.taas, "--gp 2")


# Numbers are plain ASCII digits: int() and float() also take other scripts, "_" and "+".


@pytest.mark.parametrize("value", ["\uff12", "\u0662", "0_2", "+2", " 2", "2 ", "2.0", "0x2", "²", "1e1", ""])
@pytest.mark.parametrize("option", ["--gpus", "--units", "--prefetch", "--cpus"])
def test_whole_numbers_are_plain_ascii_digits(option: str, value: str) -> None:
    with pytest.raises(UsageError) as raised:
        options.parse(TaasMagics.taas, f"{option}={value!r}")  # quoted: spaces and all reach the converter
    assert str(raised.value) == f"argument {option}: {value!r} is not a whole number: use " + (
        "0-8 (0 turns data delivery off)" if option == "--cpus" else "a whole number of 1 or more"
    )


def test_whole_numbers_in_plain_digits_are_accepted() -> None:
    parsed = options.parse(TaasMagics.taas, "--gpus 02 --units 1000000 --prefetch 3 --cpus 0")
    assert (parsed.gpus, parsed.units, parsed.prefetch, parsed.cpus) == (2, 1_000_000, 3, 0)
    padded = options.parse(TaasMagics.taas, f"--gpus {'0' * 40}2 --cpus {'0' * 40}")  # zeros in front count for nothing
    assert (padded.gpus, padded.cpus) == (2, 0)


def test_a_count_with_too_many_digits_is_out_of_range() -> None:
    with pytest.raises(UsageError) as raised:
        options.parse(TaasMagics.taas, f"--units {'9' * 4000}")
    assert str(raised.value) == f"argument --units: {'9' * 40}... is out of range: use a whole number of 1 or more"
    with pytest.raises(argparse.ArgumentTypeError, match="is out of range"):
        option_values.whole_number(1)("9" * 5000)  # more digits than int() converts from text


@pytest.mark.parametrize("value", ["1_0", "\u0662", "\uff12", "+2", " 2", "0x10", "1e", ".", "-", "2s"])
def test_seconds_are_plain_ascii_decimals(value: str) -> None:
    with pytest.raises(UsageError) as raised:
        options.parse(TaasMagics.taas, f"--timeout={value!r}")
    assert str(raised.value) == (
        f"argument --timeout: {value!r} is not a number of seconds: use a number of seconds greater than 0"
    )


@pytest.mark.parametrize(
    ("value", "expected"), [("10", 10.0), ("1.5", 1.5), (".5", 0.5), ("5.", 5.0), ("2e-3", 0.002), ("1E2", 100.0)]
)
def test_seconds_in_plain_decimals_are_accepted(value: str, expected: float) -> None:
    assert options.parse(TaasMagics.taas, f"--timeout {value}").timeout == expected


@pytest.mark.parametrize("value", ["-inf", "Infinity", "NaN", "1e400", "1e-400", "-0.5"])
def test_seconds_that_are_not_a_positive_finite_number_are_refused_by_name(value: str) -> None:
    with pytest.raises(UsageError, match=rf"^argument --timeout: {re.escape(value)} is not allowed: use a number"):
        options.parse(TaasMagics.taas, f"--timeout={value}")


def test_a_huge_option_line_is_refused_before_it_is_split() -> None:
    line = "--gpus 2 " + "a " * 500_000  # what `{X}` with X = 'a ' * 500000 expands to
    started = time.monotonic()
    with pytest.raises(UsageError) as raised:
        options.parse(TaasMagics.taas, line)
    assert time.monotonic() - started < 0.5
    assert str(raised.value) == (
        f"the options are {len(line)} characters long ('--gpus 2 a a a a a a a a a a a a a a a "
        f"a...'): use at most {options.MAX_LINE}"
    )


def test_an_option_line_of_the_largest_length_is_parsed() -> None:
    line = "--gpus 2" + " " * (options.MAX_LINE - len("--gpus 2"))
    assert options.parse(TaasMagics.taas, line).gpus == 2
    with pytest.raises(UsageError, match="the options are 4097 characters long"):
        options.parse(TaasMagics.taas, line + " ")


def test_long_values_are_cut_short_in_messages() -> None:
    with pytest.raises(UsageError) as raised:
        options.parse(TaasMagics.taas, "--" + "x" * 3000)
    assert str(raised.value).startswith(f"unknown option '--{'x' * 38}...': allowed are --gpus")


# One machine, one GPU, one node's worth: ranges never read "1-1".

ONE_GPU = Machine(cpus=8, cuda_devices=1)


def catalog_from(tmp_path, text: str):
    path = tmp_path / "configurations.yaml"
    path.write_text(text)
    return load_catalog({"TAAS_CONFIG": str(path)})


def test_one_gpu_machine_says_use_gpus_1() -> None:
    with pytest.raises(UsageError) as raised:
        build("--gpus 2", ONE_GPU)
    assert str(raised.value) == "--gpus 2 needs 2 CUDA devices, this machine has 1: use --gpus 1, or --device cpu"
    assert build("--gpus 1", ONE_GPU).world_size == 1


def test_one_gpu_configuration_says_use_1() -> None:
    with pytest.raises(UsageError) as raised:
        build("--gpus 3 --config g1.1")
    assert str(raised.value) == "--gpus 3 does not fit g1.1 (1 GPU per node): use 1, 2 or 4"
    with pytest.raises(UsageError) as raised:
        build("--gpus 2 --config g2.1")
    assert str(raised.value) == (
        "--gpus 2 needs 2 nodes of g2.1: multi-node runs need a cluster (%taas cluster "
        "ADDRESS), and this machine is one node: use --gpus 1"
    )


def test_one_vcpu_configuration_says_use_1(tmp_path) -> None:
    catalog = catalog_from(tmp_path, "max_nodes: 1\nconfigurations:\n  tiny: {gpus: 0, cpus: 1}\n")
    with pytest.raises(UsageError) as raised:
        build("--gpus 2 --config tiny --device cpu", NO_GPU, catalog=catalog)
    assert str(raised.value) == "--gpus 2 does not fit tiny (1 vCPU per node): use 1"


def test_cpu_rank_limit_holds_whatever_the_configuration_says(tmp_path) -> None:
    catalog = catalog_from(tmp_path, "configurations:\n  wide: {gpus: 0, cpus: 512}\n  many: {gpus: 64, cpus: 8}\n")
    with pytest.raises(UsageError) as raised:
        build("--gpus 300 --device cpu --config wide", NO_GPU, catalog=catalog)
    assert str(raised.value) == f"--gpus 300 is too many CPU ranks for one machine: use 1-{spec.MAX_CPU_RANKS}"
    assert build("--gpus 256 --device cpu --config wide", NO_GPU, catalog=catalog).world_size == 256
    assert build("--device cpu --config many", NO_GPU, catalog=catalog).world_size == 64


def cluster_build(line: str, catalog=CATALOG):
    """A spec as a kernel connected to a cluster builds it: this machine's GPUs do not matter."""
    return spec.build(options.parse(TaasMagics.taas, line), catalog, NO_GPU, {}, connected=True)


def test_profile_is_for_a_clusters_runs_as_for_this_machines() -> None:
    assert cluster_build("--config g2.8 --gpus 16 --profile").profile
    assert cluster_build("--gpus 2 --device cpu --on local --profile").profile
    assert not cluster_build("--gpus 2 --device cpu --on local").profile


@pytest.mark.parametrize(
    ("line", "nodes", "per_node", "threads"),
    [
        ("--config g2.8 --gpus 16", 2, 8, 28),
        ("--config g2.8 --gpus 32", 4, 8, 28),
        ("--config g2.8 --gpus 8", 1, 8, 28),
        ("--config g2.8 --gpus 2", 1, 2, 112),
        ("--config g2.8", 1, 8, 28),
    ],
)
def test_a_connected_kernel_spreads_a_run_over_whole_nodes(line: str, nodes: int, per_node: int, threads: int) -> None:
    built = cluster_build(line)
    assert (built.on_cluster, built.nodes, built.ranks_per_node, built.threads_per_rank) == (
        True,
        nodes,
        per_node,
        threads,
    )


@pytest.mark.parametrize(
    ("line", "fragment"),
    [
        ("--config g2.8 --gpus 12", "--gpus 12 does not fit g2.8 (8 GPUs per node): use 1-8, 16 or 32"),
        ("--config g2.8 --gpus 64", "--gpus 64 does not fit g2.8"),
        ("--gpus 2", "a run on the cluster needs a configuration"),
    ],
)
def test_cluster_runs_that_fit_no_whole_number_of_nodes_are_refused(line: str, fragment: str) -> None:
    with pytest.raises(UsageError, match=re.escape(fragment)):
        cluster_build(line)


def test_on_local_and_on_cluster_choose_where_a_connected_or_unconnected_kernel_runs() -> None:
    assert not cluster_build("--config g2.8 --gpus 2 --on local --device cpu").on_cluster
    with pytest.raises(UsageError, match="--gpus 16 needs 2 nodes of g2.8: multi-node runs need a cluster"):
        cluster_build("--config g2.8 --gpus 16 --on local --device cpu")
    with pytest.raises(UsageError, match="--on cluster: no cluster is connected"):
        build("--config g2.8 --on cluster")


def test_a_configuration_alone_on_a_cluster_is_one_process_on_cpu_for_a_cpu_configuration() -> None:
    alone = cluster_build("--config c1.32 --alone")
    assert (alone.world_size, alone.device, alone.threads_per_rank, alone.on_cluster) == (1, "cpu", 32, True)


def test_debug_ranks_are_every_rank_unless_given() -> None:
    assert build("--gpus 4").debug_ranks is None
    assert build("--gpus 4 --debug-ranks 3,1").debug_ranks == (1, 3)
    assert build("--gpus 4 --debug-ranks 0-2").debug_ranks == (0, 1, 2)


def test_the_typed_options_are_the_parsers_options_one_for_one():
    """``spec.build`` reads the options through ``CellOptions``, without defaults of its own: an option added to
    the parser and not to the type (or the other way round) fails here, not as a silent default."""
    parsed = options.parse(TaasMagics.taas, "")
    assert set(vars(parsed)) == {field.name for field in fields(options.CellOptions)}
    typed = options.CellOptions.of(parsed)
    assert typed.order == "deterministic" and typed.max_restarts == 0 and typed.keep is False
    for option, allowed in [("--device", options.DEVICES), ("--order", options.ORDERS), ("--on", options.PLACES)]:
        assert options.offered_values(TaasMagics.taas, option) == list(allowed), option
    assert set(options.offered_values(TaasMagics.taas, "--start")) == set(options.STARTS)


@given(st.sampled_from(options.DEVICES + (None,)), st.sampled_from(options.STARTS + options.OLD_STARTS + (None,)))
def test_every_device_and_start_a_line_names_builds_a_spec_with_a_resolved_device_and_a_current_start(device, start):
    line = " ".join(f"--{name} {value}" for name, value in [("device", device), ("start", start)] if value)
    built = build(line + " --gpus 2", machine=EIGHT_GPUS)
    assert built.device in ("cuda", "cpu") and built.start in options.STARTS
