"""The cell syntax in a real kernel: which cells become taas runs, bad input, and the extension's registrations."""

from __future__ import annotations

import pytest
from support.kernel import Kernel


def test_a_shebang_that_is_not_a_configuration_runs_as_an_ordinary_cell(kernel):
    result = kernel.execute("#!/usr/bin/env python\nimport os\nx_plain = os.getpid()\nprint('plain')").ok()
    assert result.stdout == "plain\n"
    assert kernel.value("x_plain == os.getpid()") is True


def test_a_configuration_line_alone_runs_in_the_kernel_with_one_warning(no_gpu_kernel):
    result = no_gpu_kernel.execute("#!g2.8\nx_config = os.getpid()\nx_config").ok()
    assert result.stderr == "taas: g2.8 needs 8 GPUs, this machine has 0: running the cell in the kernel anyway\n"
    assert no_gpu_kernel.value("x_config == os.getpid()") is True
    assert result.displays and result.displays[0]["text/plain"] == str(no_gpu_kernel.value("x_config"))
    single = no_gpu_kernel.execute("#!g1.1\npass").ok()
    assert single.stderr == "taas: g1.1 needs 1 GPU, this machine has 0: running the cell in the kernel anyway\n"


def test_a_pragma_below_code_is_an_error_and_the_cell_does_not_run(kernel):
    result = kernel.execute("x_misplaced = 1\n#pragma taas --gpus 2\nprint('ran')")
    assert result.error["ename"] in ("UsageError", "TaasUsageError")
    assert "line 2" in result.error["evalue"] and "top of the cell" in result.error["evalue"]
    assert "ran" not in result.stdout
    assert kernel.value("'x_misplaced' in globals()") is False


def test_pragma_options_expand_notebook_variables(kernel):
    kernel.execute("GPUS = 3").ok()
    result = kernel.execute("#!g2.8\n#pragma taas --gpus {GPUS}\nimport taas\nprint(taas.world_size())").ok()
    assert result.each_rank().count("3\n") == 3
    result = kernel.execute("#pragma taas --gpus $GPUS --output rank0\nimport taas\nprint(taas.world_size())").ok()
    assert result.stdout == "3\n"
    # From a function, its own local names expand, as IPython expands them for any magic.
    result = kernel.execute(
        "def launch(ranks):\n    get_ipython().run_cell_magic('taas', '--gpus $ranks --output rank0', "
        "'import taas\\nprint(taas.world_size())')\nlaunch(2)"
    ).ok()
    assert result.stdout == "2\n"


def test_the_cell_magic_works_without_the_pragma(kernel):
    assert kernel.execute("%%taas --gpus 2 --output rank0\nprint('via magic')").ok().stdout == "via magic\n"


def test_ipython_syntax_inside_a_taas_cell(kernel):
    result = kernel.execute(
        "#pragma taas --gpus 2 --output rank0\nx = %time 1 + 1\nfiles = !echo shell-escape\nprint(files)"
    )
    assert "shell-escape" in result.ok().stdout


def test_a_syntax_error_is_reported_before_any_rank_starts(kernel):
    result = kernel.execute("#pragma taas --gpus 2\nprint('started')\ndef broken(:\n")
    assert result.error["ename"] == "SyntaxError"
    assert "started" not in result.stdout
    assert kernel.children() == []


@pytest.mark.parametrize(
    "header, expected",
    [
        ("#pragma taas --gpus 0", "argument --gpus: 0 is out of range: use a whole number of 1 or more"),
        ("#pragma taas --gpus two", "argument --gpus: 'two' is not a whole number: use a whole number of 1 or more"),
        ("#!g2.8\n#pragma taas --gpus 12", "--gpus 12 does not fit g2.8 (8 GPUs per node): use 1-8, 16 or 32"),
        ("#!g2.8\n#pragma taas --gpus 16", "--gpus 16 needs 2 nodes of g2.8"),
        ("#pragma taas --cpus 9", "argument --cpus: 9 is out of range: use 0-8 (0 turns data delivery off)"),
        ("#pragma taas --units -1", "argument --units: -1 is out of range: use a whole number of 1 or more"),
        ("#pragma taas --frobnicate", "unknown option '--frobnicate': allowed are --gpus, --config, --device"),
        ("#!g9.9\n#pragma taas", "unknown configuration 'g9.9': known are c1.4"),
        (
            "#pragma taas --device auto",
            "no CUDA device is visible on this machine: run the ranks on CPU with --device cpu",
        ),
        ("#pragma taas --device cuda --gpus 2", "no CUDA device is visible"),
        ("#pragma taas --timeout -1", "argument --timeout: -1 is not allowed: use a number of seconds greater than 0"),
        # what a lone `#!NAME` line becomes is no option of the user's
        ("#pragma taas --gpus 3 --alone", "unknown option '--alone': allowed are --gpus, --config, --device"),
        ("#pragma taas --gpus 2 --check g2.8", "unknown option '--check': allowed are --gpus, --config, --device"),
        ("%%taas --gpus 2 --alone", "unknown option '--alone': allowed are --gpus"),
        ("#pragma taas --gpus 2 --config ''", "unknown configuration '': known are c1.4"),
    ],
    ids=[
        "gpus-0",
        "gpus-nan",
        "gpus-12-g2.8",
        "gpus-16-multinode",
        "cpus-9",
        "units-neg",
        "unknown-option",
        "unknown-config",
        "auto-without-cuda",
        "cuda-without-cuda",
        "timeout-neg",
        "alone",
        "check",
        "alone-in-magic",
        "empty-config",
    ],
)
def test_bad_input_is_one_line_naming_the_value_and_nothing_starts(no_gpu_kernel, header, expected):
    result = no_gpu_kernel.execute(header + "\nprint('started')")
    assert result.error is not None and result.error["ename"] in ("UsageError", "TaasUsageError")
    assert expected in result.error["evalue"]
    assert "\n" not in result.error["evalue"]
    assert "started" not in result.stdout
    assert no_gpu_kernel.children() == []


