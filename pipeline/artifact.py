"""The built directory a user ships, and the loader that runs it without the tuning stack.

``optimize-model -o DIR`` writes ``DIR/model.so`` (the Relax VM executable exported as a shared library),
``optimized.onnx`` (the graph it was compiled from), ``report.json`` (written last: its presence means a
complete run) and ``report.md``.  ``report.json`` holds what a loader needs besides the library (:func:`deployment`):
the TVM device type, the LLVM triple the host code is built for, and the signature: input names in call order,
their dtypes and the fixed shapes the library was compiled for, and the outputs in return order.

:class:`Model` loads such a directory with the TVM runtime alone (``tvm.runtime.load_module`` +
``relax.VirtualMachine``, https://tvm.apache.org/docs/how_to/tutorials/export_and_load_executable.html),
checks the feeds against the signature (a wrong name, shape or dtype is one line naming the expected one, not a
crash inside a kernel) and returns the outputs by name.  The ``deploy`` section also records the size and sha256
of model.so (and of a GPU code object beside it) and a checksum of the section itself: the loader checks them
before it loads the library, because a truncated library (an interrupted copy) kills the process with SIGBUS
when loaded, and a library of another build or an edited signature fail inside the VM.  A folder written
before these fields existed still loads.  Nothing from kerneltune's measurement, the graph
search or the templates is imported on this path.

With ``rpc="HOST:PORT:KEY"`` (a TVM RPC tracker, ``python -m tvm.exec.rpc_tracker``, and a device server
registered under KEY, ``python -m tvm.exec.rpc_server --tracker HOST:PORT --key KEY``; or ``HOST:PORT`` of a
server) the library is uploaded to that device and run there, as TVM's own cross-compilation tutorial does
(https://tvm.apache.org/docs/how_to/tutorials/cross_compilation_and_rpc.html): a build for another CPU
architecture runs on a device of that architecture without copying the folder by hand.  The inputs and
outputs travel over the connection; latencies are taken by the device's own timer (``time_evaluator``), so
they do not include the network.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import stat
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from graphopt import rlimits
from graphopt.errors import UserError
from graphopt.fileio import check_output_dir, write_bytes_atomic
from kerneltune.native_log import quiet_native_stderr
from kerneltune.targets.host import arch_of, host_arch, missing_cpu_features
from kerneltune.targets.threads import fork_safe, use_threads
from pipeline import cpu_pool

log = logging.getLogger(__name__)

LIBRARY, GRAPH, REPORT, REPORT_MD = "model.so", "optimized.onnx", "report.json", "report.md"


@dataclass(frozen=True)
class TensorSpec:
    """One input or output of the compiled model: its shape is the compiled one (None: not known); ``value``
    the only value an input may take when the build is specialized on it (:mod:`graphopt.specialize`), as
    JSON (a number or nested lists), else None."""

    name: str
    dtype: str
    shape: tuple[int | None, ...] | None
    value: Any = None
    # a build serving a range (pipeline.symbolic): axis -> (dimension name, lowest, highest size); ``shape``
    # holds the representative size on that axis (the random inputs' size)
    ranges: Mapping[int, tuple[str, int, int]] | None = None

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> "TensorSpec":
        shape = d.get("shape")
        ranges = {int(r["axis"]): (str(r["dim"]), int(r["min"]), int(r["max"])) for r in d.get("ranges") or []}
        return cls(str(d["name"]), str(d["dtype"]), None if shape is None else tuple(shape), d.get("value"),
                   ranges or None)

    def to_json(self) -> dict[str, Any]:
        out = {"name": self.name, "dtype": self.dtype, "shape": list(self.shape) if self.shape is not None else None}
        if self.ranges:
            out["ranges"] = [{"axis": a, "dim": n, "min": lo, "max": hi} for a, (n, lo, hi) in self.ranges.items()]
        return out if self.value is None else out | {"value": self.value}

    @property
    def accepted_shape(self) -> tuple[int | None, ...] | None:
        """The shape a feed must have: ``shape`` with a ranged axis free (None)."""
        if self.shape is None:
            return None
        return tuple(None if a in (self.ranges or {}) else d for a, d in enumerate(self.shape))

    def shape_error(self, shape: tuple[int, ...]) -> str | None:
        """What is wrong with a feed of ``shape`` for this input (one line), or None."""
        want = self.accepted_shape
        if want is None:
            return None
        if len(shape) != len(want) or any(d is not None and d != v for d, v in zip(want, shape)):
            ranges = self.ranges or {}
            shown = [f"{ranges[a][0]}={ranges[a][1]}..{ranges[a][2]}" if a in ranges else d
                     for a, d in enumerate(self.shape)]
            return (f"input {self.name!r} has shape {list(shape)}, model.so is compiled for "
                    f"{'[' + ', '.join(map(str, shown)) + ']'}; rebuild with --input-shape {self.name}="
                    f"{','.join(map(str, shape))} for other sizes")
        for axis, (dim, lo, hi) in (self.ranges or {}).items():
            if not lo <= shape[axis] <= hi:
                return (f"input {self.name!r} has {dim}={shape[axis]} (axis {axis}), outside the sizes {lo}..{hi} "
                        f"model.so serves: rebuild with --dim {dim}=LO:HI covering {shape[axis]}")
        return None


def tensor_specs(infos: Sequence[Any], values: Mapping[str, np.ndarray] | None = None,
                 ranges: Mapping[str, Mapping[int, tuple[str, int, int]]] | None = None) -> list[TensorSpec]:
    """graphopt IR ``TensorInfo`` s -> specs (symbolic dims become None); ``values``: the inputs the build is
    specialized on; ``ranges``: the served axes of each input (:func:`pipeline.symbolic.input_ranges`)."""
    values, ranges = values or {}, ranges or {}
    return [TensorSpec(t.name, t.dtype, None if t.shape is None else tuple(d if isinstance(d, int) else None
                                                                             for d in t.shape),
                       np.asarray(values[t.name]).tolist() if t.name in values else None,
                       dict(ranges[t.name]) if t.name in ranges else None) for t in infos]


def deployment(spec: Any, inputs: Sequence[TensorSpec], outputs: Sequence[TensorSpec],
               directory: Path) -> dict[str, Any]:
    """report.json's ``deploy`` section: what loading ``model.so`` needs (``spec`` a kerneltune TargetSpec),
    with the size and hash of the libraries already written to ``directory`` and the section's checksum."""
    lib = directory / LIBRARY
    shipped = [p for p in (lib, lib.with_suffix(".hsaco")) if p.is_file()]  # the GPU code object beside it
    section = {
        "library": LIBRARY, "device": spec.device, "triple": spec.triple, "arch": arch_of(spec.triple),
        "target": str(spec.target),  # the CPU features the code needs: under the checksum, read by the loader
        "runs_on_build_machine": bool(spec.can_run),
        "inputs": [t.to_json() for t in inputs],
        "outputs": [t.to_json() for t in outputs],
        "shapes_note": "model.so is compiled for these input shapes only (rebuild with --input-shape for "
                       "others), but for an input's ranges: any size from min to max on that axis; "
                       "optimized.onnx keeps the input model's symbolic dimensions where it can "
                       "(report.json's dynamic_shapes says which, and how that was checked)",
        "files": {p.name: file_digest(p) for p in shipped},
    }
    return section | {"checksum": section_checksum(section)}


