"""The protocol between taas's processes: messages as frozen dataclasses, typed ends, and the docs' table.

Each protocol module in ``wire/`` says who sends which messages to whom (``DIRECTIONS``); the table
"Messages between processes" in docs/architecture.md must list exactly those, so a message added,
removed or redirected in the code shows up in the docs too.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import io
import pickle
import pkgutil
import typing
from types import ModuleType
from typing import Any, Callable, Iterator

import pytest
from support import ROOT

import taas_magic.wire
from taas_magic.wire import fork_server, rank_control, supervision
from taas_magic.wire.channel import ChannelBroken, new_secret, socket_pair
from taas_magic.wire.shipping import Shipment
from taas_magic.wire.task import CellOrder, KernelContext, LoaderPlan, RankTask, Returns, TorchSettings

ARCHITECTURE = ROOT / "docs" / "architecture.md"
SECTION = "## Messages between processes"


def protocol_modules() -> list[ModuleType]:
    """Every module of ``wire/`` that declares a conversation: found, not listed, so a new one counts."""
    modules = [
        importlib.import_module(f"taas_magic.wire.{info.name}")
        for info in pkgutil.iter_modules(taas_magic.wire.__path__)
    ]
    return [module for module in modules if hasattr(module, "DIRECTIONS")]


def messages_of(union: object) -> tuple[type, ...]:
    return typing.get_args(union) or (union,)


def declared() -> set[tuple[str, str, str]]:
    """(module.Message, sender, receiver) for every message of every protocol module."""
    rows = set()
    for module in protocol_modules():
        short = module.__name__.rsplit(".", 1)[1]
        for sender, receiver, union in module.DIRECTIONS:
            rows |= {(f"{short}.{message.__name__}", sender, receiver) for message in messages_of(union)}
    return rows


def documented() -> set[tuple[str, str, str]]:
    text = ARCHITECTURE.read_text()
    assert SECTION in text, f"docs/architecture.md has no section {SECTION!r}"
    section = text.split(SECTION, 1)[1].split("\n## ", 1)[0]
    rows = set()
    for line in section.splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if line.startswith("|") and len(cells) == 4 and cells[0].startswith("`"):
            rows.add((cells[0].strip("`"), cells[1], cells[2]))
    return rows


def test_the_docs_table_lists_exactly_the_messages_of_the_protocol_modules() -> None:
    assert {module.__name__ for module in protocol_modules()} >= {
        "taas_magic.wire.supervision",
        "taas_magic.wire.fork_server",
        "taas_magic.wire.rank_control",
    }
    code, docs = declared(), documented()
    assert not code - docs, f"messages missing from docs/architecture.md's table: {sorted(code - docs)}"
    assert not docs - code, f"rows of docs/architecture.md's table that no protocol declares: {sorted(docs - code)}"


def test_every_message_is_a_frozen_dataclass_of_typed_fields_with_a_name_per_direction() -> None:
    for module in protocol_modules():
        for sender, receiver, union in module.DIRECTIONS:
            kinds = []
            for message in messages_of(union):
                assert dataclasses.is_dataclass(message), message
                params = message.__dataclass_params__
                assert params.frozen, f"{message.__name__} is not frozen"
                assert isinstance(getattr(message, "kind", None), str), f"{message.__name__} has no kind"
                kinds.append(message.kind)
                for field in dataclasses.fields(message):
                    assert "Any" not in str(field.type), f"{message.__name__}.{field.name}: {field.type}"
            assert len(kinds) == len(set(kinds)), f"{sender} → {receiver}: two messages of one kind {kinds}"


@pytest.mark.parametrize("part", [RankTask, KernelContext, TorchSettings, LoaderPlan, rank_control.Reload])
def test_what_travels_inside_messages_is_frozen_and_typed_too(part: type) -> None:
    assert dataclasses.is_dataclass(part) and part.__dataclass_params__.frozen
    for field in dataclasses.fields(part):
        assert "Any" not in str(field.type), f"{part.__name__}.{field.name}: {field.type}"


class _Classes(pickle.Unpickler):
    """Unpickles as usual, noting the module of every class or function the pickle names."""

    def __init__(self, data: bytes) -> None:
        super().__init__(io.BytesIO(data))
        self.modules: set[str] = set()

    def find_class(self, module: str, name: str) -> Any:
        self.modules.add(module)
        return super().find_class(module, name)


def test_a_kernels_context_unpickles_without_torch_whatever_the_notebook_set() -> None:
    """A cluster node's agent passes the task on to its fork server unread; a torch object in it (the default
    dtype) made every agent import torch to unpickle it: about 2 s of CPU and 480 MB more per agent."""
    import torch

    saved = torch.get_default_dtype(), torch.is_grad_enabled()
    torch.set_default_dtype(torch.float64)
    torch.set_grad_enabled(False)
    try:
        context = KernelContext.of_this_process()
    finally:
        torch.set_default_dtype(saved[0])
        torch.set_grad_enabled(saved[1])
    reader = _Classes(pickle.dumps(context))
    assert reader.load() == context
    assert not {module for module in reader.modules if module.split(".")[0] == "torch"}, reader.modules
    assert context.torch_settings.default_dtype == "float64" and not context.torch_settings.grad_enabled


@contextlib.contextmanager
def connected(make_one: Callable[..., Any], make_other: Callable[..., Any], *run_id: str) -> Iterator[tuple[Any, Any]]:
    """The two ends of one conversation over a fresh socket pair, closed afterwards."""
    one_sock, other_sock = socket_pair()
    secret = new_secret()
    one, other = make_one(one_sock, secret, *run_id), make_other(other_sock, secret, *run_id)
    try:
        yield one, other
    finally:
        one.close()
        other.close()


def test_each_end_takes_only_the_other_direction() -> None:
    with connected(supervision.kernel_end, supervision.supervisor_end, "run-p") as (kernel, supervisor):
        kernel.send(supervision.SignalRanks(2, (0, 1)))
        assert supervisor.receive() == (supervision.SignalRanks(2, (0, 1)), [])
        supervisor.send(supervision.Lost("idle"))
        assert kernel.receive() == (supervision.Lost("idle"), [])
        supervisor.send(supervision.Close())  # a request, sent the wrong way
        with pytest.raises(ChannelBroken, match="unexpected message 'close'"):
            kernel.receive()


def test_a_rank_takes_a_session_cell_and_its_supervisor_the_cells_end() -> None:
    with connected(rank_control.supervisor_end, rank_control.rank_end, "run-r") as (supervisor, rank):
        returns = Returns(("x",), frozenset({0, 2}), running=frozenset({0, 2}))
        cell = rank_control.SessionCell(
            CellOrder(compile("x = 1", "<cell>", "exec"), returns), reload=rank_control.Reload(True)
        )
        supervisor.send(cell)
        received, _ = rank.receive()
        assert isinstance(received, rank_control.SessionCell) and received.order.returns == returns
        assert received.reload == rank_control.Reload(True)
        rank.send(rank_control.CellEnd(b"{}", None))
        assert supervisor.receive() == (rank_control.CellEnd(b"{}", None), [])


def test_the_fork_server_takes_run_requests_and_the_kernel_takes_nothing() -> None:
    with connected(fork_server.kernel_end, fork_server.server_end) as (kernel, server):
        request = fork_server.StartRun(
            "run-s",
            new_secret(),
            {},
            RankTask(CellOrder(compile("", "<cell>", "exec")), "cpu", 1),
            Shipment(b"", None, 0),
        )
        server.send(request)  # a request, sent the wrong way
        with pytest.raises(ChannelBroken, match="unexpected message 'run'"):
            kernel.receive()
