"""A rank's names on their way to the kernel over its control channel: a cell's end (``CellEnd``) and a pull's
answer (``Pulled``) carry them the same way."""

from __future__ import annotations

import os
from typing import Callable

from taas_magic.wire import memfile, results
from taas_magic.wire.channel import INLINE_LIMIT, ChannelBroken
from taas_magic.wire.rank_control import FromRank, RankEnd

# The message, made from the names' bytes when they travel in it, or else the size of the memory file beside it.
Message = Callable[[bytes | None, int | None], FromRank]


def send(control: RankEnd, message: Message, names: results.Packed | None) -> None:
    """``message`` with ``names``: small ones in it, larger ones in a sealed memory file beside it, which the
    supervisor hands on to the kernel as it is (``events.ResultInFile``) and the kernel maps. Nothing is sent
    once the session is over: the rank's next receive says so."""
    inline, in_file, fds = _parts(names) if names is not None else (None, None, [])
    try:
        control.send(message(inline, in_file), fds)
    except ChannelBroken:
        pass
    finally:
        for fd in fds:
            os.close(fd)


def _parts(packed: results.Packed) -> tuple[bytes | None, int | None, list[int]]:
    if packed.size <= INLINE_LIMIT:
        return packed.to_bytes(), None, []
    fd = memfile.new_file("taas-names", packed.size)
    try:
        packed.write(fd)
        memfile.seal(fd)
    except BaseException:
        os.close(fd)
        raise
    return None, packed.size, [fd]
