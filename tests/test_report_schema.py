"""report.json against its published JSON Schema (pipeline/report_schema.json), the facts it opens with
(schema version, creation time, versions, CPU), and what a user sees of a build made without ``-o``: the folder
named after the model, and one last line with the latency, the ratio's direction and report.md's path (issue 43).

One real build of a tiny MLP (graph stage skipped, no tuning, 1 thread: seconds).  The schema is checked with
the jsonschema package where it is installed; the project does not depend on it, so otherwise with the small
validator below, which knows exactly the keywords the schema uses and fails on any other, so that it never
passes a schema it cannot read."""
from __future__ import annotations

import contextlib
import copy
import importlib.metadata
import io
import json
import platform
import re
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest

from graphopt import console
from kerneltune.targets.caches import host_caches
from kerneltune.targets.host import host_model_name
from pipeline.report import SCHEMA_VERSION, latency_phrase, result_line
from test_outputs import mlp

SCHEMA_PATH = Path(__file__).resolve().parents[1] / "pipeline" / "report_schema.json"
SCHEMA = json.loads(SCHEMA_PATH.read_text())
MODEL = "tiny_mlp.onnx"
DEFAULT_DIR = "tiny_mlp.optimized"  # MODEL's stem + pipeline.optimize_model.OUTPUT_SUFFIX


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> tuple[Path, dict[str, Any], str, datetime]:
    """optimize-model MODEL run in a fresh folder without -o: (that folder, report.json, stdout, start time)."""
    from pipeline.cli import optimize_model_main

    d = tmp_path_factory.mktemp("cwd")
    onnx.save(mlp(), str(d / MODEL))
    out = io.StringIO()
    start = datetime.now(timezone.utc).replace(microsecond=0)
    with pytest.MonkeyPatch.context() as mp, contextlib.redirect_stdout(out):
        mp.chdir(d)
        assert optimize_model_main([MODEL, "--skip-graph", "--threads", "1", "--no-progress"]) == 0
    return d, json.loads((d / DEFAULT_DIR / "report.json").read_text()), out.getvalue(), start


# ------------------------------------------------------------------------------------------------ the schema

_ANNOTATIONS = {"$schema", "$id", "$comment", "title", "description", "format", "$defs"}
_KEYWORDS = {"type", "properties", "required", "additionalProperties", "items", "enum", "const", "minimum",
             "pattern", "$ref"}
_TYPES = {"object": dict, "array": list, "string": str, "boolean": bool, "null": type(None)}


def _is(value: Any, kind: str) -> bool:
    if kind in ("integer", "number"):
        numeric = isinstance(value, (int, float)) and not isinstance(value, bool)
        return numeric and (kind == "number" or float(value).is_integer())
    return isinstance(value, _TYPES[kind])


def _errors(value: Any, schema: dict[str, Any], path: str = "$") -> list[str]:
    """What ``value`` breaks of ``schema`` (draft 2020-12, the keywords in _KEYWORDS only; "$ref" to #/$defs)."""
    unknown = set(schema) - _KEYWORDS - _ANNOTATIONS
    assert not unknown, f"the test's validator does not know {sorted(unknown)}: use jsonschema or teach it"
    found: list[str] = []
    if "$ref" in schema:
        found += _errors(value, SCHEMA["$defs"][schema["$ref"].removeprefix("#/$defs/")], path)
    kinds = schema.get("type", [])
    kinds = [kinds] if isinstance(kinds, str) else kinds
    if kinds and not any(_is(value, k) for k in kinds):
        return found + [f"{path}: {type(value).__name__} is not {'/'.join(kinds)}"]
    if "const" in schema and value != schema["const"]:
        found.append(f"{path}: {value!r} is not {schema['const']!r}")
    if "enum" in schema and value not in schema["enum"]:
        found.append(f"{path}: {value!r} is not one of {schema['enum']}")
    if "minimum" in schema and _is(value, "number") and value < schema["minimum"]:
        found.append(f"{path}: {value} < {schema['minimum']}")
    if "pattern" in schema and isinstance(value, str) and not re.search(schema["pattern"], value):
        found.append(f"{path}: {value!r} does not match {schema['pattern']}")
    if isinstance(value, dict):
        found += [f"{path}: no {k!r}" for k in schema.get("required", []) if k not in value]
        extra = schema.get("additionalProperties", True)
        for k, v in value.items():
            sub = schema.get("properties", {}).get(k, extra)
            if sub is False:
                found.append(f"{path}: {k!r} is not allowed")
            elif isinstance(sub, dict):
                found += _errors(v, sub, f"{path}.{k}")
    if isinstance(value, list) and "items" in schema:
        for i, v in enumerate(value):
            found += _errors(v, schema["items"], f"{path}[{i}]")
    return found


