"""A TVM RPC tracker and device server on localhost for the tests of ``--rpc`` (tuning and run-model): the
same processes a deployment starts (``python -m tvm.exec.rpc_tracker`` / ``rpc_server --tracker``)."""
from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from typing import Iterator

import pytest


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(args: list[str], port: int) -> subprocess.Popen:
    """Start a TVM RPC process (``python -m tvm.exec.*``) and wait until ``port`` accepts connections."""
    # a session of its own: the server forks a worker per connection, and stop() must end those too
    proc = subprocess.Popen([sys.executable, "-m", *args], env={**os.environ, "TVM_NUM_THREADS": "1"},
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.time() + 90
    while time.time() < deadline:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return proc
        time.sleep(0.5)
    stop([proc])
    pytest.fail(f"{args[0]} did not listen on {port}")


def stop(procs: list[subprocess.Popen]) -> None:
    """Kill each RPC process with the workers it started (its process group); killing only the server left
    its ``tvm.exec.popen_worker`` children running after the tests."""
    for proc in procs:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


@contextlib.contextmanager
def server() -> Iterator[str]:
    """``127.0.0.1:PORT`` of an RPC server."""
    port = free_port()
    procs = [start(["tvm.exec.rpc_server", "--host", "127.0.0.1", "--port", str(port), "--port-end", str(port + 1)],
                   port)]
    try:
        yield f"127.0.0.1:{port}"
    finally:
        stop(procs)


@contextlib.contextmanager
def tracker(key: str) -> Iterator[str]:
    """``127.0.0.1:PORT:KEY`` of a tracker with one device server registered under ``key``."""
    from tvm import rpc as tvm_rpc

    tracker_port, server_port = free_port(), free_port()
    procs = [start(["tvm.exec.rpc_tracker", "--host", "127.0.0.1", "--port", str(tracker_port),
                    "--port-end", str(tracker_port + 1)], tracker_port)]
    try:
        procs.append(start(["tvm.exec.rpc_server", "--host", "127.0.0.1", "--port", str(server_port),
                            "--port-end", str(server_port + 1), "--tracker", f"127.0.0.1:{tracker_port}",
                            "--key", key], server_port))
        deadline = time.time() + 60  # the server registers with the tracker after it starts listening
        client = tvm_rpc.connect_tracker("127.0.0.1", tracker_port)
        while not any(s.get("key") == f"server:{key}" for s in client.summary().get("server_info", [])):
            assert time.time() < deadline, "the RPC server never registered with the tracker"
            time.sleep(0.5)
        yield f"127.0.0.1:{tracker_port}:{key}"
    finally:
        stop(procs)
