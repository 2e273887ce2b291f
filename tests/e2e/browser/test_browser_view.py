"""A taas cell seen the way a user sees it: JupyterLab in headless Chromium.

The kernel tests check the messages a cell sends; only a browser shows whether the front end
turns them into one status block that redraws in place and ends as a summary, and whether
JupyterLab's debugger panel shows a rank stopped at a breakpoint. The same runs take the
screenshots the docs use (set TAAS_SCREENSHOTS=docs/images to refresh them).

Needs Debian's Chromium (/usr/bin/chromium) and the Python packages jupyterlab and playwright;
Playwright drives the system Chromium, so no browser is downloaded.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator

import psutil
import pytest
from support import ROOT

if TYPE_CHECKING:
    from playwright.sync_api import Locator, Page

SRC = ROOT / "src"
NOTEBOOK = "live_view.ipynb"
MARKER = "TAAS_BROWSER_TEST"  # set in every process the harness starts, so leftovers can be found
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-proxy-server",
]  # the server is on loopback: never route it through a proxy

TAAS_CELL = """#pragma taas --gpus 2 --device cpu
import time, taas
from tqdm.auto import tqdm
for step in tqdm(range(40)):
    time.sleep(0.1)
    taas.progress(step=step, loss=1.0 / (step + 1))
print("finished")"""

TQDM_LINE = re.compile(r"\d+%\||it/s\]|s/it\]")
LABEL = re.compile(r"\[ranks? ([\d,\- ]+)\] ")


# What the test needs, found or not ---------------------------------------------------------------


def chromium_path() -> str | None:
    """Debian's Chromium: Playwright is told to use it instead of a browser of its own."""
    return shutil.which("chromium") or ("/usr/bin/chromium" if os.path.exists("/usr/bin/chromium") else None)


def missing() -> str | None:
    """Why the browser test cannot run here, in one line, or None when it can."""
    if chromium_path() is None:
        return "no chromium on PATH (apt-get install chromium)"
    for module in ("jupyterlab", "playwright.sync_api", "nbformat"):
        try:
            __import__(module)
        except ImportError:
            return f"{module.split('.')[0]} is not installed (pip install -e '.[browser]')"
    return None


# The JupyterLab server -----------------------------------------------------------------------------


@dataclass
class Lab:
    """A JupyterLab server of the test's own, on loopback, behind a random token."""

    process: subprocess.Popen[bytes]
    port: int
    token: str
    root: Path
    log: Path

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def url(self, path: str) -> str:
        return f"{self.base}{path}?token={self.token}"

    def api(self, path: str, method: str = "GET") -> Any:
        """One REST call; the opener ignores proxy settings, as loopback needs no proxy."""
        request = urllib.request.Request(self.url(path), method=method)
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
        with opener.open(request, timeout=10) as response:
            body = response.read()
        return json.loads(body) if body else None

    def log_tail(self, chars: int = 3000) -> str:
        return self.log.read_text(errors="replace")[-chars:]

    def kernel_state(self, notebook: str) -> str | None:
        """The execution state of the notebook's kernel, as the server last heard it."""
        for session in self.api("/api/sessions"):
            if session["path"] == notebook and session.get("kernel"):
                return str(session["kernel"]["execution_state"])
        return None

    def shut_down_kernels(self) -> None:
        """Shut kernels down the way the UI does, so they end their ranks before the server goes."""
        for kernel in self.api("/api/kernels"):
            self.api(f"/api/kernels/{kernel['id']}", method="DELETE")


def free_port() -> int:
    """A port free now; the server is told not to move to another one if it is taken by then."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def write_kernelspec(data_dir: Path) -> None:
    """A python3 kernel spec that runs this interpreter, whatever else is installed for the user, with
    the notebook's debugger."""
    spec = data_dir / "kernels" / "python3"
    spec.mkdir(parents=True)
    (spec / "kernel.json").write_text(
        json.dumps(
            {
                "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
                "display_name": "Python 3 (ipykernel)",
                "language": "python",
                "metadata": {"debugger": True},
            }
        )
    )  # as ipykernel's own spec: JupyterLab offers its debugger


