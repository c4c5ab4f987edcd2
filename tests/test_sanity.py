"""The untuned build's sanity floor (pipeline.pricing.sanity): rates against the roofline, and a pathological default
caught, replaced and still computing the model."""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
from onnx import TensorProto, helper, numpy_helper

from kerneltune import templates
from pipeline import stages
from pipeline.pricing import sanity
from pipeline.compile import check_outputs
from pipeline.context import BuildContext, TuneOptions
from pipeline.pricing.profile import KernelTime


def _task(index, name, flops, weight, shapes):
    return SimpleNamespace(index=index, name=name, names=[name], task=object(), flops=flops, weight=weight,
                           shapes=shapes, dtype="float32")


def test_rates_compare_each_kernel_with_its_roofline():
    """A matrix-vector product is held to the bandwidth (2 FLOP per 4-byte weight), a matmul to the peak;
    a pre-packed kernel's time counts for its task; a task without a template is not judged, nor one that
    costs the model under MIN_SHARE of its kernel time (a call's overhead dwarfs a 5 KFLOP classifier)."""
    matvec = _task(0, "fused_matmul_a", 2 * 1024 * 1024, 1, [(1, 1024), (1024, 1024), (1, 1024)])
    matmul = _task(1, "matmul_b", 2 * 128 * 768 * 768, 12, [(128, 768), (768, 768), (128, 768)])
    other = SimpleNamespace(index=2, name="softmax", names=["softmax"], task=None, flops=1e6, weight=1,
                            shapes=[(4, 4), (4, 4)], dtype="float32")
    tiny = _task(3, "fused_matmul1", 2 * 256 * 10, 1, [(1, 256), (256, 10), (1, 10)])
    part = SimpleNamespace(tasks=[matvec, matmul, other, tiny])
    profile = [KernelTime("fused_matmul_a_prepacked", 1, 0.5), KernelTime("matmul_b", 12, 800.0),
               KernelTime("softmax", 1, 9.0), KernelTime("fused_matmul1", 1, 0.025)]
    rates = {r.name: r for r in sanity.kernel_rates(part, profile, peak_gflops=200.0, bandwidth_gbs=10.0)}
    assert set(rates) == {"fused_matmul_a", "matmul_b", "fused_matmul1"}
    assert rates["fused_matmul1"].gflops < sanity.FLOOR * rates["fused_matmul1"].roofline_gflops
    assert not rates["fused_matmul1"].flagged
    mv, mm = rates["fused_matmul_a"], rates["matmul_b"]
    assert abs(mv.gflops - 2 * 1024 * 1024 / 0.5e6) < 1e-9      # 4.2 GFLOP/s
    assert mv.roofline_gflops < 6 and not mv.flagged               # ~5 GFLOP/s at 10 GB/s: bandwidth-bound
    assert mm.roofline_gflops == 200.0 and mm.gflops < 3 and mm.flagged  # 2.3 GFLOP/s of a 200 peak

    # alone in a model (all of its kernel time), a 4 us matmul is a call's fixed cost, not a schedule to fix
    tiny_alone = _task(0, "matmul_c", 2 * 2 * 8 * 16, 1, [(2, 8), (8, 16), (2, 16)])
    (rate,) = sanity.kernel_rates(SimpleNamespace(tasks=[tiny_alone]), [KernelTime("matmul_c", 1, 0.004)],
                                  peak_gflops=200.0, bandwidth_gbs=10.0)
    assert rate.gflops < sanity.FLOOR * rate.roofline_gflops and not rate.flagged


def _matmul_model(m=64, k=256, n=256):
    w = np.random.default_rng(0).standard_normal((k, n)).astype(np.float32)
    g = helper.make_graph([helper.make_node("MatMul", ["A", "W"], ["Y"])], "g",
                          [helper.make_tensor_value_info("A", TensorProto.FLOAT, [m, k])],
                          [helper.make_tensor_value_info("Y", TensorProto.FLOAT, [m, n])],
                          [numpy_helper.from_array(w, "W")])
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 9
    return model


