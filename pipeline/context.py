"""What one build is asked for and runs with, made once and passed down whole: the build context.

The command lines (:mod:`pipeline.cli`), the Python API (:mod:`pipeline.api`) and the benchmarks make one
:class:`BuildContext` from their options: the ``--target`` read once (:func:`kerneltune.targets.parse.check_name`,
no TVM; its :class:`~kerneltune.targets.registry.TargetSpec` built from that reading on first use, once), the
threads, the seed, the conv layouts, the graph stage's options and the tuning options (:class:`TuneOptions`,
checked by its one :meth:`~TuneOptions.validate`).  Once the model and the output folder are checked, the
run completes it (:meth:`BuildContext.with_model`, :meth:`BuildContext.with_records`): the sample inputs and
the records file, opened once, that tuning and the end-to-end verdict share.  The stages
(:mod:`pipeline.stages`) take the context whole.

No TVM here: the CLIs build the context before anything loads TVM.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Any

from graphopt.dims import Dims, dims_of
from graphopt.errors import UserError
from graphopt.onnx_io import InputShapes
from graphopt.stage import TIME_LIMIT
from kerneltune.records import RecordLog
from kerneltune.scheduler import SCHEDULERS
from kerneltune.searchers import check_searcher
from kerneltune.stopping import StopRule
from kerneltune.targets.parse import build_spec, check_name
from kerneltune.targets.registry import TargetRequest

if TYPE_CHECKING:
    from kerneltune.targets.registry import TargetSpec

PRECISIONS = ("fp32", "int8")  # --precision: int8 quantizes the model first (pipeline.quantize)


@dataclass(frozen=True)
class TuneOptions:
    """The tuning stage's options (``--trials 0`` or ``--skip-tune``: no tuning); ``timeout`` (seconds on the whole
    tuning run) and ``early_stop`` (trials without a gain after which a task stops) end it before the budget
    is spent (:mod:`kerneltune.stopping`)."""

    trials: int = 0
    kernels: str | None = None
    scheduler: str = "gradient"
    searcher: str = "opevo"
    records: str | None = None  # default DIR/records.jsonl
    rpc: str | None = None
    skip: bool = False
    progress: bool = True
    timeout: float | None = None
    early_stop: int | None = None

    @property
    def enabled(self) -> bool:
        return self.trials > 0 and not self.skip

    @property
    def stop_rule(self) -> StopRule:
        """``timeout`` and ``early_stop`` as kerneltune's :class:`~kerneltune.stopping.StopRule`."""
        return StopRule(self.timeout, self.early_stop)

    def invalid(self) -> str | None:
        """The first option no run can take (``trials``, ``scheduler``, ``searcher``, ``timeout`` or
        ``early_stop``), or None: the one check of these values; :meth:`validate` words it for the command line,
        the Python API names its argument."""
        if self.trials < 0:
            return "trials"
        stop = {"timeout_s": "timeout", "early_stop": "early_stop"}.get(self.stop_rule.invalid() or "")
        if stop:
            return stop
        if self.scheduler not in SCHEDULERS:
            return "scheduler"
        try:
            check_searcher(self.searcher)
        except UserError:
            return "searcher"
        return None

    def validate(self) -> TuneOptions:
        """These options, or a one-line UserError naming the first wrong one as the command line spells it."""
        bad = self.invalid()
        if bad == "trials":
            raise UserError(f"--trials {self.trials}: give 0 (no tuning) or a positive budget")
        if bad == "scheduler":  # argparse's choices refuse it first on the command lines
            raise UserError(f"--scheduler {self.scheduler!r}: use one of {', '.join(SCHEDULERS)}")
        if bad == "searcher":
            check_searcher(self.searcher)
        self.stop_rule.validate()
        why = "--skip-tune is given" if self.skip else "--trials is 0"
        if self.kernels and not self.enabled:  # a selection with nothing to spend on it: said, not ignored
            raise UserError(f"--kernels {self.kernels} picks the kernels to tune, but {why}: add --trials N "
                            "(e.g. --trials 200), or drop --kernels")
        for option, value in (("--timeout", self.timeout), ("--early-stop", self.early_stop)):
            if value is not None and not self.enabled:
                raise UserError(f"{option} {value:g} ends kernel tuning early, but {why}: add --trials N "
                                f"(e.g. --trials 200), or drop {option}")
        return self


@dataclass(frozen=True)
class BuildContext:
    """One build's options and environment (see the module docstring).  Frozen: a stage reads it, and what
    the run learns later (the samples, the records file) makes a new context (:meth:`with_model`,
    :meth:`with_records`) before the first stage runs."""

    target: TargetRequest  # --target, read once
    threads: int | None = None  # --threads as checked; None: the cores this process may use
    seed: int = 0
    tuning: TuneOptions = field(default_factory=TuneOptions)
    layout: str = "auto"  # --layout (pipeline.layout.modes)
    skip_graph: bool = False
    graph_time_limit: float = TIME_LIMIT  # --time-limit of the graph stage, seconds
    input_shapes: InputShapes | None = None  # --input-shape; a graphopt.dims.ShapeRequest carries --dim with it
    inputs: str | None = None  # --inputs FILE.npz
    precision: str = "fp32"  # --precision (PRECISIONS)
    calibration: str | None = None  # --calibration FILE.npz: stacked sample sets for --precision int8
    samples: dict[str, Any] | None = None  # its arrays, as checked (graphopt.validate.check_model): every check
    records: RecordLog | None = None  # the tuning records, opened once for the run

    @classmethod
    def create(cls, target: str | TargetRequest = "llvm", **options: Any) -> BuildContext:
        """A context from a ``--target`` text (read here, without TVM) and the other fields' values; the tuning
        options are validated."""
        request = target if isinstance(target, TargetRequest) else check_name(target)
        ctx = cls(request, **options)
        ctx.tuning.validate()
        if ctx.precision not in PRECISIONS:  # argparse's choices refuse it first on the command line
            raise UserError(f"--precision {ctx.precision!r}: use one of {', '.join(PRECISIONS)}")
        if ctx.calibration is not None and ctx.precision != "int8":
            raise UserError(f"--calibration {ctx.calibration!r} is the int8 calibration set: add --precision int8, "
                            "or drop --calibration")
        return ctx

    @cached_property
    def spec(self) -> TargetSpec:
        """The target as TVM builds it (loads TVM): made from :attr:`target` on first use, once per context."""
        return build_spec(self.target, self.threads)

    @property
    def dims(self) -> Dims:
        """The ``--dim`` sizes asked for ({} when none): report.json records them."""
        return dims_of(self.input_shapes)

    @property
    def stage_threads(self) -> int:
        """The threads the graph stage times candidate graphs with (1 when unset)."""
        return int(self.threads or 1)

    def with_model(self, samples: dict[str, Any] | None) -> BuildContext:
        """This context with the checked model's sample inputs."""
        return self._replace(samples=samples)

    def with_records(self, path: str | Path) -> BuildContext:
        """This context with the records file ``path`` (opened for the run: one :class:`RecordLog`)."""
        return self._replace(records=RecordLog(path))

    def without_graph_stage(self) -> BuildContext:
        """This context with ``--skip-graph``: bench-model's default engine, the model as imported."""
        return self._replace(skip_graph=True)

    def _replace(self, **changes: Any) -> BuildContext:
        new = replace(self, **changes)
        if "spec" in self.__dict__:  # built already: the new context keeps it (the target is built once)
            new.__dict__["spec"] = self.__dict__["spec"]
        return new
