"""``graphopt cache``: the measurement caches follow ``$XDG_CACHE_HOME``, are listed, and cleared (issue 43)."""
from __future__ import annotations

from pipeline.cli import graphopt_main


def test_caches_follow_xdg_and_are_listed_and_cleared(tmp_path, monkeypatch, capsys):
    monkeypatch.delenv("OPTIMIZE_MODEL_CACHE", raising=False)
    monkeypatch.delenv("GRAPHOPT_CACHE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    from graphopt.cost.cache import cache_dir
    from graphopt.library import rules_cache_dir

    assert cache_dir() == tmp_path / "xdg" / "optimize-model"
    assert rules_cache_dir() == tmp_path / "xdg" / "graphopt"
    cache_dir().mkdir(parents=True)
    (cache_dir() / "layout-cpu-t2.json").write_text("{}")
    (cache_dir() / "notes.txt").write_text("the user's own file")  # not a cache file: listed nowhere, kept
    assert graphopt_main(["cache"]) == 0
    listed = capsys.readouterr().out
    assert f"measurements: {cache_dir()} (1 files" in listed and "layout-cpu-t2.json" in listed
    assert f"rules: {rules_cache_dir()} (0 files" in listed
    assert graphopt_main(["cache", "--clear"]) == 0
    assert capsys.readouterr().out.strip() == "removed 1 cache files"
    assert not (cache_dir() / "layout-cpu-t2.json").exists() and (cache_dir() / "notes.txt").exists()
    monkeypatch.setenv("OPTIMIZE_MODEL_CACHE", str(tmp_path / "own"))  # the tool's own variable comes first
    assert cache_dir() == tmp_path / "own"