def test_data_options_without_a_registered_loader_say_they_have_no_effect(kernel):
    result = kernel.execute("#pragma taas --gpus 2 --cpus 2 --units 100\nprint('ran')").ok()
    assert result.each_rank().count("] ran\n") == 2
    assert result.stderr == (
        "taas: --cpus/--units/--order/--prefetch have no effect: the cell uses no registered DataLoader "
        "(taas.register(loader) in an earlier cell)\n"
    )


def test_line_magic_shows_the_effective_settings(no_gpu_kernel):
    text = no_gpu_kernel.execute("%taas").ok().stdout
    for expected in (
        "fork",
        "configurations.yaml",
        "g2.8",
        "CUDA devices:        0 visible",
        "default --device:    cpu",
    ):
        assert expected in text


def test_help_lists_every_option(kernel):
    result = kernel.execute("%%taas?\n").ok()
    text = "".join(page["data"]["text/plain"] for page in result.reply["payload"] if page.get("source") == "page")
    for option in ("--gpus", "--cpus", "--units", "--config", "--device", "--output", "--timeout"):
        assert option in text


def test_unload_removes_every_registration_and_reload_registers_once(kernel):
    count = "len([t for t in get_ipython().input_transformers_cleanup if type(t).__name__ == 'PragmaTransformer'])"
    magics = (
        "('taas' in get_ipython().magics_manager.magics['cell'], 'taas' in get_ipython().magics_manager.magics['line'])"
    )
    others = (
        "(sum(type(c).__name__ == 'TaasMagics' for c in get_ipython().configurables), "
        "sorted(k for k in get_ipython().strdispatchers['complete_command'].strs if 'taas' in k))"
    )
    assert kernel.value(count) == 1
    kernel.execute("%reload_ext taas_magic").ok()
    kernel.execute("%reload_ext taas_magic").ok()
    assert kernel.value(count) == 1 and kernel.value(magics) == (True, True)
    assert kernel.value(others) == (1, ["%%taas", "%taas"]), "one configurable, one completer per magic"
    kernel.execute("%unload_ext taas_magic").ok()
    assert kernel.value(count) == 0 and kernel.value(magics) == (False, False)
    assert kernel.value(others) == (0, [])
    # Unloaded, a pragma cell is an ordinary cell again.
    assert kernel.execute("#pragma taas --gpus 2\nprint('in the kernel')").ok().stdout == "in the kernel\n"
    kernel.execute("%load_ext taas_magic").ok()
    assert kernel.value(count) == 1