def file_digest(path: Path) -> dict[str, Any]:
    """Size and sha256 of a built file, read in blocks (a library can be hundreds of MB)."""
    with open(path, "rb") as f:
        digest = hashlib.file_digest(f, "sha256").hexdigest()
    return {"bytes": path.stat().st_size, "sha256": digest}


def section_checksum(section: Mapping[str, Any]) -> str:
    """sha256 of the deploy section without its checksum, keys sorted: an edit of the signature (a dtype, a
    shape) or of the recorded hashes changes it."""
    body = {k: v for k, v in section.items() if k != "checksum"}
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


def read_report(directory: str | os.PathLike) -> dict[str, Any]:
    """DIR/report.json of a complete build, with its ``deploy`` section; a UserError otherwise."""
    d = Path(directory)
    if not d.is_dir():
        raise UserError(f"{str(d)!r} is not a folder: give the -o folder of optimize-model")
    path = d / REPORT
    try:
        report = json.loads(path.read_text())
    except FileNotFoundError:
        raise UserError(f"{str(d)!r} has no {REPORT}: not a complete optimize-model output (rerun optimize-model "
                        f"-o {d})") from None
    except (OSError, ValueError) as exc:
        raise UserError(f"cannot read {str(path)!r} ({exc}); rerun optimize-model -o {d}") from None
    if not isinstance(report, dict) or "deploy" not in report:
        raise UserError(f"{str(path)!r} has no deploy section: it was written by an older optimize-model; rerun it")
    if not (d / LIBRARY).is_file():
        raise UserError(f"{str(d)!r} has no {LIBRARY}; rerun optimize-model -o {d}")
    return report


