"""The check every layout test ends with: the converted module, partitioned and compiled, against onnxruntime
on the model it came from."""
from __future__ import annotations

import tvm

from graphopt.compare import compare_outputs
from graphopt.feeds import random_inputs, run_ort
from kerneltune.targets.registry import TargetSpec, device_for
from pipeline.compile import compile_partition, outputs_numpy, to_device
from pipeline.partition import Partition, partition
from pipeline.relax_import import ImportedModel


def compiled_matches_onnxruntime(imported: ImportedModel, mod: tvm.IRModule, spec: TargetSpec) -> Partition:
    """Build ``mod`` (a layout pass's output for ``imported``), run it on seeded random inputs, assert the outputs
    equal onnxruntime's on the original model; returns the partition for the caller's layout assertions."""
    part = partition(mod)
    compiled = compile_partition(imported, part, spec)
    feeds = random_inputs(imported.graph, 0)
    got = outputs_numpy(compiled.vm()["main"](*to_device(feeds, compiled.input_names, device_for(spec))))
    want = run_ort(imported.onnx_model, feeds, 2)
    check = compare_outputs(want, got)  # the product's one comparison (scale-aware, NaN/Inf by position)
    assert check.ok, check.reason()
    return part