def test_pathological_default_is_flagged_replaced_and_still_correct(monkeypatch):
    """A matmul default forced scalar (1-wide register tile, k innermost alone, no unroll) runs far under the
    floor: it is flagged, a config of the template's space at least MARGIN faster replaces it, and the rebuilt
    model matches onnxruntime.  With the real default nothing is flagged."""
    model = _matmul_model()
    ctx = BuildContext.create("llvm", threads=2, skip_graph=True, tuning=TuneOptions(skip=True, progress=False))
    monkeypatch.setattr(sanity, "cpu_facts", lambda target: (200.0, 10.0))
    lowered = stages.lower(model, ctx.spec, ctx.layout)
    (task,) = [t for t in lowered.part.tasks if t.task is not None]

    compiled, floor = stages.build_untuned(lowered, ctx)
    assert floor["checked"] and floor["kernels"] == 1 and floor["flagged"] == [] and floor["replaced"] == 0
    assert compiled.schedules[task.name] == "template"

    real = templates.default_config
    space = templates.space_for(task.task, ctx.spec.target)

    def scalar(t, target):
        if t.kind != "matmul":
            return real(t, target)
        d = space.as_dict(real(t, target))
        d.update(tile_m=(1, 64, 1, 1), tile_i=(1, 64, 1, 1), tile_j=(1, 256, 1, 1), tile_k=(256, 1), unroll=0,
                 pack="none", s1_order="axis")
        return space.from_dict({k: v for k, v in d.items() if k in space.names})

    monkeypatch.setattr(templates, "default_config", scalar)
    monkeypatch.setattr(sanity, "CANDIDATES", 4)  # a scalar default loses to almost any config; each is a build
    compiled, floor = stages.build_untuned(lowered, ctx)
    assert floor["replaced"] == 1 and len(floor["flagged"]) == 1
    flagged = floor["flagged"][0]
    assert flagged["name"] == task.name and flagged["replaced"]
    assert flagged["gflops"] < sanity.FLOOR * flagged["roofline_gflops"]
    assert flagged["replacement_ms"] * sanity.MARGIN <= flagged["default_ms"]
    assert compiled.schedules[task.name] == "sanity"  # a replacement, not passed off as a tuned config
    check = check_outputs(compiled, lowered.imported.graph, model, ctx.seed)
    assert check.ok, check.reason()


def test_ctrl_c_during_the_profile_run_is_an_interrupt_not_an_internal_error(monkeypatch):
    """The in-place profile times kernels with a Python callback inside the VM; a KeyboardInterrupt raised
    there came out of the VM as a bare RuntimeError, which optimize-model reported as an internal error.
    Signals now wait for the run's end and arrive as KeyboardInterrupt (exit 130, temporaries removed)."""
    import os
    import signal

    import pytest

    from pipeline.pricing import profile

    ctx = BuildContext.create("llvm", threads=1, skip_graph=True, tuning=TuneOptions(skip=True, progress=False))
    lowered = stages.lower(_matmul_model(), ctx.spec, ctx.layout)
    compiled = stages.build(lowered, ctx.spec)
    make_vm, fired, finished = compiled.vm, [], []

    class InterruptedVM:
        """The model's VM; its instrument callback gets Ctrl-C on the first kernel, inside the VM's run."""

        def __init__(self):
            self.vm = make_vm()

        def __getitem__(self, name):
            return self.vm[name]

        def set_instrument(self, callback):
            def wrapped(*args):
                if not fired:
                    fired.append(os.kill(os.getpid(), signal.SIGINT))
                finished.append(args[2])  # before_run flags: the run goes on to its end
                return callback(*args)

            self.vm.set_instrument(wrapped)

    monkeypatch.setattr(compiled, "vm", InterruptedVM)
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)  # as in a console script
    try:
        with pytest.raises(KeyboardInterrupt):
            profile.profile_kernels(compiled, lowered.imported, runs=1)
    finally:
        signal.signal(signal.SIGINT, previous)
    assert fired and finished[-1] is False  # interrupted inside the run, raised after its last kernel
