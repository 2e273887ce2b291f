"""A run's store served by a process of its own (a cluster's node 0, whose supervisor forks again in a session): it
serves every client, takes the supervisor's keys, and ends with its port closed when closed or when the process that
forked it dies."""

from __future__ import annotations

import datetime
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time

import psutil
import pytest

from taas_magic.launch import rendezvous

torch_distributed = pytest.importorskip("torch.distributed")


def client(port: int) -> object:
    return torch_distributed.TCPStore(
        "127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=10), use_libuv=False
    )


def refused(port: int) -> bool:
    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", port)) != 0


def test_it_serves_clients_and_the_keys_set_here_and_ends_with_its_port_when_closed():
    listener = rendezvous.listen("127.0.0.1")
    port = listener.getsockname()[1]
    store = rendezvous.serve_apart(listener.detach(), "127.0.0.1", port, 2)
    try:
        reader, writer = client(port), client(port)
        writer.set("from a rank", "1")
        store.set("from the supervisor", "2")
        assert (reader.get("from a rank"), reader.get("from the supervisor")) == (b"1", b"2")
        # What this process forks now has no server thread of the store's to inherit: a fork connects at once.
        pid = os.fork()
        if pid == 0:
            try:
                client(port).set("from a fork", "3")
            finally:
                os._exit(0)
        os.waitpid(pid, 0)
        assert reader.get("from a fork") == b"3"
        assert psutil.Process(store.pid).ppid() == os.getpid()
        assert not [f for f in psutil.Process(store.pid).open_files()], "it holds nothing of this process's open"
    finally:
        store.close()
    assert not psutil.pid_exists(store.pid) or psutil.Process(store.pid).status() == psutil.STATUS_ZOMBIE
    assert refused(port)


def test_it_ends_when_the_process_that_forked_it_is_killed():
    script = textwrap.dedent(
        """
        import sys, time
        from taas_magic.launch import rendezvous
        listener = rendezvous.listen("127.0.0.1")
        port = listener.getsockname()[1]
        store = rendezvous.serve_apart(listener.detach(), "127.0.0.1", port, 1)
        print(port, store.pid, flush=True)
        time.sleep(60)
        """
    )
    parent = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        port, pid = map(int, parent.stdout.readline().split())
        client(port).set("served", "yes")
        parent.send_signal(signal.SIGKILL)
        parent.wait(10)
        deadline = time.monotonic() + 10
        while psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
            assert time.monotonic() < deadline, "the store's process outlived the process that forked it"
            time.sleep(0.05)
        assert refused(port)
    finally:
        parent.kill()
        parent.wait()
