"""The live view in a real kernel, read from the messages a front end receives.

One display per run, drawn and then updated in place (the same display id); bars update their
rank's row instead of adding lines; identical lines of several ranks appear once; the view ends
as the run's summary; nothing any rank prints is lost.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
from support import ROOT
from support.kernel import Kernel

BARS = """#pragma taas --gpus 2
import time
from tqdm.auto import tqdm
for step in tqdm(range(30)):
    time.sleep(0.04)
print("finished")
"""


@pytest.fixture(scope="module")
def kernel():
    k = Kernel(warm_fork_server=False)
    yield k
    k.shutdown()


def test_the_view_is_one_display_drawn_then_updated_in_place_and_ends_as_the_summary(kernel):
    r = kernel.execute(BARS).ok()
    kinds = [kind for kind, _ in r.display_messages]
    assert kinds[0] == "display_data" and set(kinds[1:]) == {"update_display_data"}, kinds
    assert len({display_id for _, display_id in r.display_messages}) == 1, r.display_messages
    views = [d["text/plain"] for d in r.displays]
    running = [view for view in views if "· running" in view.splitlines()[0]]
    assert any(re.search(r"^rank 1 +running +[\d.]+ [KMG]B +\d+%\|", view, re.M) for view in running), views
    assert views[-1].startswith("taas: 2 ranks on cpu · done in "), views[-1]
    assert 'data-state="summary"' in r.displays[-1]["text/html"]


@pytest.mark.parametrize(
    "cell",
    [
        "big = torch.ones(200_000_000)",  # 800 MB bound, and ended at once
        "big = torch.ones(200_000_000)\ndel big",
    ],  # held for an instant
    ids=["bound", "freed"],
)
def test_the_summary_says_each_ranks_true_peak_even_of_a_short_cell(kernel, cell):
    r = kernel.execute(f"#pragma taas --gpus 2 --return none\nimport torch\n{cell}", timeout=60).ok()
    peaks = re.findall(r"^rank \d +done +peak ([\d.]+) ([MG]B)", r.displays[-1]["text/plain"], re.M)
    assert len(peaks) == 2, r.displays[-1]["text/plain"]
    assert all(float(size) * (1000 if unit == "GB" else 1) >= 800 for size, unit in peaks), peaks


def test_bars_update_their_row_and_leave_one_final_line_per_rank(kernel):
    r = kernel.execute(BARS).ok()
    bar_lines = [line for line in r.stderr.splitlines() if "it/s]" in line or "%|" in line]
    assert len(bar_lines) <= 2 and all(re.match(r"\[ranks? [\d,-]+\] 100%\|", line) for line in bar_lines), r.stderr
    assert "\r" not in r.stderr
    assert r.stdout == "[ranks 0-1] finished\n"


def test_identical_warnings_appear_once_and_lines_that_differ_keep_their_labels(kernel):
    r = kernel.execute(
        "#pragma taas --gpus 3\nimport warnings, os\nwarnings.warn('old API')\n"
        "print('loss', int(os.environ['RANK']) * 10)"
    ).ok()
    warning = [line for line in r.stderr.splitlines() if "UserWarning: old API" in line]
    assert len(warning) == 1 and warning[0].startswith("[ranks 0-2] "), r.stderr
    assert sorted(r.stdout.splitlines()) == ["[rank 0] loss 0", "[rank 1] loss 10", "[rank 2] loss 20"]


def test_nothing_is_lost_from_output_all(kernel):
    r = kernel.execute(
        "#pragma taas --gpus 3 --output all\nimport os\nrank = int(os.environ['RANK'])\n"
        "for i in range(3000):\n    print(f'line {i} of {rank}')\n    if i % 1000 == 0: print('checkpoint')\n"
        "print()"
    ).ok()
    lines = r.stdout.splitlines()
    for rank in range(3):
        assert [line for line in lines if line.endswith(f"of {rank}")] == [
            f"[rank {rank}] line {i} of {rank}" for i in range(3000)
        ]
    each = r.each_rank().splitlines()
    assert [each.count(f"[rank {rank}] checkpoint") for rank in range(3)] == [3, 3, 3], "collapsed or not, all there"
    unlabelled = [line for line in lines if not line.startswith("[rank")]
    assert unlabelled == [], "no unlabelled line, empty ones included"


def test_a_failed_run_ends_as_a_summary_that_says_which_rank_failed(kernel):
    r = kernel.execute(
        "#pragma taas --gpus 2\nimport os, time\nif os.environ['RANK'] == '1':\n"
        "    raise ValueError('boom')\ntime.sleep(30)"
    )
    assert r.error is not None and "boom" in r.error["evalue"]
    summary = r.displays[-1]["text/plain"].splitlines()
    assert summary[0].startswith("taas: 2 ranks on cpu · failed after "), summary
    assert re.match(r"rank 0 +stopped", summary[1]) and re.match(r"rank 1 +failed", summary[2]), summary


def test_with_the_view_off_the_output_is_as_the_ranks_write_it(kernel):
    kernel.execute("%config TaasMagics.view = False").ok()
    try:
        r = kernel.execute(BARS).ok()
        assert r.displays == []
        assert "\r" in r.stderr and r.stderr.count("%|") > 4, "each drawing of the bars, as written"
        assert "[rank 0] finished\n" in r.stdout and "[rank 1] finished\n" in r.stdout
        assert "live view:           off" in kernel.execute("%taas").ok().stdout
    finally:
        kernel.execute("%config TaasMagics.view = True").ok()


def test_output_rank0_shows_rank_0_unlabelled_with_its_bar_in_its_row(kernel):
    r = kernel.execute(BARS.replace("--gpus 2", "--gpus 2 --output rank0")).ok()
    assert r.stdout == "finished\n"
    assert [line for line in r.stderr.splitlines() if line.strip()] == [
        line for line in r.stderr.splitlines() if line.startswith("100%|")
    ], r.stderr
    assert any(re.search(r"^rank 0 +running .*\d+%\|", d["text/plain"], re.M) for d in r.displays)


def test_terminal_ipython_prints_the_summary_alone(tmp_path):
    """A terminal cannot redraw a display: no view while the run goes, its summary once at the end."""
    script = tmp_path / "terminal.py"
    script.write_text(
        "from IPython.terminal.interactiveshell import TerminalInteractiveShell\n"
        "shell = TerminalInteractiveShell.instance()\n"
        "shell.run_cell('%load_ext taas_magic')\n"
        "cell = '#pragma taas --gpus 2 --device cpu\\nimport time, taas\\nfor step in range(20):\\n"
        '    time.sleep(0.05)\\n    taas.progress(step=step)\\nprint("done")\'\n'
        "assert shell.run_cell(cell).success\n"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    printed = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=120, env=env, cwd=tmp_path
    ).stdout
    assert "[ranks 0-1] done" in printed and "· running" not in printed, printed
    assert printed.count("taas: 2 ranks on cpu · done in ") == 1, printed
    assert re.search(r"^rank 1 +done +peak .* step 19$", printed, re.M), printed