def write_lab_settings(settings_dir: Path) -> None:
    """No news, update checks or toasts: they would reach for the network and cover screenshots."""
    path = settings_dir / "@jupyterlab" / "apputils-extension" / "notification.jupyterlab-settings"
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps({"fetchNews": "false", "checkForUpdates": False, "doNotDisturbMode": True}))


def lab_env(home: Path, marker: str) -> dict[str, str]:
    """The server's environment: Jupyter's dirs in the temp dir, CPU ranks, this checkout's code."""
    for name in ("data", "config", "runtime", "settings", "workspaces", "ipython"):
        (home / name).mkdir()
    write_kernelspec(home / "data")
    write_lab_settings(home / "settings")
    path = os.pathsep.join(filter(None, [str(SRC), os.environ.get("PYTHONPATH")]))
    return {
        **os.environ,
        "JUPYTER_DATA_DIR": str(home / "data"),
        "JUPYTER_CONFIG_DIR": str(home / "config"),
        "JUPYTER_RUNTIME_DIR": str(home / "runtime"),
        "JUPYTERLAB_SETTINGS_DIR": str(home / "settings"),
        "JUPYTERLAB_WORKSPACES_DIR": str(home / "workspaces"),
        "IPYTHONDIR": str(home / "ipython"),
        "JUPYTER_PREFER_ENV_PATH": "0",  # in a venv Jupyter would look in the venv's dirs first
        "JUPYTER_PLATFORM_DIRS": "1",
        "TAAS_DEVICE": "cpu",
        "PYTHONPATH": path,
        MARKER: marker,
    }


def start_lab(home: Path, root: Path, marker: str) -> Lab:
    """Start the server in a process group of its own, so stopping it reaches everything it started."""
    port, token, log = free_port(), secrets.token_hex(16), home / "lab.log"
    command = [
        sys.executable,
        "-m",
        "jupyterlab",
        "--no-browser",
        "--ServerApp.ip=127.0.0.1",
        f"--ServerApp.port={port}",
        "--ServerApp.port_retries=0",
        f"--IdentityProvider.token={token}",
        f"--ServerApp.root_dir={root}",
        "--ServerApp.terminals_enabled=False",
        "--LabApp.news_url=None",
        "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate",
        "--LabApp.extension_manager=readonly",
    ]  # the default one asks PyPI for extensions
    if os.geteuid() == 0:
        command.append("--ServerApp.allow_root=True")  # CI containers run as root, which the server refuses
    with open(log, "wb") as out:
        process = subprocess.Popen(
            command,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            env=lab_env(home, marker),
            cwd=root,
            start_new_session=True,
        )
    return Lab(process, port, token, root, log)


def wait_until_serving(lab: Lab, timeout: float = 60) -> None:
    """Poll /api/status: the port opens a while after the process starts."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if lab.process.poll() is not None:
            raise RuntimeError(f"JupyterLab exited with {lab.process.returncode}:\n{lab.log_tail()}")
        try:
            lab.api("/api/status")
            return
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            time.sleep(0.25)
    raise TimeoutError(f"JupyterLab did not answer within {timeout:.0f} s:\n{lab.log_tail()}")


def stop_lab(lab: Lab) -> None:
    """Kernels first (through the REST API), then the server's whole process group."""
    if lab.process.poll() is None:
        try:
            lab.shut_down_kernels()
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass  # the server is going anyway; the process group below reaches its kernels
    for sig, wait in ((signal.SIGTERM, 15), (signal.SIGKILL, 5)):
        try:
            os.killpg(lab.process.pid, sig)
        except ProcessLookupError:
            break
        try:
            lab.process.wait(wait)
            break
        except subprocess.TimeoutExpired:
            continue


@contextmanager
def jupyter_lab(home: Path, root: Path, marker: str) -> Iterator[Lab]:
    """A serving JupyterLab, stopped on the way out whatever happened."""
    lab = start_lab(home, root, marker)
    try:
        wait_until_serving(lab)
        yield lab
    finally:
        stop_lab(lab)


# The notebook and the browser --------------------------------------------------------------------


def write_notebook(path: Path, cells: list[str]) -> None:
    """A notebook naming its kernel, so JupyterLab starts it without asking."""
    import nbformat

    notebook = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(source) for source in cells])
    notebook.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3 (ipykernel)", "language": "python"}
    nbformat.write(notebook, path)