def versioned_path(library: Path) -> Path:
    """A path naming this version of ``library``, to load it by.  dlopen hands back the library it already
    loaded from a path without reading the file again, and TVM keeps every library it loads for the process'
    life, so a model rebuilt into the same folder in one process (optimize twice, or optimize and load) ran
    the first build's kernels, even once the first model was gone: builds of one model at several lengths
    into one folder refused every length but the first's.  A symbolic link named by the file's identity
    (device, inode, size, modification time; builds write the library atomically, as a new file) is a new
    path for each build and the same one for the same build, whose loads then share one handle (as
    :func:`pipeline.cpu_pool.install` needs).  The library's own path where no link can be made."""
    file = library.stat()
    links = Path(tempfile.gettempdir()) / f"optimize-model-{os.getuid()}-libraries"
    link = links / f"{file.st_dev}-{file.st_ino}-{file.st_size}-{file.st_mtime_ns}.so"
    try:
        links.mkdir(mode=0o700, exist_ok=True)
        info = links.lstat()
        if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid() or info.st_mode & 0o077:
            return library  # a folder someone else could write links into: never load through it
        target = library.resolve()
        if not (link.is_symlink() and link.resolve() == target):
            part = links / f".{link.name}.{os.getpid()}.{threading.get_ident()}"
            part.unlink(missing_ok=True)
            part.symlink_to(target)
            os.replace(part, link)  # another process' link to the same file is as good
    except OSError:
        return library
    return link


