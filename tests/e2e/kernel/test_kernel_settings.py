"""Defaults set the IPython way (`%config TaasMagics.…`), and tab completion of `%%taas` lines."""

from __future__ import annotations

from support.kernel import NO_GPU, Kernel


def test_configured_defaults_apply_to_cells_that_leave_the_option_out(kernel):
    try:
        kernel.execute('%config TaasMagics.output = "rank0"').ok()
        r = kernel.execute("#pragma taas --gpus 2\nimport os\nprint('from', os.environ['RANK'])").ok()
        assert r.stdout == "from 0\n", "rank 0 alone, unprefixed, as with --output rank0"
        r = kernel.execute("#pragma taas --gpus 2 --output all\nimport os\nprint('from', os.environ['RANK'])").ok()
        assert sorted(r.stdout.splitlines()) == ["[rank 0] from 0", "[rank 1] from 1"], "the cell's option wins"
        kernel.execute('%config TaasMagics.start = "forkserver"').ok()
        shown = kernel.execute("%taas").ok().stdout
        assert "default --start:     forkserver (from %config TaasMagics.start)" in shown
        assert "default --output:    rank0 (rank 0's output alone) (from %config TaasMagics.output)" in shown
        kernel.execute("import threading\nlock = threading.Lock()").ok()
        r = kernel.execute("#pragma taas --gpus 2\nprint(lock)")
        assert "cannot be sent to ranks started with --start forkserver" in r.error["evalue"], (
            "started from the fork server"
        )
    finally:
        kernel.execute('%config TaasMagics.output = "all"\n%config TaasMagics.start = "auto"').ok()


def test_a_configured_device_wins_over_the_environment_and_a_bad_one_is_one_line():
    k = Kernel({"TAAS_DEVICE": "cuda", "CUDA_VISIBLE_DEVICES": ""}, warm_fork_server=False)
    try:
        assert "no CUDA device is visible" in k.execute("#pragma taas --gpus 2\nx = 1").error["evalue"]
        k.execute('%config TaasMagics.device = "cpu"').ok()
        assert "default --device:    cpu (from %config TaasMagics.device)" in k.execute("%taas").ok().stdout
        k.execute("#pragma taas --gpus 2\nimport taas\nplace = str(taas.device())").ok()
        assert k.value("place") == "cpu"
        r = k.execute('%config TaasMagics.device = "gpu"')  # IPython logs a refused setting in one line
        assert (
            "The 'device' trait of a TaasMagics instance expected any of ['auto', 'cuda', 'cpu'] or None, "
            "not the str 'gpu'." in r.stderr
        )
        assert "default --device:    cpu (from %config TaasMagics.device)" in k.execute("%taas").ok().stdout
    finally:
        k.shutdown()


GRANDPARENT = "#pragma taas --gpus 2 --output rank0\nimport os, psutil\nprint(psutil.Process(os.getppid()).ppid())"


def test_settings_name_only_what_the_user_configured_and_what_using_cuda_changed():
    k = Kernel(NO_GPU, warm_fork_server=False)
    try:
        shown = k.execute("%taas").ok().stdout
        assert "(from %config" not in shown, "nothing was configured: every default is built in"
        assert "default --start:     auto\n" in shown
        k.execute("%config TaasMagics.view = True").ok()  # the built-in value, but set by the user
        assert "(from %config TaasMagics.view)" in k.execute("%taas").ok().stdout
        k.execute("torch.cuda.is_available()").ok()
        shown = k.execute("%taas").ok().stdout
        assert (
            "CUDA devices:        0 visible (CUDA was used in this kernel: GPU cells start from the fork "
            "server; CPU cells still fork)" in shown
        )
        result = k.execute(GRANDPARENT).ok()
        assert int(result.stdout) == k.pid and result.stderr == "", "a CPU cell is still forked from the kernel"
    finally:
        k.shutdown()


def test_tab_completes_options_their_values_and_configuration_names(kernel):
    assert "--device" in kernel.complete("%%taas --dev")
    assert set(kernel.complete("%%taas --device ")) >= {"auto", "cuda", "cpu"}
    assert "g2.8" in kernel.complete("%%taas --gpus 8 --config g2")
    assert "rank0" in kernel.complete("%%taas --output r")
    assert "stop" in kernel.complete("%taas st") and "debug" in kernel.complete("%taas ")
    assert "help" in kernel.complete("%taas he") and "--gpus" not in kernel.complete("%taas --g"), "a line's commands"
    assert "--ranks" in kernel.complete("%taas pull x --r") and "release" in kernel.complete("%taas cluster re")
    assert "--keep" in kernel.complete("%%taas --gpus 2 --ke")


def test_the_line_magic_answers_help_typos_and_cell_options_in_one_line(kernel):
    """What a new user types first: the help in three spellings, a typo, a cell's option on the line."""
    helps = [kernel.execute(f"%taas {word}").ok().stdout for word in ("help", "--help", "-h")]
    assert helps[0] == helps[1] == helps[2] and helps[0].startswith("taas: the line %taas takes these commands:")
    assert all(f"%taas {command}" in helps[0] for command in ("stop", "debug [RANK]", "pull NAMES", "stacks"))
    assert kernel.execute("%taas help stop").ok().stdout.startswith("%taas stop\n")
    assert kernel.execute("%taas pull --help").ok().stdout.startswith("%taas pull NAMES [--ranks RANKS]\n")
    assert kernel.execute("%taas version").ok().stdout.startswith("taas-magic ")
    assert kernel.execute("%taas status").ok().stdout == kernel.execute("%taas").ok().stdout
    typo = kernel.execute("%taas stopp")
    assert typo.error["ename"] == "TaasUsageError" and typo.error["evalue"].startswith(
        "%taas stopp is not a command (did you mean %taas stop?): %taas takes status, stop, debug,"
    )
    option = kernel.execute("%taas --gpus 2")
    assert option.error["evalue"].startswith("--gpus is an option of a taas cell, not of the line %taas"), option.error
    assert option.stdout == "", "nothing is shown as if the option had been taken"
    paged = str(kernel.execute("%taas?").ok().reply["payload"])  # what a front end shows in its pager
    assert "%taas stop" in paged and "%taas pull NAMES [--ranks RANKS]" in paged, paged[:2000]
