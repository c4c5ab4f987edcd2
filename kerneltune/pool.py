"""Worker processes for the measurer: spawned once, reused, replaced when a call hangs or kills them.

A worker serves calls named ``"module:function"`` (the function is imported in the worker), so the pool
knows nothing about building or running.  Why our own pool and not ``concurrent.futures``: a call that
hangs past its timeout or crashes its process (a pathological kernel, a compiler abort) must be recorded
as a failure and the worker replaced - the tuner never dies with it.  The timeout is enforced by the parent
(``poll`` on the pipe), so it holds even when the worker is stuck in native code.
"""
from __future__ import annotations

import importlib
import multiprocessing as mp
import os
import queue
import signal
import sys
import traceback
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Sequence


def short_error(exc: BaseException, limit: int = 200) -> str:
    """One line: the last non-empty line of the message (TVM errors put the reason there)."""
    lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
    text = f"{type(exc).__name__}: {lines[-1] if lines else ''}"
    return text[:limit]


def loaded_modules() -> list[str]:
    """The modules a worker has imported (tests check that builders never load the slow ones)."""
    return sorted(sys.modules)


def _resolve(name: str, cache: dict[str, Callable]) -> Callable:
    fn = cache.get(name)
    if fn is None:
        module, _, func = name.partition(":")
        fn = cache[name] = getattr(importlib.import_module(module), func)
    return fn


def _serve(conn, env: dict[str, str]) -> None:
    """Worker main loop: receive (function name, args), reply (True, value) or (False, invalid?, message,
    traceback); ``invalid`` marks a config the template refused (its InvalidConfig).

    Ctrl-C reaches the whole process group; the parent handles it (and ends its workers), so a worker
    ignores SIGINT instead of printing a KeyboardInterrupt traceback.  A parent that is gone (killed, or
    exited) shows up as a closed pipe: the worker ends quietly instead of printing a BrokenPipeError."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    os.environ.update(env)
    funcs: dict[str, Callable] = {}
    while True:
        try:
            name, args = conn.recv()
        except (EOFError, OSError):
            return
        try:
            reply = (True, _resolve(name, funcs)(*args))
        except Exception as exc:  # noqa: BLE001 - reported to the parent as a failed item
            reply = (False, exc.__class__.__name__ == "InvalidConfig", short_error(exc), traceback.format_exc())
        try:
            conn.send(reply)
        except (BrokenPipeError, ConnectionResetError, EOFError, OSError):
            return


class Worker:
    """One spawned process serving calls; replaced when a call times out or the process dies."""

    WARM_TIMEOUT = 300.0

    def __init__(self, ctx, env: dict[str, str], warm: str | None):
        self._ctx, self._env, self._warm = ctx, env, warm
        self.generation = -1  # bumped per process start: state cached in the process dies with it
        self._start()

    def _start(self) -> None:
        self.generation += 1
        self.conn, child = self._ctx.Pipe()
        self.proc = self._ctx.Process(target=_serve, args=(child, self._env), daemon=True)
        self.proc.start()
        child.close()
        self._warming = self._warm is not None
        if self._warming:
            self.conn.send((self._warm, ()))  # imports run while the parent does other work

    def _await_warm(self) -> None:
        if self.conn.poll(self.WARM_TIMEOUT):
            self.conn.recv()

    def call(self, name: str, args: tuple, timeout: float) -> tuple[str, Any]:
        """("ok", value) | ("invalid", msg) | ("error", msg) | ("timeout", None) | ("crash", msg)."""
        try:
            if self._warming:
                self._warming = False
                self._await_warm()
            self.conn.send((name, args))
            if not self.conn.poll(timeout):
                self.restart()
                return "timeout", None
            reply = self.conn.recv()
        except (EOFError, BrokenPipeError, ConnectionResetError, OSError):
            code = self.proc.exitcode
            self.restart()
            return "crash", f"worker died (exit code {code})"
        if reply[0]:
            return "ok", reply[1]
        return ("invalid" if reply[1] else "error"), reply[2]

    def restart(self) -> None:
        self.kill()
        self._start()

    def kill(self) -> None:
        if self.proc.is_alive():
            self.proc.kill()
        self.proc.join(timeout=10)
        self.conn.close()


class WorkerPool:
    """Fixed set of workers (each warmed with the ``warm`` call at start); ``map`` runs calls on free
    workers from parent threads."""

    def __init__(self, n: int, env: dict[str, str], warm: str | None = None):
        ctx = mp.get_context("spawn")
        self.workers = [Worker(ctx, env, warm) for _ in range(n)]
        self._free: queue.Queue[Worker] = queue.Queue()
        for w in self.workers:
            self._free.put(w)
        self._threads = ThreadPoolExecutor(max_workers=n)

    def call(self, name: str, args: tuple, timeout: float) -> tuple[str, Any]:
        w = self._free.get()
        try:
            return w.call(name, args, timeout)
        finally:
            self._free.put(w)

    def map(self, fn: Callable[[Any], Any], items: Sequence[Any]) -> list[Any]:
        return list(self._threads.map(fn, items))

    def close(self) -> None:
        self._threads.shutdown(wait=True)
        for w in self.workers:
            w.kill()