@contextmanager
def chromium_page(profile: Path, marker: str) -> Iterator[Page]:
    """Headless Chromium with a fresh profile; closing the context ends the browser."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        context = playwright.chromium.launch_persistent_context(
            str(profile),
            executable_path=chromium_path(),
            headless=True,
            args=CHROMIUM_ARGS,
            env={**os.environ, MARKER: marker},
            viewport={"width": 1200, "height": 800},
        )
        try:
            yield context.pages[0] if context.pages else context.new_page()
        finally:
            context.close()


def wait_for_kernel_idle(page: Page, lab: Lab, notebook: str, timeout: float = 60) -> None:
    """Idle as both the server and the page see it: the page connects a while after the server."""
    deadline = time.monotonic() + timeout
    while lab.kernel_state(notebook) != "idle":
        if time.monotonic() > deadline:
            raise TimeoutError(f"kernel not idle after {timeout:.0f} s:\n{lab.log_tail()}")
        time.sleep(0.25)
    indicator = page.locator('.jp-Notebook-ExecutionIndicator[data-status="idle"]')
    indicator.wait_for(timeout=max(1.0, deadline - time.monotonic()) * 1000)


def open_notebook(page: Page, lab: Lab, notebook: str) -> None:
    """Open the notebook by URL and wait until its cells can run."""
    page.goto(lab.url(f"/lab/tree/{notebook}"), timeout=60_000)
    page.locator(".jp-Notebook .jp-Cell").first.wait_for(timeout=60_000)
    wait_for_kernel_idle(page, lab, notebook)


def run_all_cells(page: Page) -> None:
    """Run > Run All Cells, as a user would (the menu item is JupyterLab's runmenu:run-all)."""
    page.locator(".lm-MenuBar-item", has_text=re.compile(r"^Run$")).click()
    page.locator("#jp-mainmenu-run .lm-Menu-item", has_text=re.compile(r"^Run All Cells")).click()


def cell(page: Page, index: int) -> Locator:
    """The notebook's cell at ``index``: the whole cell, so a screenshot shows the code with its output."""
    return page.locator(".jp-Notebook .jp-Cell").nth(index)


def text_outputs(cell_: Locator) -> str:
    """The cell's outputs other than the status block: its stdout, stderr and other displays."""
    return str(
        cell_.evaluate("""cell => Array.from(cell.querySelectorAll('.jp-OutputArea-output'))
        .filter(o => !o.querySelector('.taas-view')).map(o => o.innerText).join('\\n')""")
    )


def screenshot_dir(default: Path) -> Path:
    """TAAS_SCREENSHOTS (docs/images for the docs), else the test's own tmp dir."""
    target = Path(os.environ.get("TAAS_SCREENSHOTS") or default)
    target.mkdir(parents=True, exist_ok=True)
    return target


# Nothing left behind -----------------------------------------------------------------------------


def alive(process: psutil.Process) -> bool:
    """Running and not a zombie: a zombie has exited and only waits for its parent to reap it."""
    try:
        return process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def marked_processes(marker: str) -> list[psutil.Process]:
    """Processes carrying the run's marker: the server, its kernels and ranks, the browser.

    Found by environment rather than by parentage, as a rank or a browser helper may have been
    handed to init when its parent went.
    """
    found = []
    for process in psutil.process_iter():
        try:
            if process.environ().get(MARKER) == marker and alive(process):
                found.append(process)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return found


def leftovers(marker: str, children_before: set[int], timeout: float) -> list[psutil.Process]:
    """The run's processes still alive after a grace period for exits in flight."""
    deadline = time.monotonic() + timeout
    while True:
        left = marked_processes(marker)
        left += [c for c in psutil.Process().children(recursive=True) if c.pid not in children_before and alive(c)]
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.2)


def kill_all(processes: list[psutil.Process]) -> list[str]:
    """Kill what is left, so the next test starts on a clean machine; says what it was."""
    described = []
    for process in processes:
        try:
            described.append(f"{process.pid} {' '.join(process.cmdline())[:120]}")
            process.kill()
        except psutil.NoSuchProcess:
            continue
    return described


