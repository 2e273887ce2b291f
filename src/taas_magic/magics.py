"""`%%taas` and `%taas`: the glue from a cell to a run. Parse → spec → compile → run → report."""

from __future__ import annotations

import ast
import linecache
import os
import sys
from types import CodeType
from typing import Any

from IPython.core.interactiveshell import InteractiveShell
from IPython.core.magic import Magics, line_cell_magic, magics_class, no_var_expand

from . import cluster, controller, machine, options, results, streams
from .backend import Backend, Cell
from .cluster import Cluster
from .cluster_backend import PRODUCER_NODE, ClusterBackend
from .configurations import Catalog, load_catalog
from .delivery import planning
from .delivery.service import LoaderPlan, producer_labels
from .errors import TaasUsageError
from .fork import ForkBackend
from .forkserver_backend import ForkServerBackend, ForkServerRequest
from .pragma import PragmaTransformer, parse_header
from .rank_state import draw_base_seed
from .spec import LaunchSpec, build, resolve_start
from .worker import RankTask


@magics_class
class TaasMagics(Magics):
    """Runs a cell as a distributed PyTorch job; see `%%taas?`."""

    def __init__(self, shell: InteractiveShell, transformer: PragmaTransformer):
        super().__init__(shell)
        self.ipython = shell  # the same as Magics.shell, never None here
        self.transformer = transformer
        self.fork_backend = ForkBackend()
        self.forkserver_backend = ForkServerBackend()
        self.cluster: Cluster | None = None  # the connected Ray cluster, once connected
        self.cluster_address = cluster.address_from(os.environ)  # connected to on first use

    @options.declare
    @no_var_expand  # done in the magic, only where there is something to expand (_expand_variables)
    @line_cell_magic
    def taas(self, line: str, cell: str | None = None) -> None:
        """Run this cell as a distributed PyTorch job: one process (rank) per GPU.

        Each rank gets torchrun's environment (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR,
        MASTER_PORT, ...), so `torch.distributed.init_process_group("nccl", init_method="env://")`
        works unchanged and Lightning needs no init. `#!g2.8` / `#pragma taas --gpus 8` at the
        top of a cell means `%%taas --config g2.8 --gpus 8`. `%taas` alone shows the settings.
        """
        line = _expand_variables(self.ipython, line)
        if cell is None and line.split()[:1] == ["cluster"]:
            self._cluster_command(line.split()[1:])
            return
        args = options.parse(TaasMagics.taas, line)
        if cell is None:
            if args.check:
                self._check_configuration(args.check)
            else:
                print(self._settings())
            return
        catalog = load_catalog()
        spec = build(args, catalog, machine.detect(), os.environ, connected=self.cluster_address is not None)
        tree, code = self._compile(line, cell)
        analysed = Cell.of(tree, self.ipython.user_ns, f"Cell In[{self.ipython.execution_count}]")
        _import_torch_once()
        loaders = self._loaders(spec, analysed)
        task = RankTask(code=code, device=spec.device, threads=spec.threads_per_rank, loaders=loaders,
                        return_names=results.wanted(analysed.binds, spec.return_names),
                        seed=draw_base_seed())
        backend = self._cluster_backend(spec, catalog) if spec.on_cluster else self._choose_start(spec)
        payload = backend.prepare(task, analysed)
        progress = _ProgressDisplay()
        try:
            known = getattr(self.ipython.compile, "_filename_map", {})  # IPython's file name -> cell number
            cell_names = {name: f"Cell In[{number}]" for name, number in known.items()}
            outcome = controller.run(spec, payload, backend, streams.write_to_cell, os.environ, cell_names,
                                     labels=producer_labels(loaders), status=progress.show)
        finally:
            if isinstance(payload, ForkServerRequest):
                payload.close()  # the shipped tensors' memory file
        self._take_back(outcome)

    def _loaders(self, spec: LaunchSpec, cell: Cell) -> tuple[LoaderPlan, ...]:
        """Delivery plans for the registered loaders the cell uses; one line if the options serve none."""
        names = planning.loaders_used(cell.reads, self.ipython.user_ns)
        if spec.data_options_given and not names:
            print("taas: --cpus/--units/--order/--prefetch have no effect: the cell uses no registered DataLoader "
                  "(taas.register(loader) in an earlier cell)", file=sys.stderr)
        return planning.plans(spec, names, self.ipython.user_ns)

    def _compile(self, line: str, cell: str) -> tuple[ast.Module, CodeType]:
        """Compile the cell in the kernel, so a syntax error is reported before any rank starts.

        Line 1 stands for the `%%taas` line, so line numbers in tracebacks are the cell's own; the
        lines tracebacks quote show the cell's own header.
        """
        with self.transformer.disabled():
            source = self.ipython.transform_cell(f"# %%taas {line}\n{cell}")
        filename = self.ipython.compile.cache(source, self.ipython.execution_count)
        _show_header_as_written(filename, source, cell, self._raw_cell())
        tree = self.ipython.transform_ast(ast.parse(source, filename))
        return tree, compile(tree, filename, "exec", dont_inherit=True)

    def _raw_cell(self) -> str:
        """The cell as the user typed it: IPython stores it in the history before running it."""
        history = getattr(self.ipython.history_manager, "input_hist_raw", None) or [""]
        return str(history[-1])

    def _choose_start(self, spec: LaunchSpec) -> Backend:
        """Fork when it is safe, else the fork server."""
        can_fork = hasattr(os, "fork")
        # An initialized CUDA context makes any fork risky; a poisoned fork matters to GPU ranks only.
        unsafe = machine.cuda_initialized_in_kernel() or (
            spec.device == "cuda" and can_fork and machine.fork_poisoned_for_cuda())
        start, notice = resolve_start(spec.start, spec.device, unsafe, can_fork)
        if notice:
            print(notice, file=sys.stderr)
        return self.fork_backend if start == "fork" else self.forkserver_backend

    # -- the cluster ----------------------------------------------------------------------------
    def _connected(self) -> Cluster:
        """The cluster, connecting on first use (to the address of %taas cluster or $TAAS_CLUSTER)."""
        if self.cluster is None:
            assert self.cluster_address is not None
            self.cluster = Cluster.connect(self.cluster_address, cluster.idle_seconds_from(os.environ))
        return self.cluster

    def _cluster_backend(self, spec: LaunchSpec, catalog: Catalog) -> Backend:
        producer_node = catalog.get(PRODUCER_NODE) if PRODUCER_NODE in catalog.names() else None
        return ClusterBackend(self._connected(), spec, lambda line: print(line, file=sys.stderr), producer_node)

    def _cluster_command(self, words: list[str]) -> None:
        """`%taas cluster [ADDRESS | off | release]`: connect, show the nodes, go back to this machine."""
        if len(words) > 1:
            raise TaasUsageError(f"%taas cluster takes one of ADDRESS, off, release; got {' '.join(words)!r}")
        word = words[0] if words else ""
        if word == "off":
            if self.cluster is not None:
                self.cluster.disconnect()
            self.cluster, self.cluster_address = None, None
            print("taas: cells run on this machine")
        elif word == "release":
            released = self.cluster.release() if self.cluster is not None else 0
            print(f"taas: {released} warm agent{'s' * (released != 1)} released")
        elif word:
            if self.cluster is not None:
                self.cluster.disconnect()
            self.cluster, self.cluster_address = None, word
            try:
                connected = self._connected()
            except BaseException:
                self.cluster_address = None  # this machine, as the new cluster did not answer
                raise
            print(connected.describe(load_catalog()))
        elif self.cluster_address is None:
            print("taas: not connected to a cluster: %taas cluster ADDRESS (auto, HOST:PORT or ray://HOST:PORT)")
        else:
            print(self._connected().describe(load_catalog()))

    def _take_back(self, outcome: controller.Outcome) -> None:
        """Rank 0's names join the notebook's namespace; one line lists what could not come back."""
        skipped = dict(outcome.skipped)
        try:
            values, lost = results.loads(outcome.results)
        except Exception as e:  # the stream itself is damaged: no name can be read
            values, lost = {}, {"(all)": f"could not be unpickled in the kernel: {type(e).__name__}: {e}"}
        self.ipython.user_ns.update(values)  # each name that could be unpickled, whatever became of the others
        skipped.update(lost)
        if skipped:
            listed = "; ".join(f"{name} ({why})" for name, why in skipped.items())
            print(f"taas: not copied back from rank 0: {listed}", file=sys.stderr)

    def _check_configuration(self, name: str) -> None:
        """`#!NAME` alone: the cell runs here; warn in one line if this machine lacks what NAME needs."""
        catalog = load_catalog()
        configuration = catalog.get(name)
        found = machine.detect()
        if configuration.gpus and found.cuda_devices < configuration.gpus:
            print(f"taas: {name} needs {_count(configuration.gpus, 'GPU')}, this machine has {found.cuda_devices}: "
                  "running the cell in the kernel anyway", file=sys.stderr)
        elif not configuration.gpus and found.cpus < configuration.cpus:
            print(f"taas: {name} needs {_count(configuration.cpus, 'vCPU')}, this machine has {found.cpus}: "
                  "running the cell in the kernel anyway", file=sys.stderr)

    def _settings(self) -> str:
        catalog = load_catalog()
        found = machine.detect()
        try:
            device = options.default_device()
        except TaasUsageError as e:
            device = f"invalid ({e})"
        names = ", ".join(catalog.names())
        return "\n".join([
            "start:               fork from this kernel; the fork server once CUDA was used here",
            f"fork server:         {self.forkserver_backend.describe()}",
            "cluster:             " + (f"{self.cluster_address} (cells run there; --on local runs one here)"
                                       if self.cluster_address else "none (%taas cluster ADDRESS connects one)"),
            f"configurations:      {'; '.join(catalog.sources)}",
            f"                     {names}",
            f"CUDA devices:        {found.cuda_devices} visible"
            + (" (CUDA was used in this kernel: ranks start from the fork server)"
               if machine.fork_poisoned_for_cuda() else ""),
            f"CPU cores:           {found.cpus}",
            f"default --device:    {device} (from TAAS_DEVICE)" if os.environ.get("TAAS_DEVICE")
            else f"default --device:    {device}",
            "default --gpus:      the configuration's GPUs per node, else 1",
            "default --output:    all (each line prefixed with its rank)",
            "default --timeout:   none",
            "default --start:     auto",
            "default --return:    every name the cell binds at top level (rank 0's values)",
            "default --cpus:      1 producer per registered loader the cell uses (0: no data delivery)",
        ])


