"""TileLang kernels built ahead of their first call, in worker processes, while torch.compile traces and compiles.

Each TileLang kernel is JIT-compiled the first time a launcher needs it: 3-50 s each (TVM's lowering, then nvcc),
and a GLM-5.2 layer with FP8 runs about thirty of them (the FP8 quantisers are built per tensor width), one after
another inside the first step. Here they build in parallel instead, from the moment their inputs are known:

- :func:`kernel_cache` makes a compile function (``(args) -> kernel``) cached in this process by its arguments,
  like ``functools.lru_cache``, and gives it ``ahead(*args)``, which builds the same kernel in a worker process
  into TileLang's disk cache. A later call here with those arguments waits for that build and loads the kernel
  from the disk cache (milliseconds) instead of compiling it.
- The ops' fake kernels announce their inputs when torch.compile traces them (:mod:`glm52_model.ops._trace`);
  each CUDA family listens and calls ``ahead`` for the kernels those inputs will run, through the same functions
  its launcher picks them with. Tracing a layer (its backward included, which AOTAutograd traces with the
  forward) so starts every build that layer's step needs, and they run beside Inductor's compile.

Workers are subprocesses running this module's ``_main`` (their own interpreter: nothing of the caller's script
runs again, and they see no GPU), at most :data:`WORKERS`, started by the first builds and stopped
:data:`IDLE_S` after the last. Nothing is built ahead where TileLang's disk cache is off (there would be nothing
to load) or with ``GLM52_BUILD_AHEAD=0``. A build that fails in a worker is built again at its first call here,
which raises the error where it belongs, and so is one that has not finished after :data:`WAIT_S` (with a warning);
a listener that fails warns once and tracing goes on.
"""
from __future__ import annotations

import functools
import inspect
import os
import pickle
import queue
import subprocess
import sys
import threading
import time
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Callable

from .. import _trace
from ._common import warn_once