@contextmanager
def notebook_in_browser(
    cells: list[str], notebook: str = NOTEBOOK, traffic: DebugTraffic | None = None
) -> Iterator[tuple[Page, Lab]]:
    """A notebook of ``cells`` open in JupyterLab in Chromium, its kernel idle, its debug messages recorded in
    ``traffic``; all of it gone after."""
    marker = secrets.token_hex(8)
    children_before = {c.pid for c in psutil.Process().children(recursive=True)}
    try:
        with ExitStack() as stack:
            home = Path(
                stack.enter_context(tempfile.TemporaryDirectory(prefix="taas-browser-", ignore_cleanup_errors=True))
            )
            root = home / "notebooks"
            root.mkdir()
            write_notebook(root / notebook, cells)
            lab = stack.enter_context(jupyter_lab(home, root, marker))
            page = stack.enter_context(chromium_page(home / "chromium-profile", marker))
            if traffic is not None:
                traffic.watch(page)
            open_notebook(page, lab, notebook)
            yield page, lab
    except BaseException as failure:
        left = kill_all(leftovers(marker, children_before, timeout=2))
        if left and hasattr(failure, "add_note"):  # the failure comes first; the leftovers are a note to it
            failure.add_note("processes left behind:\n" + "\n".join(left))
        raise
    left = kill_all(leftovers(marker, children_before, timeout=10))
    assert not left, "processes left behind:\n" + "\n".join(left)


# The test ----------------------------------------------------------------------------------------


def view_text_changes(view: Locator, within: float = 5) -> tuple[str, str]:
    """The block's text ~1 s apart, read again until it differs: it redraws in place while ranks run."""
    first = view.inner_text()
    deadline = time.monotonic() + within
    time.sleep(1)
    second = view.inner_text()
    while second == first and time.monotonic() < deadline:
        time.sleep(0.25)
        second = view.inner_text()
    return first, second


def check_running_view(taas_cell: Locator, shots: Path) -> None:
    """While the ranks run: one block, a row per rank, its text redrawn in place."""
    view = taas_cell.locator(".jp-OutputArea .taas-view")
    view.first.wait_for(timeout=60_000)
    taas_cell.locator('tr.taas-row[data-rank="0"]').wait_for(timeout=10_000)
    taas_cell.locator('tr.taas-row[data-rank="1"]').wait_for(timeout=10_000)
    first, second = view_text_changes(view.last)
    assert first != second, f"the status block did not change while the ranks ran:\n{first}"
    assert view.count() == 1, f"{view.count()} status blocks in the cell: updates should replace the block"
    taas_cell.screenshot(path=str(shots / "live-view-running.png"))


def labelled_ranks(line: str) -> set[int]:
    """The ranks a line's label names: ``[rank 1]``, or ``[ranks 0-1]`` for a line they all wrote."""
    match = LABEL.match(line)
    if not match:
        return set()
    ranks: set[int] = set()
    for part in match.group(1).split(","):
        first, _, last = part.strip().partition("-")
        ranks.update(range(int(first), int(last or first) + 1))
    return ranks


def check_summary(taas_cell: Locator, shots: Path) -> None:
    """After the cell: the block turned summary, and the text below it is not flooded by tqdm."""
    taas_cell.locator('.taas-view[data-state="summary"]').wait_for(timeout=60_000)
    assert taas_cell.locator(".jp-OutputArea .taas-view").count() == 1
    lines = text_outputs(taas_cell).splitlines()
    text = "\n".join(lines)
    finished = set().union(*(labelled_ranks(line) for line in lines if line.endswith("] finished")))
    assert finished == {0, 1}, f"'finished' should come labelled from ranks 0 and 1:\n{text}"
    bars = [line for line in lines if TQDM_LINE.search(line)]
    for rank in (0, 1):
        drawn = [line for line in bars if rank in labelled_ranks(line)]
        assert len(drawn) <= 1, f"rank {rank} drew {len(drawn)} tqdm lines instead of one final bar:\n{text}"
    assert len(bars) <= 2, f"{len(bars)} tqdm lines for 2 ranks:\n{text}"
    taas_cell.screenshot(path=str(shots / "live-view-summary.png"))


@pytest.mark.timeout(180)
def test_the_status_block_redraws_in_place_in_jupyterlab_and_ends_as_a_summary(tmp_path: Path) -> None:
    reason = missing()
    if reason:
        pytest.skip(reason)
    shots = screenshot_dir(tmp_path)
    with notebook_in_browser(["%load_ext taas_magic", TAAS_CELL]) as (page, lab):
        run_all_cells(page)
        taas_cell = cell(page, 1)
        check_running_view(taas_cell, shots)
        check_summary(taas_cell, shots)


