"""The layout stage (llvm only): which convolutions run in NCHW[x]c with which blocks, for the whole graph.

* :mod:`.modes`: the ``--layout`` choices (no TVM: the CLIs' ``--help`` and argument checks import it);
* :mod:`.nchwc`: the pass itself: analysis into layout classes, the heuristic blocks, realization with
  Relax ``ConvertLayout`` and the lowering of blocked convs;
* :mod:`.cost`: measured prices of a conv in one layout and of one layout transform, cached per CPU;
* :mod:`.pbqp`: the solver;
* :mod:`.search`: the stage: ``auto`` (cost-based search), ``nchwc`` (heuristic), ``nchw`` (as imported),
  then the partition (:func:`.search.partition_model`).

This package's ``__init__`` imports nothing, so ``pipeline.layout.modes`` loads no TVM.
"""