class Model:
    """A compiled model ready to run on numpy inputs: ``Model.load(DIR)`` or :func:`pipeline.optimize`.

    The library is loaded at the first run, so a cross-compiled build can still be inspected and saved on
    the build machine.  ``threads`` sizes TVM's CPU thread pool; TVM starts that pool once per process, so it
    applies only if no TVM kernel ran in this process before (a warning says so otherwise)."""

    def __init__(self, directory: str | os.PathLike, report: dict[str, Any], threads: int | None = None,
                 rpc: str | None = None):
        self.directory = Path(directory)
        self.report = report
        self.rpc = rpc  # None: this machine; else the --rpc device the library is uploaded to
        dep = report["deploy"]
        self.inputs, self.outputs = _signature(self.directory, dep)
        self.device_type = str(dep["device"])
        self.requested_threads = threads
        self.threads: int | None = None  # the pool's size once loaded
        self._main = self._dev = self._vm = self._session = self._lib = None
        self._local = threading.local()  # this thread's VM (see _entry)
        self._remote_lock = threading.Lock()  # one call at a time over the --rpc session

    def _load(self) -> None:
        """Load model.so on the device: a UserError when this machine cannot run it."""
        if self._main is not None:
            return
        check_files(self.directory, self.report["deploy"])
        if self.rpc:
            self._load_remote()
            return
        dep = self.report["deploy"]
        if dep.get("arch") and dep["arch"] != host_arch():
            raise UserError(f"{self.directory} is built for {dep['triple']}, this machine is {host_arch()}: copy the "
                            "folder to such a machine and run it there")
        refusal = rlimits.shortfall(rlimits.RUN_ADDRESS_SPACE)
        if refusal:
            raise UserError(refusal)
        self.threads = _size_pool(self.requested_threads)
        import tvm
        import tvm_ffi

        target = dep.get("target") or self.report.get("target_detail")  # the latter: folders before 0.1 r4
        if self.device_type == "cpu" and target:
            missing = missing_cpu_features(tvm.target.Target(json.loads(target)))
            if missing:
                raise UserError(f"{self.directory} is built for a CPU with {', '.join(missing[:6])}, which this CPU "
                                "lacks: run it on such a CPU, or rebuild with --target llvm")

        if not tvm.runtime.enabled(self.device_type) or not tvm.device(self.device_type, 0).exist:
            raise UserError(f"{self.directory} is built for {self.device_type}, which this TVM runtime cannot run "
                            f"here (no such device, or no {self.device_type} support in this TVM build)")
        self._dev = tvm.device(self.device_type, 0)
        library = versioned_path(self.directory / LIBRARY)
        try:
            with quiet_native_stderr():  # one "Scope Loaded" warning per kernel otherwise
                # tvm_ffi's loader, which tvm.runtime.load_module calls after resolving the link to the folder's
                # own path (and so to the library first loaded from it)
                lib = tvm_ffi.load_module(str(library))
        except (RuntimeError, OSError) as exc:
            first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]
            raise UserError(f"cannot load {self.directory / LIBRARY} ({first}); rebuild it with optimize-model for "
                            "this machine") from None
        if self.device_type == "cpu":  # the library's own launcher, where it has one (pipeline.cpu_pool)
            cpu_pool.install(library, self.threads)
        self._lib = lib
        self._main = self._entry()

    def _entry(self):
        """The VM entry point for the calling thread.  A Relax VM keeps its frames in the VM object, so two
        threads calling one VM corrupt each other's registers (a TVM InternalError); each thread gets its own
        VM over the one loaded library, as a web server's request threads need."""
        main = getattr(self._local, "main", None)
        if main is None:
            from tvm import relax

            main = self._local.main = relax.VirtualMachine(self._lib, self._dev)["main"]
        return main

    def _load_remote(self) -> None:
        """Upload model.so (and a GPU code object beside it) to the --rpc device and load it there."""
        from tvm import relax

        from kerneltune.runner import check_device, open_session

        check_device(self.rpc)  # unreachable tracker, no server under the key: one line naming --rpc
        try:
            sess = open_session(self.rpc, 0)  # 0: the session lives as long as the run needs
            for name in (LIBRARY, self.report.get("files", {}).get("code_object")):
                if name:
                    sess.upload(str(self.directory / name))
            with quiet_native_stderr():
                lib = sess.load_module(LIBRARY)
            dev = sess.device(self.device_type, 0)
            if self.requested_threads:  # the server's pool, as TVM's RPC tutorials size it (1: big cores)
                sess.get_function("runtime.config_threadpool")(1, int(self.requested_threads))
            self.threads = int(sess.get_function("runtime.NumThreads")())
            vm = relax.VirtualMachine(lib, dev)
        except Exception as exc:  # noqa: BLE001 - the device's failure, reported as one line
            first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]
            raise UserError(f"cannot run {self.directory / LIBRARY} on the --rpc device {self.rpc} ({first}); is it "
                            f"a {self.report['deploy'].get('arch') or self.device_type} device with a TVM runtime "
                            "of this version?") from None
        self._session, self._dev, self._vm = sess, dev, vm
        self._main = vm["main"]

    @classmethod
    def load(cls, directory: str | os.PathLike, threads: int | None = None, rpc: str | None = None) -> "Model":
        return cls(directory, read_report(directory), threads, rpc)

    # ---- running ---------------------------------------------------------------------------------------

    def _arguments(self, feeds: Mapping[str, Any] | Sequence[Any]) -> list:
        """Feeds (by name, or a sequence in input order) checked against the signature, on the device."""
        import tvm

        self._load()
        if not isinstance(feeds, Mapping):
            feeds = list(feeds)
            if len(feeds) != len(self.inputs):
                raise UserError(f"{len(feeds)} inputs given, the model takes {len(self.inputs)}: "
                                f"{', '.join(t.name for t in self.inputs)}")
            feeds = {t.name: v for t, v in zip(self.inputs, feeds)}
        names = [t.name for t in self.inputs]
        missing, extra = [n for n in names if n not in feeds], sorted(set(feeds) - set(names))
        if missing or extra:
            raise UserError(f"inputs {'missing: ' + ', '.join(missing) if missing else ''}"
                            f"{'; ' if missing and extra else ''}{'unknown: ' + ', '.join(extra) if extra else ''}"
                            f"; the model takes {', '.join(names)}")
        args = []
        for t in self.inputs:
            value = _cast(t, np.asarray(feeds[t.name]))
            problem = t.shape_error(value.shape)
            if problem:
                raise UserError(problem)
            if t.value is not None and not np.array_equal(value, np.asarray(t.value, dtype=t.dtype)):
                raise self._specialized_error(t, value)
            # order="C", not np.ascontiguousarray: that makes a rank-0 (scalar) input 1-d, which the VM refuses
            args.append(tvm.runtime.tensor(np.asarray(value, order="C"), self._dev))
        return args

    def _specialized_error(self, spec: TensorSpec, value: np.ndarray) -> UserError:
        """The one line refusing a value other than the one the build is specialized on: what that value
        decides (report.json's ``specialized``) and the rebuild that serves the new one."""
        why = ((self.report.get("specialized") or {}).get("why") or {}).get(spec.name)
        given = value.tolist()
        return UserError(f"input {spec.name!r} is {given}, but {self.directory} is built for {spec.name}={spec.value} "
                         f"only ({'it decides ' + why if why else 'the build is specialized on it'}); rebuild with "
                         f"optimize-model --inputs FILE.npz holding {spec.name}={given} to run that value")

    @fork_safe  # TVM's pool (OPTIMIZE_MODEL_POOL=tvm) in a forked child: on a thread with a pool of its own
    def run(self, feeds: Mapping[str, Any] | Sequence[Any]) -> dict[str, np.ndarray]:
        """One inference: inputs by name (or in order), outputs by name in the model's output order."""
        args = self._arguments(feeds)
        try:
            if self._vm is not None:  # over RPC: the stateful calls (a tuple result cannot come back directly)
                with self._remote_lock:
                    self._vm.set_input("main", *args)
                    self._vm.invoke_stateful("main")
                    values = outputs_numpy(self._vm.get_outputs("main"))
            else:
                values = outputs_numpy(self._entry()(*args))
        except ValueError as exc:
            raise self._signature_error(exc) from None
        except AssertionError as exc:  # model.so's own check of a value it is built for (pipeline.passes.value_guard)
            raise UserError(_vm_message(exc)) from None
        return {t.name: v for t, v in zip(self.outputs, values)}

    def _signature_error(self, exc: ValueError) -> Exception:
        """The VM's own check of an argument against the compiled signature failed although the feeds matched
        report.json's: the two disagree (a folder without hashes whose report.json was edited).  Another
        ValueError is returned as it is."""
        m = _VM_PARAM_RE.search(str(exc))
        if not m:
            return exc
        detail = str(exc)[m.end():].strip().splitlines()[0][:160]
        return UserError(f"{self.directory / LIBRARY} rejects input {m.group(1)!r} ({detail}): report.json's "
                         "signature does not match the library; copy the folder again or rebuild")

    @fork_safe
    def latency(self, feeds: Mapping[str, Any] | Sequence[Any], runs: int, warmup: int | None = None,
                duration_s: float | None = None):
        """The latency distribution of ``runs`` back-to-back inferences on ``feeds`` (with ``duration_s``: of
        as many as fit in that many seconds) after ``warmup`` untimed ones (default
        :data:`graphopt.timing.WARMUP`; :func:`graphopt.timing.latency`); on an --rpc device each call timed
        by the device itself."""
        from graphopt.timing import WARMUP, latency, latency_of

        warmup = WARMUP if warmup is None else warmup
        if self.rpc is None:
            return latency(self.runner(feeds), runs, warmup, duration_s)
        args = self._arguments(feeds)
        self._vm.set_input("main", *args)
        for _ in range(max(0, warmup - 1)):  # time_evaluator makes one more untimed call itself
            self._vm.invoke_stateful("main")
        if duration_s is not None:  # the device's timer takes a count: the count a first call says fits
            probe = self._vm.time_evaluator("invoke_stateful", self._dev, number=1, repeat=1)("main").mean
            runs = max(1, int(duration_s / max(probe, 1e-6)))
        timer = self._vm.time_evaluator("invoke_stateful", self._dev, number=1, repeat=runs)
        return latency_of([s * 1e3 for s in timer("main").results])

    def runner(self, feeds: Mapping[str, Any] | Sequence[Any]):
        """A callable running one inference on ``feeds`` (already on the device) and waiting for it: for
        :mod:`graphopt.timing` (this machine only: over RPC each call would include the network)."""
        if self.rpc is not None:
            raise UserError("a per-call runner times the network too on an --rpc device: use Model.latency")
        args = self._arguments(feeds)  # first: it loads the library the VM runs
        return fork_safe(synced(self._entry(), args, self._dev))

    def instrumentable(self, feeds: Mapping[str, Any] | Sequence[Any]):
        """(a VM of its own over the loaded library, ``feeds`` on the device, the device): for timing each
        kernel call (:func:`pipeline.pricing.profile.time_calls`), whose instrument must not stay on the VM that
        :meth:`run` uses.  This machine only."""
        if self.rpc is not None:
            raise UserError("a per-kernel profile times the network too on an --rpc device: profile on the "
                            "device itself")
        from tvm import relax

        args = self._arguments(feeds)  # loads the library
        return relax.VirtualMachine(self._lib, self._dev), args, self._dev

    # ---- inputs and the reference ------------------------------------------------------------------------

    def graph_path(self) -> Path:
        """optimized.onnx, the graph the library was compiled from: what onnxruntime runs beside it."""
        path = self.directory / GRAPH
        if not path.is_file():
            raise UserError(f"{str(self.directory)!r} has no {GRAPH}, which the check inputs and the onnxruntime "
                            "reference need; copy it along with model.so")
        return path

    @property
    def served(self) -> dict[str, tuple[int, int]]:
        """The symbolic dimensions this build serves and their ranges ({} for a build of fixed sizes)."""
        return {n: (lo, hi) for t in self.inputs for n, lo, hi in (t.ranges or {}).values()}

    def _graph(self, sizes: Mapping[str, int] | None = None):
        """optimized.onnx in the graph IR, at the compiled input shapes (a served dimension at ``sizes``)."""
        from graphopt.onnx_io import import_onnx, load_model

        path = self.graph_path()
        sizes = dict(sizes or {})
        for name, size in sizes.items():
            if name not in self.served:
                raise UserError(f"--dim {name}={size}: {self.directory} serves no symbolic dimension {name!r} "
                                f"({'it serves ' + ', '.join(self.served) if self.served else 'its sizes are fixed'})")
            lo, hi = self.served[name]
            if not lo <= size <= hi:
                raise UserError(f"--dim {name}={size}: outside the sizes {lo}..{hi} {self.directory} serves: rebuild "
                                f"with --dim {name}=LO:HI covering {size}")
        shapes = {t.name: tuple(sizes.get((t.ranges or {}).get(a, ("",))[0], d) for a, d in enumerate(t.shape))
                  for t in self.inputs if t.shape is not None and None not in t.shape}
        return load_model(path), import_onnx(load_model(path), shapes, require_static=True)

    def random_feeds(self, seed: int = 0, sizes: Mapping[str, int] | None = None) -> dict[str, np.ndarray]:
        """Seeded inputs of the compiled shapes (a served dimension at ``sizes``, else its representative size),
        integer inputs within the ranges the model indexes with (the same draw as optimize-model's checks,
        :func:`graphopt.feeds.random_inputs`); an input the build is specialized on takes its value."""
        from graphopt.feeds import random_inputs

        fixed = {t.name: np.asarray(t.value, dtype=t.dtype) for t in self.inputs if t.value is not None}
        return random_inputs(self._graph(sizes)[1], seed) | fixed  # a specialized input takes its one value

    def read_inputs(self, path: str | os.PathLike, seed: int = 0) -> dict[str, np.ndarray]:
        """``run-model --inputs FILE.npz``: checked against the signature by optimize-model's rules
        (:func:`graphopt.validate.read_inputs`: headers first, a warning naming the inputs the file leaves out);
        those inputs drawn as :meth:`random_feeds` draws them."""
        from graphopt.validate import InputSpec, read_inputs

        samples = read_inputs(path, {t.name: InputSpec(t.dtype, t.accepted_shape) for t in self.inputs},
                              fixed=[t.name for t in self.inputs if t.value is not None])
        if len(samples) == len(self.inputs):
            return samples
        return self.random_feeds(seed) | samples

    def check(self, feeds: Mapping[str, Any]):
        """This build's outputs against onnxruntime running optimized.onnx on ``feeds``:
        a :class:`graphopt.compare.Comparison`."""
        from graphopt.compare import compare_outputs
        from graphopt.feeds import run_ort

        path = self.graph_path()  # by path: onnxruntime reads a weights file beside it (models over 2 GB)
        got = self.run(feeds)
        ordered = {t.name: np.asarray(feeds[t.name]).astype(t.dtype) for t in self.inputs}
        return compare_outputs(run_ort(str(path), ordered), list(got.values()))

    # ---- files -----------------------------------------------------------------------------------------

    def save(self, directory: str | os.PathLike) -> Path:
        """Copy the built folder (library, optimized.onnx, reports, records) to ``directory``, each file
        atomically, report.json last; returns the folder."""
        out = check_output_dir(directory, "save")
        if out.resolve() == self.directory.resolve():
            return out
        files = sorted(p for p in self.directory.iterdir() if p.is_file() and not p.name.startswith(".")
                       and p.name != REPORT)
        for p in files + [self.directory / REPORT]:
            write_bytes_atomic(out / p.name, p.read_bytes())
        return out