HANG_CELL = """#pragma taas --gpus 3 --device cpu --hang-after 4 --timeout 14
import time, torch, torch.distributed as dist
dist.init_process_group("gloo")
for step in range(3):
    dist.all_reduce(torch.ones(1024))
if dist.get_rank() != 2:
    dist.barrier()  # rank 2 skips it
time.sleep(60)"""


@pytest.mark.timeout(180)
def test_a_hang_is_diagnosed_in_the_cell_with_the_rows_saying_where_each_rank_waits(tmp_path: Path) -> None:
    reason = missing()
    if reason:
        pytest.skip(reason)
    shots = screenshot_dir(tmp_path)
    with notebook_in_browser(["%load_ext taas_magic", HANG_CELL], notebook="hang.ipynb") as (page, lab):
        run_all_cells(page)
        hang_cell = cell(page, 1)
        diagnosis = hang_cell.locator(".jp-OutputArea-output", has_text="taas: no progress for")
        diagnosis.first.wait_for(timeout=60_000)
        time.sleep(1.5)  # a redraw of the rows after the diagnosis
        shown = text_outputs(hang_cell)
        assert "rank 2 has not entered barrier #4 that ranks 0-1 wait in; it is at Cell In[2], line 8" in shown, shown
        assert "ranks 0-1: in barrier #4 for" in shown and "time.sleep(60)" in shown, shown
        rows = hang_cell.locator(".taas-view").last.inner_text()
        assert "in barrier #4" in rows and "behind: at #3, others wait in #4" in rows, rows
        hang_cell.screenshot(path=str(shots / "hang-diagnosis.png"))
        hang_cell.locator('.taas-view[data-state="summary"]').wait_for(timeout=60_000)
        assert "--timeout 14 s elapsed" in text_outputs(hang_cell)


DEBUGGED_CELL = """#pragma taas --gpus 2 --device cpu
import os
rank_seen = int(os.environ['RANK'])
scaled = rank_seen * 10
print('rank', rank_seen, 'scaled', scaled)"""


def switch_debugger_on(page: Page) -> None:
    """The bug icon in the notebook's toolbar, once the kernel said it supports debugging."""
    page.locator('.jp-DebuggerBugButton[title="Enable Debugger"]').wait_for(timeout=30_000)
    page.locator(".jp-DebuggerBugButton").first.click()
    page.locator('.jp-DebuggerBugButton[aria-pressed="true"]').wait_for(timeout=30_000)


def click_gutter(cell_: Locator, line: int) -> None:
    """A breakpoint at ``line`` of the cell: a click in the breakpoint gutter beside its number."""
    number = cell_.locator(".cm-lineNumbers .cm-gutterElement", has_text=re.compile(rf"^{line}$")).first.bounding_box()
    gutter = cell_.locator("div.cm-gutter.cm-breakpoint-gutter").bounding_box()
    assert number is not None and gutter is not None
    cell_.page.mouse.click(gutter["x"] + gutter["width"] / 2, number["y"] + number["height"] / 2)


def shown_rank(page: Page) -> int:
    """The rank whose frame the call stack panel shows (its top frame is named ``rank N: …``)."""
    top = page.locator(".jp-DebuggerCallstackFrame").first
    top.wait_for(timeout=60_000)
    match = re.match(r"rank (\d+): <module>", top.inner_text())
    assert match, f"the call stack shows {top.inner_text()!r}"
    return int(match.group(1))


