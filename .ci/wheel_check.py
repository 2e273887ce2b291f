"""The built wheel, installed as users install it, in a fresh environment: `make wheel-check`.

1. `python -m build` makes the sdist and the wheel from the tracked files (a copy, as a clean clone has
   them); `twine check` passes on both.
2. The wheel holds the package's modules, its configurations and type markers, and nothing else.
3. A fresh virtual environment gets the wheel (not editable) with its declared dependencies only;
   `pip check` passes; `import taas_magic` and `import taas` work there.
4. That environment's kernel is registered (`ipykernel install --prefix` into a temporary folder) and
   driven as a notebook drives it, with TAAS_DEVICE=cpu: a 2-rank cell (gloo all_reduce), a
   `--start forkserver` cell, `taas.register` with `--cpus 1`, the one-line message of a feature whose
   extra is absent (`%taas cluster` without Ray), and `%unload_ext`.
5. Nothing is left: no process started from the environment, no folder.

This catches what an editable install hides: a package-data file left out, an undeclared import.
"""

from __future__ import annotations

import json
import os
import queue
import re
import shutil
import subprocess
import sys
import tempfile
import time
import venv
import zipfile
from pathlib import Path

import psutil
from jupyter_client.kernelspec import KernelSpecManager
from jupyter_client.manager import KernelManager

ROOT = Path(__file__).resolve().parent.parent
ANSI = re.compile(r"\x1b\[[0-9;]*m")
STARTED = time.monotonic()


def step(text: str) -> None:
    print(f"wheel-check [{time.monotonic() - STARTED:6.1f} s] {text}", flush=True)


def fail(text: str) -> None:
    raise SystemExit(f"wheel-check FAILED: {text}")


