"""Targets: everything that knows what ``llvm``, ``cuda`` or ``rocm`` means; the templates, the measurer, the
compiler and every CLI ask these modules instead of spelling kinds themselves.  By job:

* :mod:`.parse`: ``--target`` read (the one place a target's text is parsed): :func:`.parse.check_name`
  (no TVM) -> :class:`.registry.TargetRequest`, :func:`.parse.build_spec` -> :class:`.registry.TargetSpec`;
* :mod:`.registry`: the target kinds (:data:`.registry.REGISTRY`), the :class:`.registry.TargetRequest` read
  from ``--target`` and the :class:`.registry.TargetSpec` each kind builds from it, and what a spec answers (tuning it here, its device, its GFLOP/s ceiling);
* :mod:`.host`: this machine's CPU and a target's vector facts;
* :mod:`.toolchains`: the cross gcc per CPU architecture, ld.lld and the ROCm device bitcode;
* :mod:`.threads`: the thread count and TVM's thread pool.

TVM is imported inside the functions that need it: importing it takes seconds, and the CLIs validate
--target (:func:`.parse.check_name`) before anything loads TVM, so a typo fails at once.  This ``__init__``
imports nothing.
"""