class _ProgressDisplay:
    """Live progress lines of data delivery: one display area in the cell, updated in place."""

    def __init__(self) -> None:
        self.handle: Any = None  # IPython's DisplayHandle, once shown

    def show(self, lines: list[str]) -> None:
        from IPython.display import display

        data = {"text/plain": "\n".join(lines)}
        if self.handle is None:
            self.handle = display(data, raw=True, display_id=True)
        else:
            self.handle.update(data, raw=True)


def _count(number: int, unit: str) -> str:
    return f"{number} {unit}{'' if number == 1 else 's'}"


def _show_header_as_written(filename: str, source: str, cell: str, raw_cell: str) -> None:
    """Let tracebacks quote the user's `#!…` / `#pragma taas …` lines where the source has `# %%taas …`.

    The transformer (pragma.py) replaced them before the magic ran; the raw cell comes from the
    history, and is used only if its body is this cell's (not, say, an older cell when the
    history was not kept). Only the lines tracebacks quote change, not the code that runs.
    """
    lines = (raw_cell if raw_cell.endswith("\n") else raw_cell + "\n").splitlines(keepends=True)
    first = next((i for i, text in enumerate(lines) if text.strip()), 0)
    header = parse_header(lines[first:], lambda name: True)
    if header is None or header.options is None:
        return
    count = header.line_count
    if lines[first + count :] != cell.splitlines(keepends=True)[count - 1 :]:  # the cell starts with padding
        return
    shown = lines[first : first + count] + [line + "\n" for line in source.splitlines()][count:]
    linecache.cache[filename] = (len(source), None, shown, filename)


def _expand_variables(shell: InteractiveShell, line: str) -> str:
    """IPython's `$name` / `{expression}` expansion of the options line, as in any magic.

    IPython does it by copying the notebook's whole namespace first: milliseconds in a notebook
    that holds tens of thousands of names, on every cell. Lines without `$` or `{` (nearly all)
    have nothing to expand.
    """
    if "$" not in line and "{" not in line:
        return line
    return str(shell.var_expand(line, depth=3))  # the names seen where the magic was called: its locals too


def _import_torch_once() -> None:
    """Ranks need torch; importing it here once lets every forked rank share it for free."""
    import torch  # noqa: F401
    import torch.distributed  # noqa: F401