class DebugTraffic:
    """The Debug Protocol messages between JupyterLab and the kernel, as the page's websocket carries them, each
    summed up in one line: what a failure of the debugger test says the front end was sent, and in which order."""

    def __init__(self) -> None:
        self.lines: list[str] = []
        self.started = time.monotonic()

    def watch(self, page: Page) -> None:
        """Record what ``page``'s websockets opened from now on carry (before the notebook opens its kernel's)."""
        page.on("websocket", self._watch)

    def _watch(self, socket_: Any) -> None:
        socket_.on("framesent", lambda payload: self._take(">", payload))
        socket_.on("framereceived", lambda payload: self._take("<", payload))

    def _take(self, way: str, payload: str | bytes) -> None:
        text = payload if isinstance(payload, str) else payload.decode("utf-8", "replace")
        if '"debug_' not in text:
            return
        parts = json_documents(text)
        if len(parts) >= 4 and parts[0].get("msg_type", "").startswith("debug_"):
            said = summed_up(parts[3])
            if said:
                self.lines.append(f"{time.monotonic() - self.started:7.3f} {way} {said}")

    @contextmanager
    def told_on_failure(self, count: int = 40) -> Iterator[None]:
        """A failure inside lists the last ``count`` messages (what JupyterLab was sent, and in which order)."""
        try:
            yield
        except BaseException as failure:
            failure.add_note("the last debug messages:\n" + "\n".join(self.lines[-count:]))
            raise


def json_documents(text: str) -> list[dict[str, Any]]:
    """The JSON objects of one websocket frame of Jupyter's binary protocol, in order (header, parent, metadata,
    content), the bytes between them skipped."""
    decoder, found, at = json.JSONDecoder(), [], text.find("{")
    while at != -1:
        try:
            value, end = decoder.raw_decode(text, at)
        except ValueError:
            break
        found.append(value)
        at = text.find("{", end)
    return found


def summed_up(content: dict[str, Any]) -> str:
    """One line for a debug request, reply or event about threads, frames and variables ('' for the others)."""
    kind, body = content.get("type"), content.get("body") or {}
    if kind == "event" and content.get("event") in ("stopped", "continued"):
        return f"{content['event']} thread {body.get('threadId')}"
    command = content.get("command")
    if command not in ("stackTrace", "scopes", "variables", "continue"):
        return ""
    if kind == "request":
        return f"#{content.get('seq')} {command} {content.get('arguments')}"
    if command == "stackTrace":
        said = [frame.get("name") for frame in body.get("stackFrames", [])[:1]]
    elif command == "scopes":
        said = [scope.get("variablesReference") for scope in body.get("scopes", [])]
    elif command == "variables":
        said = [f"{v['name']}={v['value']}" for v in body.get("variables", []) if v["name"] == "rank_seen"]
    else:
        said = []
    return f"#{content.get('request_seq')} {command} -> {content.get('success')} {said} {content.get('message', '')}"


def shown_rank_with_its_values(page: Page, within: float = 45) -> int:
    """The rank the panels show, once the variables panel shows that rank's values: when both ranks stop
    at once, JupyterLab redraws the call stack and the variables for each ``stopped`` event in turn, each
    from the rank's own answers (a rank's debugger answers in a thread of its own, seconds late on a machine
    as busy as the test tiers make it)."""
    deadline = time.monotonic() + within
    while True:
        rank = shown_rank(page)
        variables = page.locator(".jp-DebuggerVariables").first
        variables.get_by_text("rank_seen").first.wait_for(timeout=10_000)
        if re.search(rf"rank_seen\W+{rank}\b", variables.inner_text()):
            return rank
        assert time.monotonic() < deadline, f"rank {rank}'s frame, other values: {variables.inner_text()}"
        time.sleep(0.25)


@pytest.mark.timeout(240)
def test_jupyterlabs_debugger_stops_a_taas_cells_ranks_at_a_gutter_breakpoint(tmp_path: Path) -> None:
    reason = missing()
    if reason:
        pytest.skip(reason)
    shots = screenshot_dir(tmp_path)
    traffic = DebugTraffic()
    with (
        notebook_in_browser(["%load_ext taas_magic", DEBUGGED_CELL], "debugger.ipynb", traffic) as (page, lab),
        traffic.told_on_failure(),
    ):
        switch_debugger_on(page)
        taas_cell = cell(page, 1)
        click_gutter(taas_cell, 4)
        run_all_cells(page)
        # Both stopped before the panels are read: JupyterLab shows the rank that stopped last, so a rank stopping
        # a moment later (a busy machine) would take the panels, and the continue meant for the other, from the test.
        for stopped in (0, 1):
            taas_cell.locator(f'tr.taas-row[data-rank="{stopped}"][data-state="paused"]').wait_for(timeout=60_000)
        seen = []
        for _ in range(2):  # each rank stops; continuing one shows the other
            rank = shown_rank_with_its_values(page)
            assert "Cell [*]:4" in page.locator(".jp-DebuggerCallstackFrame").first.inner_text()
            if not seen:
                page.screenshot(path=str(shots / "debugger-rank.png"))
            seen.append(rank)
            page.locator('[data-command="debugger:continue"]').first.click()
            if len(seen) < 2:
                page.wait_for_function(
                    f"""() => {{
                        const top = document.querySelector('.jp-DebuggerCallstackFrame');
                        return top && !top.innerText.startsWith('rank {rank}:'); }}""",
                    timeout=30_000,
                )
        assert sorted(seen) == [0, 1]
        taas_cell.locator('.taas-view[data-state="summary"]').wait_for(timeout=60_000)
        for line in ("rank 0 scaled 0", "rank 1 scaled 10"):
            taas_cell.get_by_text(line).first.wait_for(timeout=10_000)