def test_a_broken_configurations_file_is_reported_by_the_cell(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("configurations: [not, a, mapping]\n")
    k = Kernel({"TAAS_CONFIG": str(bad)}, warm_fork_server=False)
    try:
        result = k.execute("#pragma taas --config g2.8\nprint('x')")
        assert result.error["ename"] in ("UsageError", "TaasUsageError")
        assert str(bad) in result.error["evalue"]
    finally:
        k.shutdown()


# Bad input is a quick one-line error, never a hang or a huge run; the kernel stays usable.


def assert_refused_in_one_line(kernel, result, expected: str) -> None:
    assert result.error is not None and result.error["ename"] in ("UsageError", "TaasUsageError")
    assert expected in result.error["evalue"]
    assert "\n" not in result.error["evalue"]
    assert result.seconds < 5
    assert "started" not in result.stdout
    assert kernel.children() == []


@pytest.mark.parametrize(
    "value", ["\uff12", "\u0662", "0_2", "+2"], ids=["fullwidth", "arabic-indic", "underscore", "plus"]
)
def test_gpus_written_other_than_in_ascii_digits_is_refused_like_a_word(kernel, value):
    result = kernel.execute(f"#pragma taas --gpus {value}\nprint('started')")
    assert_refused_in_one_line(
        kernel, result, f"argument --gpus: {value!r} is not a whole number: use a whole number of 1 or more"
    )


def test_timeout_written_other_than_in_ascii_digits_is_refused(kernel):
    result = kernel.execute("#pragma taas --gpus 2 --timeout 1_0\nprint('started')")
    assert_refused_in_one_line(kernel, result, "argument --timeout: '1_0' is not a number of seconds")


def test_a_header_that_expands_to_a_megabyte_is_refused_at_once(kernel):
    kernel.execute("X_LONG = 'a ' * 500000").ok()
    try:
        result = kernel.execute("#pragma taas --gpus 2 {X_LONG}\nprint('started')", timeout=30)
        assert_refused_in_one_line(kernel, result, "the options are 1000009 characters long ('--gpus 2 a a a")
        assert result.error["evalue"].endswith(": use at most 4096")
    finally:
        kernel.execute("del X_LONG").ok()


@pytest.mark.timing
def test_a_megabyte_line_in_the_body_runs_in_seconds(kernel):
    line = "s_long = '" + "a" * 1_000_000 + "'\n"
    result = kernel.execute(f"#pragma taas --gpus 2 --output rank0 --return none\n{line}print(len(s_long))", timeout=60)
    assert result.ok().stdout == "1000000\n"
    assert result.seconds < 5
    result = kernel.execute(f"{line}#pragma taas --gpus 2\nprint(len(s_long))", timeout=60)
    assert "#pragma taas on line 2 must be at the top" in result.error["evalue"]
    assert result.seconds < 5


def test_a_pragma_inside_a_multi_line_string_of_an_ordinary_cell_is_text(kernel):
    result = kernel.execute('doc_pragma = """\n#pragma taas --gpus 2\n"""\nprint(doc_pragma.strip())').ok()
    assert result.stdout == "#pragma taas --gpus 2\n"
    assert kernel.children() == []


def test_line_numbers_count_the_blank_lines_above_the_header(kernel):
    result = kernel.execute("\n\n#!g2.8\nx_blank = 1\n#pragma taas --gpus 2")
    assert result.error["evalue"].startswith("#pragma taas on line 5 must be at the top of the cell")
    result = kernel.execute("\n\n#pragma taas --gpus 2\nx_blank = 1\nraise ValueError('on line 5')")
    assert result.error["ename"] == "RankFailed"
    assert "line 5" in result.traceback and "line 3" not in result.traceback


def test_bad_configurations_files_are_quick_one_line_errors_and_other_cells_still_run(tmp_path):
    files = {
        "huge.yaml": "configurations:\n  big: {gpus: 100000000000000000000, cpus: 8}\n",
        "inf.yaml": "configurations:\n  big: {gpus: .inf}\n",
        "nan.yaml": "configurations:\n  big: {gpus: 1, memory_gb: .nan}\n",
        "laughs.yaml": "configurations:\n  big: {gpus: 1}\na: &a [lol, lol, lol, lol, lol, lol, lol, lol, lol]\n"
        + "".join(f"{b}: &{b} [{', '.join(['*' + a] * 9)}]\n" for a, b in zip("abcdefgh", "bcdefghi")),
        "wide.yaml": "configurations:\n  big: {gpus: 0, cpus: 512}\n",
    }
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    cases = [
        (tmp_path / "huge.yaml", "--device cpu", "configuration 'big' has gpus: 100000000000000000000"),
        (
            tmp_path / "inf.yaml",
            "--device cpu",
            "configuration 'big' has a bad field (gpus: inf is not a whole number)",
        ),
        (tmp_path / "nan.yaml", "--device cpu", "memory_gb: nan in"),
        (tmp_path / "laughs.yaml", "--device cpu", "is not valid YAML: aliases (*name) are not allowed"),
        ("/dev/zero", "--device cpu", "TAAS_CONFIG='/dev/zero' does not name a readable file (not a regular file)"),
        (
            tmp_path / "wide.yaml",
            "--device cpu --gpus 300",
            "--gpus 300 is too many CPU ranks for one machine: use 1-256",
        ),
    ]
    k = Kernel(warm_fork_server=False)
    try:
        for path, options, expected in cases:
            k.execute(f"%env TAAS_CONFIG={path}").ok()
            result = k.execute(f"#!big\n#pragma taas {options}\nprint('started')", timeout=30)
            assert_refused_in_one_line(k, result, expected)
            assert k.execute("print('ordinary')").ok().stdout == "ordinary\n"
            assert k.execute("#!/usr/bin/env python\nprint('plain')").ok().stdout == "plain\n"
        assert k.execute("#!g2.8\nprint('in the kernel')").ok().stdout == "in the kernel\n"
        k.execute("%env TAAS_CONFIG=").ok()
        assert k.execute("#pragma taas --gpus 2 --output rank0\nprint('runs again')").ok().stdout == "runs again\n"
    finally:
        k.shutdown()
