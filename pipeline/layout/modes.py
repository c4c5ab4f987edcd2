"""The ``--layout`` choices (what they do: :mod:`pipeline.layout.search`); here so the CLIs' ``--help`` and
argument checks load no TVM."""

LAYOUTS = ("auto", "nchwc", "nchw")
LAYOUT_HELP = ("conv layouts on llvm: auto (NCHW[x]c blocks chosen for the whole graph by measured cost, "
               "default), nchwc (every conv blocked, heuristic blocks, no measurement), nchw (as imported)")