# The Relax VM's argument check: "ErrorContext(fn=main, loc=param[1], param=s, annotation=...)  expect ..."
_VM_PARAM_RE = re.compile(r"ErrorContext\(fn=main, loc=param\[\d+\], param=([^,]+), annotation=.*?\)\s")


def synced(main, args: Sequence[Any], dev) -> Callable[[], object]:
    """One call of ``main(*args)`` that returns once the device has finished it: the one run-and-sync closure
    every timer times (a shipped folder's :meth:`Model.runner`, a build's :func:`pipeline.compile.model_runner`,
    the graph stage's runner); without the sync a GPU call would be timed as queued, not run."""
    def once() -> object:
        out = main(*args)
        dev.sync()
        return out

    return once


def _signature(directory: Path, dep: Mapping[str, Any]) -> tuple[list[TensorSpec], list[TensorSpec]]:
    """The inputs and outputs of report.json's deploy section, after its checksum (when it has one): an edited
    or damaged section is one line, not an error inside the VM."""
    path = directory / REPORT
    if "checksum" in dep and dep["checksum"] != section_checksum(dep):
        raise UserError(f"{path}'s deploy section was edited after the build (its checksum differs): copy the "
                        "folder again or rebuild")
    try:
        inputs = [TensorSpec.from_json(t) for t in dep["inputs"]]
        outputs = [TensorSpec.from_json(t) for t in dep["outputs"]]
        for t in inputs + outputs:
            np.dtype(t.dtype)
            if t.shape is not None and not all(d is None or isinstance(d, int) for d in t.shape):
                raise ValueError(f"shape {list(t.shape)} of {t.name!r}")
    except (KeyError, TypeError, ValueError) as exc:
        raise UserError(f"{path}'s deploy section is damaged ({type(exc).__name__}: {str(exc)[:120]}): copy the "
                        "folder again or rebuild") from None
    return inputs, outputs