SESSION_CELL = """#pragma taas --gpus 2 --device cpu --keep --return none
import time, taas
from tqdm.auto import tqdm
losses = []"""
BACKGROUND_CELL = """#pragma taas --background --return losses
for step in tqdm(range(250)):
    time.sleep(0.1)
    losses.append(1.0 / (step + 1))
    taas.progress(step=step, loss=losses[-1])"""
MEANWHILE_CELL = """import time
for second in range(8):
    time.sleep(1)
print("the notebook worked on")"""
PLOT_CELL = """%taas pull losses --ranks 0
from IPython.display import SVG, display
line = " ".join(f"{10 + 1.2 * i:.1f},{110 - 100 * value:.1f}" for i, value in enumerate(losses))
display(SVG(
    '<svg xmlns="http://www.w3.org/2000/svg" width="340" height="120">'
    f'<polyline fill="none" stroke="steelblue" stroke-width="2" points="{line}"/>'
    f'<text x="150" y="24" font-family="sans-serif" font-size="14">loss, {len(losses)} steps so far</text></svg>'
))"""


@pytest.mark.timeout(240)
def test_a_background_runs_view_goes_on_updating_while_another_cell_runs_and_its_pulled_values_plot(
    tmp_path: Path,
) -> None:
    reason = missing()
    if reason:
        pytest.skip(reason)
    shots = screenshot_dir(tmp_path)
    cells = ["%load_ext taas_magic", SESSION_CELL, BACKGROUND_CELL, MEANWHILE_CELL, PLOT_CELL, "%taas wait"]
    with notebook_in_browser(cells, notebook="background.ipynb") as (page, lab):
        run_all_cells(page)
        background, meanwhile, plot = cell(page, 2), cell(page, 3), cell(page, 4)
        background.get_by_text(re.compile(r"taas run 1 \(cell In\[3\], 2 ranks of the session\): running")).wait_for(
            timeout=90_000
        )
        view = background.locator(".jp-OutputArea .taas-view")
        view.first.wait_for(timeout=60_000)
        meanwhile.locator(".jp-InputArea-prompt", has_text="[*]").wait_for(timeout=30_000)
        first, second = view_text_changes(view.last)
        assert first != second, f"the background run's view did not change while another cell ran:\n{first}"
        assert meanwhile.locator(".jp-InputArea-prompt", has_text="[*]").count() == 1, "the other cell still runs"
        assert view.count() == 1, "updates replace the view in its own cell"
        meanwhile.get_by_text("the notebook worked on").wait_for(timeout=60_000)
        plot.locator(".jp-RenderedSVG img").first.wait_for(timeout=60_000)  # SVG: nothing beyond the project's own
        assert "steps so far" in urllib.parse.unquote(plot.inner_html()), "a plot of the values pulled"
        assert background.locator('.taas-view[data-state="summary"]').count() == 0, "plotted while it trains"
        page.screenshot(path=str(shots / "background-running.png"))
        plot.screenshot(path=str(shots / "background-pulled-plot.png"))
        background.locator('.taas-view[data-state="summary"]').wait_for(timeout=90_000)
        assert "done" in background.locator(".taas-view").last.inner_text()
        cell(page, 5).get_by_text(re.compile("losses back in the notebook")).wait_for(timeout=30_000)
        background.screenshot(path=str(shots / "background-done.png"))
