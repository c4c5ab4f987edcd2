"""Cost models for the substitution search: how many seconds one operator, or a whole graph, takes.

One interface (:class:`~graphopt.cost.base.CostModel`), implementations beside it, each in its own module:

* :mod:`.analysis` - what does not run at all: weight-only nodes (folded before export) and element-wise
  epilogues fused into their producer's kernel, in a graph and in a rule's target pattern before it is built
  (the search prices candidate rewrites with it, :meth:`CostModel.pattern_cost`; the rewriter knows no cost);
* :mod:`.analytic` - roofline estimate against this machine's measured peak and bandwidth;
* :mod:`.measured` - each distinct operator timed once on this machine by an injected
  :class:`~graphopt.cost.runners.GraphRunner` (onnxruntime here, TVM from the pipeline), cached on disk
  (:mod:`.cache`);
* :mod:`.kernel_count` - counts kernels (the merge-everything alternative of the graph stage);
* :mod:`.factory` - ``--cost measured|analytic`` to a model.
"""