def _cast(spec: TensorSpec, value: np.ndarray) -> np.ndarray:
    """``value`` in the input's dtype: a cast of the same kind that keeps every value (int64 4294967298 is not
    the int32 2 that a wrapping cast makes of it, nor is a finite float64 an infinite float32)."""
    want = np.dtype(spec.dtype)
    if value.dtype == want:
        return value
    if not np.can_cast(value.dtype, want, casting="same_kind"):
        raise UserError(f"input {spec.name!r} is {value.dtype}, the model takes {want}")
    with np.errstate(all="ignore"):
        cast = value.astype(want)
        kept = (np.array_equal(cast.astype(value.dtype), value) if want.kind in "iub"
                else not np.any(np.isinf(cast) & np.isfinite(value)))
    if not kept:
        raise UserError(f"input {spec.name!r} holds values that {want} cannot represent (the model takes {want}): "
                        f"give values in {want}'s range")
    return cast


def check_files(directory: Path, dep: Mapping[str, Any]) -> None:
    """The libraries are the ones the build wrote (the sizes first: a truncated copy costs no hashing)."""
    recorded = dep.get("files", {})  # absent in folders written before the hashes
    for name, want in recorded.items():
        path = directory / name
        if not path.is_file():
            raise UserError(f"{directory} has no {name}, which this build wrote: copy the folder again or rebuild")
        if path.stat().st_size != want["bytes"] or file_digest(path)["sha256"] != want["sha256"]:
            raise UserError(f"{path} is not the library this build wrote (size/hash differs): copy the folder "
                            "again or rebuild")


def _vm_message(exc: BaseException) -> str:
    """The message of an error raised inside the VM: its last line, after TVM's traceback lines."""
    lines = [ln.strip() for ln in str(exc).strip().splitlines() if ln.strip()]
    return (lines[-1] if lines else type(exc).__name__)[:300]


def outputs_numpy(result) -> list[np.ndarray]:
    """VM results are a tensor or a (nested) tuple of tensors; flatten in output order.  Here, not in
    :mod:`pipeline.compile`, so that loading a built model needs none of the compiler."""
    if hasattr(result, "numpy"):
        return [result.numpy()]
    if type(result).__name__ == "Shape":  # an output that is a shape (ONNX Shape's result): int64, as onnxruntime's
        return [np.array(list(result), dtype=np.int64)]
    out: list[np.ndarray] = []
    for r in result:
        out.extend(outputs_numpy(r))
    return out


def _size_pool(threads: int | None) -> int:
    """Size TVM's pool (before its first use in this process); returns the threads it runs with."""
    n = use_threads(threads, "threads")
    import tvm

    running = int(tvm.get_global_func("runtime.NumThreads")())
    if running != n:
        log.warning("warning: TVM's thread pool already runs %d threads in this process; %d threads apply in a new "
                    "process", running, n)
    return running