# builds at once: each worker is one interpreter with torch and TileLang (0.4 GB resident once imported, more while
# it builds), and each build is mostly one core (TVM's passes, then nvcc); Inductor compiles its own kernels in a
# pool at the same time
WORKERS = max(1, min(8, (os.cpu_count() or 2) // 2))
IDLE_S = 30.0       # a worker with nothing to build for this long exits
WAIT_S = 600.0      # a first call waits this long for its build ahead, then builds it itself


def enabled() -> bool:
    """Whether kernels are built ahead: TileLang's disk cache on (where the builds meet) and GLM52_BUILD_AHEAD not 0."""
    if os.environ.get("GLM52_BUILD_AHEAD", "1") == "0":
        return False
    from tilelang import env
    return env.is_cache_enabled()


class _Workers:
    """A queue of builds served by up to :data:`WORKERS` worker subprocesses, one thread of this process each."""

    def __init__(self):
        self.lock = threading.Lock()
        self.jobs: queue.Queue = queue.Queue()
        self.pending: dict[tuple, Future] = {}      # every build submitted, by (compile function, arguments)
        self.threads: list[threading.Thread] = []
        self.idle = 0
        self.built: list[tuple[str, float]] = []
        self.first_calls = {"built ahead": 0, "compiled here": 0}   # kernels this process needed, by where from

    def submit(self, key: tuple, job: tuple) -> Future:
        with self.lock:
            fut = self.pending.get(key)
            if fut is None:
                fut = self.pending[key] = Future()
                self.jobs.put((job, fut))
                if len(self.threads) < WORKERS and self.jobs.qsize() > self.idle:
                    t = threading.Thread(target=self._serve, name="glm52-build-ahead", daemon=True)
                    self.threads.append(t)
                    t.start()
            return fut

    def waiting(self, key: tuple) -> Future | None:
        with self.lock:
            return self.pending.get(key)

    def _serve(self) -> None:
        proc = None
        try:
            while True:
                with self.lock:
                    self.idle += 1
                try:
                    job, fut = self.jobs.get(timeout=IDLE_S)
                except queue.Empty:
                    with self.lock:
                        self.idle -= 1
                        if self.jobs.empty():
                            self.threads.remove(threading.current_thread())
                            return
                    continue
                with self.lock:
                    self.idle -= 1
                if proc is None:
                    proc = _start_worker()
                try:
                    pickle.dump(job, proc.stdin)
                    proc.stdin.flush()
                    error, seconds = pickle.load(proc.stdout)
                except Exception as e:  # the worker died: this build fails here, the next job gets a new worker
                    error, seconds = f"the build-ahead worker failed: {e!r}", 0.0
                    proc.kill()
                    proc = None
                if error is None:
                    self.built.append((f"{job[1]}{job[2]}", seconds))
                fut.set_result(error)
        finally:
            if proc is not None:
                proc.stdin.close()
                proc.wait()


def _start_worker() -> subprocess.Popen:
    """A worker interpreter that sees no GPU and imports this package from where this process did."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    path = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", GLM52_BUILD_AHEAD="0", PYTHONPATH=path)
    return subprocess.Popen([sys.executable, "-c", f"from {__name__} import _main; _main()"], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, env=env)


_WORKERS = _Workers()


def built() -> list[tuple[str, float]]:
    """(compile function and arguments, seconds) of each build the workers finished for this process, in order."""
    return list(_WORKERS.built)


def first_calls() -> dict:
    """How many kernels this process's launchers needed, by where each came from: "built ahead" (a worker's build,
    loaded from the disk cache) or "compiled here" (at the first call: TileLang's disk cache may still have held
    it from an earlier process)."""
    return dict(_WORKERS.first_calls)


def kernel_cache(fn: Callable) -> Callable:
    """``fn`` (a module-level TileLang compile function of picklable arguments) cached by its arguments, with
    ``.ahead(*args, **kwargs)``: the same build started in a worker (a no-op where it is cached here or already
    started, or where :func:`enabled` is False). A call waits for a build started ahead with its arguments, then
    loads it from TileLang's disk cache. ``__wrapped__`` is ``fn`` itself (uncached)."""
    signature = inspect.signature(fn)
    cache: dict = {}
    name = f"{fn.__module__}.{fn.__qualname__}"

    def key_of(args, kwargs) -> tuple:
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        return tuple(bound.arguments.values())

    @functools.wraps(fn)
    def compile_kernel(*args, **kwargs):
        key = key_of(args, kwargs)
        kernel = cache.get(key)
        if kernel is None:
            fut = _WORKERS.waiting((name, key))
            # None, or the worker's error: then this compiles here and raises what it raises
            ahead_ok = fut is not None and _result(fut, name) is None
            _WORKERS.first_calls["built ahead" if ahead_ok else "compiled here"] += 1
            kernel = cache[key] = fn(*key)
        return kernel

    def ahead(*args, **kwargs) -> Future | None:
        key = key_of(args, kwargs)
        if key in cache or not enabled():
            return None
        return _WORKERS.submit((name, key), (fn.__module__, fn.__qualname__, key))

    compile_kernel.ahead = ahead
    compile_kernel.cache_clear = cache.clear
    return compile_kernel


def _result(fut: Future, name: str):
    """The worker's answer, or a warning and "late" where it takes over WAIT_S (the build then runs here too)."""
    try:
        return fut.result(timeout=WAIT_S)
    except FutureTimeout:
        warn_once(f"build-ahead:late:{name}", f"glm52_model.ops.cuda.ahead: a build of {name} ahead of its first call "
                                              f"took over {WAIT_S:.0f} s in its worker; it is built here instead")
        return "late"


def on_trace(op: str, fn: Callable) -> None:
    """``fn(*op's args)`` starts the builds a traced call of ``op`` will need (``compile_fn.ahead``): it listens to
    ``op``'s fake (:func:`glm52_model.ops._trace.listen`), runs only where :func:`enabled`, and an error in it warns
    once (the kernels are then built at their first call, as without it)."""
    @functools.wraps(fn)
    def listen(*args, **kwargs):
        try:
            if enabled():
                fn(*args, **kwargs)
        except Exception as e:
            warn_once(f"build-ahead:{fn.__qualname__}",
                      f"glm52_model.ops.cuda.ahead: starting kernel builds ahead failed in {fn.__qualname__} "
                      f"({e!r}); those kernels build at their first call instead")
    _trace.listen(op, listen)


def static(*sizes) -> bool:
    """Whether every size a kernel would be built for is a plain int: a traced symbolic one is left alone (computing
    with it would guard on it)."""
    return all(isinstance(d, int) for d in sizes)


def _main() -> None:
    """Worker: builds (module, compile function's qualname, arguments) jobs from stdin, one after another, and
    answers each with (None or the error, seconds) on the stdout it was started with; its own prints go to stderr."""
    out = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    import importlib

    import glm52_model.ops  # noqa: F401  (the ops, then the CUDA families)
    while True:
        try:
            module, qualname, args = pickle.load(sys.stdin.buffer)
        except EOFError:
            return
        t0 = time.perf_counter()
        try:
            fn = functools.reduce(getattr, qualname.split("."), importlib.import_module(module))
            fn.__wrapped__(*args)
            error = None
        except Exception as e:
            error = f"{type(e).__name__}: {e}"
        pickle.dump((error, time.perf_counter() - t0), out)
        out.flush()