def run(*command: str | Path, cwd: Path | None = None, env: dict[str, str] | None = None) -> str:
    done = subprocess.run([str(part) for part in command], cwd=cwd, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        fail(f"{' '.join(map(str, command))} exited {done.returncode}:\n{done.stdout[-4000:]}{done.stderr[-4000:]}")
    return done.stdout


def clean_environment(prefix: Path) -> dict[str, str]:
    """This process's environment without any trace of the environment it runs in (.venv): the fresh
    one's bin first on PATH, no PYTHONPATH, ranks on CPU."""
    env = {key: value for key, value in os.environ.items()
           if key not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV", "PYTHONSTARTUP", "JUPYTER_PATH")}
    here = Path(sys.prefix)
    paths = [p for p in env.get("PATH", "").split(os.pathsep) if p and not Path(p).is_relative_to(here)]
    env["PATH"] = os.pathsep.join([str(prefix / "bin"), *paths])
    env["VIRTUAL_ENV"] = str(prefix)
    env["TAAS_DEVICE"] = "cpu"
    env["CUDA_VISIBLE_DEVICES"] = ""
    return env


def copy_of_the_clone(to: Path) -> Path:
    """The files a clean clone has (tracked, and new ones git does not ignore), nothing built."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                            capture_output=True)
    if listed.returncode != 0:
        shutil.copytree(ROOT, to, ignore=shutil.ignore_patterns(".venv", "build", "dist", "*.egg-info", "__pycache__",
                                                               ".git", ".demo", ".mypy_cache"))
        return to
    for name in filter(None, listed.stdout.decode().split("\0")):
        source = ROOT / name
        if source.is_file():
            (to / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, to / name)
    return to


def build(work: Path) -> tuple[Path, Path]:
    tools = work / "tools"
    venv.create(tools, with_pip=True)
    run(tools / "bin/python", "-m", "pip", "install", "--quiet", "build>=1.2", "twine>=6.1")
    step("build tools installed")
    source = copy_of_the_clone(work / "source")
    dist = work / "dist"
    run(tools / "bin/python", "-m", "build", "--outdir", dist, source)
    wheels, sdists = sorted(dist.glob("*.whl")), sorted(dist.glob("*.tar.gz"))
    if len(wheels) != 1 or len(sdists) != 1:
        fail(f"python -m build made {[p.name for p in dist.iterdir()]}, not one wheel and one sdist")
    print(run(tools / "bin/python", "-m", "twine", "check", "--strict", wheels[0], sdists[0]).strip())
    check_contents(wheels[0], source)
    step(f"built and checked {wheels[0].name}, {sdists[0].name}")
    return wheels[0], source


def check_contents(wheel: Path, source: Path) -> None:
    """The wheel holds exactly the packages' modules and package data, and the version version.py says."""
    src = source / "src"
    expected = {str(p.relative_to(src)) for p in src.rglob("*")
                if p.is_file() and p.parts[len(src.parts)] in ("taas", "taas_magic")
                and "__pycache__" not in p.parts and (p.suffix == ".py" or p.name in ("configurations.yaml", "py.typed"))}
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
        metadata = next(n for n in names if n.endswith(".dist-info/METADATA"))
        version = re.search(r"^Version: (.+)$", archive.read(metadata).decode(), re.M)
    held = {n for n in names if ".dist-info/" not in n}
    if held != expected:
        fail(f"the wheel holds {sorted(held - expected)} it should not, and lacks {sorted(expected - held)}")
    for needed in ("taas_magic/configurations.yaml", "taas_magic/py.typed", "taas/py.typed",
                   "taas_magic/launch/forkserver/server.py", "taas_magic/launch/supervisor/main.py"):
        if needed not in held:
            fail(f"the wheel lacks {needed}")
    declared = re.search(r'^VERSION = "([^"]+)"', (src / "taas_magic/version.py").read_text(), re.M)
    if version is None or declared is None or version[1] != declared[1]:
        fail(f"the wheel's version {version and version[1]} is not version.py's {declared and declared[1]}")
    forbidden = ("tests/", "benchmarks/", "examples/", "docs/", "stubs/")
    if any(n.startswith(forbidden) for n in names):
        fail("the wheel holds tests, benchmarks, examples, docs or stubs")


def install(wheel: Path, work: Path) -> Path:
    fresh = work / "fresh"
    venv.create(fresh, with_pip=True)
    env = clean_environment(fresh)
    run(fresh / "bin/python", "-m", "pip", "install", "--quiet", wheel, env=env)
    run(fresh / "bin/python", "-m", "pip", "check", env=env)
    step("installed the wheel and its declared dependencies in a fresh environment; pip check passes")
    place = run(fresh / "bin/python", "-c", "import taas, taas_magic; print(taas_magic.__file__, taas_magic.__version__)",
                cwd=work, env=env).split()
    if not Path(place[0]).is_relative_to(fresh):
        fail(f"taas_magic was imported from {place[0]}, not from the fresh environment")
    return fresh


class Kernel:
    """The fresh environment's kernel, registered as a user registers one and started by its kernelspec."""

    def __init__(self, fresh: Path, work: Path):
        prefix = work / "jupyter"
        env = clean_environment(fresh)
        run(fresh / "bin/python", "-m", "ipykernel", "install", "--prefix", prefix, "--name", "taas-wheel", env=env)
        specs = KernelSpecManager(kernel_dirs=[str(prefix / "share/jupyter/kernels")])
        argv = specs.get_kernel_spec("taas-wheel").argv
        if not Path(argv[0]).is_relative_to(fresh):
            fail(f"the registered kernel runs {argv[0]}, not the fresh environment's Python")
        cwd = work / "notebook"
        cwd.mkdir()
        self.manager = KernelManager(kernel_name="taas-wheel", kernel_spec_manager=specs)
        self.manager.start_kernel(env=env, cwd=str(cwd))
        self.client = self.manager.client()
        self.client.start_channels()
        self.client.wait_for_ready(timeout=120)
        self.pid = self.manager.provisioner.process.pid  # type: ignore[union-attr]

    def execute(self, code: str, timeout: float = 180) -> tuple[str, str | None]:
        """The cell's stdout and, if it failed, its error's one line."""
        msg_id = self.client.execute(code)
        out, error, deadline = [], None, time.monotonic() + timeout
        while True:
            if time.monotonic() > deadline:
                fail(f"a cell did not finish in {timeout} s: {code[:120]!r}")
            try:
                msg = self.client.get_iopub_msg(timeout=1)
            except queue.Empty:
                continue
            if msg["parent_header"].get("msg_id") != msg_id:
                continue
            kind, content = msg["msg_type"], msg["content"]
            if kind == "stream" and content["name"] == "stdout":
                out.append(content["text"])
            elif kind == "error":
                error = ANSI.sub("", f"{content['ename']}: {content['evalue']}")
            elif kind == "status" and content["execution_state"] == "idle":
                return "".join(out), error

    def ok(self, code: str) -> str:
        out, error = self.execute(code)
        if error is not None:
            fail(f"cell failed: {error}\n--- the cell:\n{code}")
        return out

    def shutdown(self) -> None:
        self.client.stop_channels()
        if self.manager.is_alive():
            self.manager.shutdown_kernel(now=True)


TWO_RANKS = """#pragma taas --gpus 2
import torch, torch.distributed as dist, taas
dist.init_process_group("gloo", init_method="env://")
total = torch.tensor([taas.rank() + 1.0])
dist.all_reduce(total)
print(f"rank {taas.rank()} of {taas.world_size()}: {total.item():g}")
"""

FORK_SERVER = """#pragma taas --gpus 2 --start forkserver
import os
print(f"rank {os.environ['RANK']} pid {os.getpid()} scale {scale} sum {int(weights.sum())}")
"""

REGISTER = """import torch, taas
from torch.utils.data import DataLoader, TensorDataset
loader = DataLoader(TensorDataset(torch.arange(16)), batch_size=2)
taas.register(loader)
"""

SERVED = """#pragma taas --gpus 2 --cpus 1
import taas
print(f"served {taas.rank()}: {sorted(int(i) for (batch,) in loader for i in batch)}")
"""


def drive(fresh: Path, work: Path) -> None:
    kernel = Kernel(fresh, work)
    try:
        step("kernel of the fresh environment registered and started")
        where = kernel.ok("%load_ext taas_magic\nimport sys, taas_magic\nprint(sys.prefix, taas_magic.__file__)").split()
        if not all(Path(p).is_relative_to(fresh) for p in where):
            fail(f"the kernel runs in {where[0]} with taas_magic from {where[1]}, not the fresh environment")
        shown = kernel.ok("%taas").splitlines()
        import_version = run(fresh / "bin/python", "-c", "import taas_magic; print(taas_magic.__version__)",
                             cwd=work, env=clean_environment(fresh)).strip()
        if not shown or shown[0].split() != ["taas-magic:", import_version]:
            fail(f"%taas does not show the version {import_version} first: {shown[:1]}")
        out = kernel.ok(TWO_RANKS)
        if sorted(re.findall(r"rank (\d) of 2: 3\b", out)) != ["0", "1"]:
            fail(f"the 2-rank cell printed {out!r}")
        step("a 2-rank cell (fork) ran: all_reduce over gloo")
        kernel.ok("import torch\nscale = 3\nweights = torch.ones(1000)")  # a tensor travels in a memory file
        out = kernel.ok(FORK_SERVER)
        if sorted(re.findall(r"rank (\d) pid \d+ scale 3 sum 1000", out)) != ["0", "1"]:
            fail(f"the --start forkserver cell printed {out!r}")
        step("a --start forkserver cell ran, with notebook names (a tensor among them) shipped to it")
        kernel.ok(REGISTER)
        out = kernel.ok(SERVED)
        shares = {int(r): json.loads(s) for r, s in re.findall(r"served (\d): (\[[\d, ]*\])", out)}
        if sorted(shares) != [0, 1] or sorted(shares[0] + shares[1]) != list(range(16)) or not shares[0]:
            fail(f"the registered loader's cell printed {out!r}")
        step("taas.register: a registered loader served to 2 ranks by a producer")
        _, error = kernel.execute("%taas cluster 127.0.0.1:1")
        if error is None or "pip install 'taas-magic[ray]'" not in error or "\n" in error.strip():
            fail(f"%taas cluster without Ray did not fail in one line naming the extra: {error!r}")
        step(f"without the [ray] extra, %taas cluster says: {error}")
        server = [c for c in psutil.Process(kernel.pid).children() if "forkserver.server" in " ".join(c.cmdline())]
        kernel.ok("%unload_ext taas_magic")
        out = kernel.ok("#pragma taas --gpus 2\nimport os\nprint('plain', os.environ.get('RANK'))")
        if out != "plain None\n":
            fail(f"after %unload_ext a pragma cell is not an ordinary cell: {out!r}")
        psutil.wait_procs(server, timeout=30)
        left = [c.pid for c in psutil.Process(kernel.pid).children(recursive=True)]
        if left:
            fail(f"after %unload_ext the kernel still has children {left}")
        step("%unload_ext: the fork server stopped, a pragma cell is an ordinary cell")
    finally:
        kernel.shutdown()


def leftovers(fresh: Path) -> list[str]:
    found = []
    for process in psutil.process_iter(["pid", "exe", "cmdline"]):
        try:
            line = " ".join(process.info["cmdline"] or [])
            if str(fresh) in line or str(fresh) in (process.info["exe"] or ""):
                found.append(f"{process.pid}: {line[:120]}")
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return found


def main() -> None:
    work = Path(tempfile.mkdtemp(prefix="taas-wheel-check."))
    fresh = work / "fresh"
    try:
        wheel, _ = build(work)
        fresh = install(wheel, work)
        drive(fresh, work)
        deadline = time.monotonic() + 10
        while leftovers(fresh) and time.monotonic() < deadline:
            time.sleep(0.2)
        if leftovers(fresh):
            fail(f"processes of the fresh environment remain: {leftovers(fresh)}")
    finally:
        for process in psutil.process_iter():  # whatever a failure left, so that the folder can go
            try:
                if str(fresh) in " ".join(process.cmdline()):
                    process.kill()
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                continue
        shutil.rmtree(work, ignore_errors=True)
    step("passed; nothing left behind")


if __name__ == "__main__":
    main()
