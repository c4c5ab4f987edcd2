"""``--target`` parsed: the one place a target's text is read.

``--target`` takes what tvmc takes (https://tvm.apache.org/docs/arch/device_target_interactions.html):

* the short forms ``llvm``, ``cuda[:sm_XX]``, ``rocm[:gfxNNN]``;
* a TVM target string, ``llvm -mtriple=aarch64-linux-gnu -mcpu=cortex-a72`` (TVM 0.27 itself no longer
  parses strings, so :func:`check_name` does, without loading TVM, into the dict TVM takes);
* a TVM target JSON object, ``{"kind": "llvm", "mcpu": "cortex-a72", "mtriple": "aarch64-linux-gnu"}``.

:func:`check_name` (no TVM: a typo fails at once) -> :class:`~kerneltune.targets.registry.TargetRequest`;
:func:`build_spec` (from that request, not from the text again) -> a
:class:`~kerneltune.targets.registry.TargetSpec` (a TVM :class:`~tvm.target.Target` plus whether this
machine can run it and, for another CPU architecture, the cross toolchain that links ``model.so``), built by
the kind's registry entry.  :func:`parse_target` is both, for callers holding the text only.
"""
from __future__ import annotations

import json
import re
import shlex
from dataclasses import replace

from graphopt.errors import UserError

from .registry import DEFAULT_CUDA_ARCH, DEFAULT_ROCM_ARCH, KINDS, REGISTRY, TargetRequest, TargetSpec


# What an architecture after ``cuda:`` / ``rocm:`` looks like (TVM fails deep in code generation otherwise):
# NVIDIA compute capabilities sm_50 ... sm_120a, AMD GPU names gfx803 ... gfx1201.
ARCH_PATTERNS = {"cuda": r"sm_\d{2,3}[a-z]?", "rocm": r"gfx[0-9a-f]{3,4}"}


# Which attribute carries the architecture of a short form (cuda:sm_90 -> arch, rocm:gfx90a -> mcpu).
_ARCH_ATTR = {"cuda": "arch", "rocm": "mcpu"}


# Attributes TVM takes as lists: in a target string they are comma-separated (-mattr=+neon,+fp16).
_LIST_ATTRS = ("mattr", "keys", "libs", "cl-opt")


EXAMPLES = ("llvm -mtriple=aarch64-linux-gnu -mcpu=cortex-a72", '{"kind": "cuda", "arch": "sm_90"}')


def _value(key: str, text: str) -> object:
    """A target-string value as TVM's dict form wants it: lists for list attributes, ints, booleans."""
    if key in _LIST_ATTRS:
        return [v for v in text.split(",") if v]
    if re.fullmatch(r"-?\d+", text):
        return int(text)
    if text.lower() in ("true", "false"):
        return text.lower() == "true"
    return text


def _parse_string(text: str) -> tuple[str, dict]:
    """``llvm -mtriple=aarch64-linux-gnu -mcpu=cortex-a72`` -> (``llvm``, its attributes)."""
    try:
        words = shlex.split(text)
    except ValueError as exc:
        raise UserError(f"--target {text!r}: {exc}; quote the whole target once") from None
    kind, attrs = words[0].lower(), {}
    for word in words[1:]:
        m = re.fullmatch(r"--?([A-Za-z][\w.-]*)=(.*)", word)
        if not m:
            raise UserError(f"--target {text!r}: {word!r} is not an option; write -key=value, e.g. "
                            f"'{EXAMPLES[0]}'")
        attrs[m.group(1)] = _value(m.group(1), m.group(2))
    return kind, attrs


def _parse_json(text: str) -> tuple[str, dict]:
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as exc:
        raise UserError(f"--target is not valid JSON ({exc.msg} at character {exc.pos}); e.g. "
                        f"--target '{EXAMPLES[1]}'") from None
    if not isinstance(obj, dict) or not isinstance(obj.get("kind"), str):
        raise UserError(f"--target JSON needs a \"kind\" string, e.g. {EXAMPLES[1]}")
    obj = dict(obj)
    return obj.pop("kind").lower(), obj


def check_name(name: str) -> TargetRequest:
    """Parse and check ``--target`` without loading TVM (so a typo fails fast): a short form
    (``llvm``, ``cuda:sm_90``), a TVM target string or a TVM target JSON object."""
    text = str(name).strip()
    if text.startswith("{"):
        kind, attrs = _parse_json(text)
    elif " " in text or "\t" in text:
        kind, attrs = _parse_string(text)
    else:
        kind, _, arch = text.lower().partition(":")
        attrs = {}
        if arch:
            if kind == "llvm":
                raise UserError(f"--target {name!r}: llvm takes no ':architecture'; for another CPU write "
                                f"'llvm -mcpu=NAME' (and -mtriple=... for another architecture)")
            if kind in _ARCH_ATTR:
                attrs[_ARCH_ATTR[kind]] = arch
    if kind not in REGISTRY:
        raise UserError(f"unknown target {name!r}: use one of {', '.join(KINDS)} (e.g. --target llvm, or "
                        f"'{EXAMPLES[0]}')")
    pattern, key = ARCH_PATTERNS.get(kind), _ARCH_ATTR.get(kind)
    arch = attrs.get(key) if key else None
    if arch is not None and pattern and not re.fullmatch(pattern, str(arch)):
        example = REGISTRY[kind].arch_example
        raise UserError(f"--target {name!r}: {arch!r} is not a {kind} architecture; write {kind}:{example}, e.g. "
                        f"{kind}:{DEFAULT_CUDA_ARCH if kind == 'cuda' else DEFAULT_ROCM_ARCH}")
    if "host" in attrs:
        raise UserError(f"--target {name!r}: give no \"host\"; the host code is built for the llvm target of this "
                        "machine (or of the mtriple)")
    return TargetRequest(kind, tuple(attrs.items()), text)


# For every --target help text: the short forms, then the TVM forms.
TARGET_HELP = (" | ".join(k.name + (f"[:{k.arch_example}]" if k.arch_example else "") for k in REGISTRY.values())
               + f", or a TVM target string or JSON, e.g. '{EXAMPLES[0]}'")


def build_spec(request: TargetRequest, threads: int | None = None) -> TargetSpec:
    """The :class:`TargetSpec` of a target already read (:func:`check_name`), built by its kind's registry entry
    (this loads TVM); it keeps the request it was built from.  Anything TVM or this machine's toolchain cannot
    build is a :class:`UserError`."""
    return replace(REGISTRY[request.kind].build(dict(request.attrs), threads), request=request)


def parse_target(name: str, threads: int | None = None) -> TargetSpec:
    """Parse a short form, TVM target string or JSON (:func:`check_name`) into a :class:`TargetSpec`
    (:func:`build_spec`), for callers that hold the text only (tests, bench scripts)."""
    return build_spec(check_name(name), threads)
