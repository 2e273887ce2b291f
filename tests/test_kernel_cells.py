"""The cell syntax in a real kernel: which cells become taas runs, bad input, and the extension's registrations."""

from __future__ import annotations

import pytest

from conftest import Kernel

pytestmark = pytest.mark.kernel


def test_a_shebang_that_is_not_a_configuration_runs_as_an_ordinary_cell(kernel):
    result = kernel.execute("#!/usr/bin/env python\nimport os\nx_plain = os.getpid()\nprint('plain')").ok()
    assert result.stdout == "plain\n"
    assert kernel.value("x_plain == os.getpid()") is True


def test_a_configuration_line_alone_runs_in_the_kernel_with_one_warning(no_gpu_kernel):
    result = no_gpu_kernel.execute("#!g2.8\nx_config = os.getpid()\nx_config").ok()
    assert result.stderr == "taas: g2.8 needs 8 GPUs, this machine has 0: running the cell in the kernel anyway\n"
    assert no_gpu_kernel.value("x_config == os.getpid()") is True
    assert result.displays and result.displays[0]["text/plain"] == str(no_gpu_kernel.value("x_config"))


def test_a_pragma_below_code_is_an_error_and_the_cell_does_not_run(kernel):
    result = kernel.execute("x_misplaced = 1\n#pragma taas --gpus 2\nprint('ran')")
    assert result.error["ename"] in ("UsageError", "TaasUsageError")
    assert "line 2" in result.error["evalue"] and "top of the cell" in result.error["evalue"]
    assert "ran" not in result.stdout
    assert kernel.value("'x_misplaced' in globals()") is False


def test_pragma_options_expand_notebook_variables(kernel):
    kernel.execute("GPUS = 3").ok()
    result = kernel.execute("#!g2.8\n#pragma taas --gpus {GPUS}\nimport taas\nprint(taas.world_size())").ok()
    assert result.stdout.count("3\n") == 3
    result = kernel.execute("#pragma taas --gpus $GPUS --output rank0\nimport taas\nprint(taas.world_size())").ok()
    assert result.stdout == "3\n"


def test_the_cell_magic_works_without_the_pragma(kernel):
    assert kernel.execute("%%taas --gpus 2 --output rank0\nprint('via magic')").ok().stdout == "via magic\n"


def test_ipython_syntax_inside_a_taas_cell(kernel):
    result = kernel.execute("#pragma taas --gpus 2 --output rank0\nx = %time 1 + 1\nfiles = !echo shell-escape\nprint(files)")
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
        ("#pragma taas --frobnicate", "unknown option '--frobnicate': allowed are --gpus, --cpus, --units"),
        ("#!g9.9\n#pragma taas", "unknown configuration 'g9.9': known are c1.4"),
        ("#pragma taas --device auto", "no CUDA device is visible on this machine: run the ranks on CPU with --device cpu"),
        ("#pragma taas --device cuda --gpus 2", "no CUDA device is visible"),
        ("#pragma taas --timeout -1", "argument --timeout: -1 is not allowed: use a number of seconds greater than 0"),
    ],
    ids=["gpus-0", "gpus-nan", "gpus-12-g2.8", "gpus-16-multinode", "cpus-9", "units-neg", "unknown-option",
         "unknown-config", "auto-without-cuda", "cuda-without-cuda", "timeout-neg"],
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
    assert result.stdout.count("] ran\n") == 2
    assert result.stderr == ("taas: --cpus/--units/--order/--prefetch have no effect: the cell uses no registered DataLoader "
                             "(taas.register(loader) in an earlier cell)\n")


def test_line_magic_shows_the_effective_settings(no_gpu_kernel):
    text = no_gpu_kernel.execute("%taas").ok().stdout
    for expected in ("fork", "configurations.yaml", "g2.8", "CUDA devices:        0 visible", "default --device:    cpu"):
        assert expected in text


def test_help_lists_every_option(kernel):
    result = kernel.execute("%%taas?\n").ok()
    text = "".join(page["data"]["text/plain"] for page in result.reply["payload"] if page.get("source") == "page")
    for option in ("--gpus", "--cpus", "--units", "--config", "--device", "--output", "--timeout"):
        assert option in text


def test_unload_removes_every_registration_and_reload_registers_once(kernel):
    count = "len([t for t in get_ipython().input_transformers_cleanup if type(t).__name__ == 'PragmaTransformer'])"
    magics = "('taas' in get_ipython().magics_manager.magics['cell'], 'taas' in get_ipython().magics_manager.magics['line'])"
    assert kernel.value(count) == 1
    kernel.execute("%reload_ext taas_magic").ok()
    kernel.execute("%reload_ext taas_magic").ok()
    assert kernel.value(count) == 1 and kernel.value(magics) == (True, True)
    kernel.execute("%unload_ext taas_magic").ok()
    assert kernel.value(count) == 0 and kernel.value(magics) == (False, False)
    # Unloaded, a pragma cell is an ordinary cell again.
    assert kernel.execute("#pragma taas --gpus 2\nprint('in the kernel')").ok().stdout == "in the kernel\n"
    kernel.execute("%load_ext taas_magic").ok()
    assert kernel.value(count) == 1


def test_a_broken_configurations_file_is_reported_by_the_cell(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("configurations: [not, a, mapping]\n")
    k = Kernel({"TAAS_CONFIG": str(bad)})
    try:
        result = k.execute("#pragma taas --config g2.8\nprint('x')")
        assert result.error["ename"] in ("UsageError", "TaasUsageError")
        assert str(bad) in result.error["evalue"]
    finally:
        k.shutdown()
