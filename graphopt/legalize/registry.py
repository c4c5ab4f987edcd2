"""The table of lowerings: op type -> function rewriting one node (filled by the lowering modules).

Kept apart from the package's ``__init__`` so that the lowering modules can register themselves without
importing the package that imports them (no import cycle).
"""
from __future__ import annotations

from typing import Callable

from graphopt.ir import Node
from graphopt.legalize.builder import Builder

# A lowering gets the node and a Builder on the graph; it returns {original output name: tensor computing it}
# for the outputs it replaced (absent optional outputs need no entry), or None to leave the node as it is.
Lowering = Callable[[Node, Builder], "dict[str, str] | None"]

LOWERINGS: dict[str, Lowering] = {}


def register(*op_types: str) -> Callable[[Lowering], Lowering]:
    def deco(fn: Lowering) -> Lowering:
        for t in op_types:
            LOWERINGS[t] = fn
        return fn
    return deco