def schema_errors(report: dict[str, Any]) -> list[str]:
    """report.json's violations of the published schema: jsonschema's where installed, else _errors."""
    try:
        import jsonschema
    except ImportError:
        return _errors(report, SCHEMA)
    jsonschema.Draft202012Validator.check_schema(SCHEMA)
    return ["$" + "".join(f"[{k}]" if isinstance(k, int) else f".{k}" for k in e.absolute_path) + f": {e.message}"
            for e in jsonschema.Draft202012Validator(SCHEMA).iter_errors(report)]


def test_a_real_report_json_validates_against_the_published_schema(built):
    _, report, _, _ = built
    assert SCHEMA["$schema"] == "https://json-schema.org/draft/2020-12/schema"
    assert schema_errors(report) == []
    assert _errors(report, SCHEMA) == []  # the fallback validator agrees where jsonschema is installed
    # The schema describes every top-level field the build writes, and requires those always written.
    assert set(report) <= set(SCHEMA["properties"]), set(report) - set(SCHEMA["properties"])
    assert set(SCHEMA["required"]) <= set(report)


def test_the_schema_check_catches_a_wrong_report(built):
    """The check can fail: each of these is reported (a test of whichever validator ran above)."""
    _, report, _, _ = built
    bad = copy.deepcopy(report)
    del bad["versions"]
    bad["schema_version"] = 1
    bad["created"] = "yesterday"
    bad["cpu"]["caches"]["L2"] = "2 MB"
    bad["tasks"][0]["weight"] = -1
    bad["stages"]["compile"]["ok"] = "yes"
    bad["latency"]["measured"] = None
    wrong = {"$", "$.schema_version", "$.created", "$.cpu.caches.L2", "$.tasks[0].weight", "$.stages.compile.ok",
             "$.latency.measured"}
    for check in (schema_errors, lambda r: _errors(r, SCHEMA)):
        found = check(bad)
        assert sorted(e.split(": ", 1)[0] for e in found) == sorted(wrong), found
        assert any("versions" in e for e in found)


# ------------------------------------------------------------------------------------------------ build facts

def test_report_json_opens_with_schema_version_time_versions_and_cpu(built):
    _, report, _, start = built
    assert list(report)[:4] == ["schema_version", "created", "versions", "cpu"]
    assert report["schema_version"] == SCHEMA_VERSION == 2
    created = datetime.strptime(report["created"], "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=timezone.utc)
    assert start <= created <= datetime.now(timezone.utc) + timedelta(seconds=1)
    assert report["versions"] == {"optimize_model": console.version(),
                                  "tvm": importlib.metadata.version("apache-tvm"),
                                  "onnxruntime": importlib.metadata.version("onnxruntime"),
                                  "onnx": onnx.__version__, "numpy": np.__version__,
                                  "python": platform.python_version()}
    assert report["cpu"] == {"model": host_model_name(), "caches": host_caches()}
    if Path("/sys/devices/system/cpu/cpu0/cache").is_dir():  # Linux: the OS lists them
        assert report["cpu"]["caches"]["L1d"] > 0 and report["cpu"]["caches"]["L2"] > report["cpu"]["caches"]["L1d"]


def test_without_o_the_build_goes_to_a_folder_named_after_the_model(built):
    d, report, _, _ = built
    assert sorted(p.name for p in (d / DEFAULT_DIR).iterdir()) == ["model.so", "optimized.onnx", "report.json",
                                                                    "report.md"]
    assert report["model"] == MODEL


def test_the_help_names_the_default_output_folder(capsys):
    from pipeline.cli import optimize_model_main

    with pytest.raises(SystemExit):
        optimize_model_main(["--help"])
    assert ".optimized in the current folder" in " ".join(capsys.readouterr().out.split())


def test_the_last_line_gives_the_latency_its_direction_and_report_md(built):
    d, report, stdout, _ = built
    lines = stdout.strip().splitlines()
    assert len(lines) == 1  # one line on stdout
    lat = report["latency"]
    ratio = lat["compiled_ms"] / lat["onnxruntime_ms"]
    assert lines[0].startswith(f"wrote {DEFAULT_DIR}/optimized.onnx, model.so, report.json (2 kernels; compiled "
                               "model vs onnxruntime: max abs err ")
    assert (f"; {lat['compiled_ms']:.4g} ms per inference, onnxruntime {lat['onnxruntime_ms']:.4g} ms: {ratio:.2f}x "
            "onnxruntime's time (lower is faster); ") in lines[0]
    assert lines[0].endswith(f"; summary: {DEFAULT_DIR}/report.md") and (d / DEFAULT_DIR / "report.md").is_file()


def test_the_last_line_says_why_a_latency_is_missing():
    report = {"tasks": [{}] * 3, "latency": {"measured": False, "reason": "cannot run aarch64 here"}}
    line = result_line(report, "out", "graph only")
    assert line == ("wrote out/optimized.onnx, model.so, report.json (3 kernels; graph only); latency not measured "
                    "(cannot run aarch64 here); summary: out/report.md")
    assert latency_phrase({"measured": True, "compiled_ms": 2.0, "onnxruntime_ms": 4.0}) == \
        "2 ms per inference, onnxruntime 4 ms: 0.50x onnxruntime's time (lower is faster)"
