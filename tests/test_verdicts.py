"""The one verdict store (graphopt.verdicts): the blocks of a keep-or-reject timing are kept, not the verdict,
and a rerun judges them by today's margin; a decision the deadline cut short is not kept."""
from __future__ import annotations

import json

from graphopt.timing import Comparison, Decision
from graphopt.verdicts import Evidence, VerdictStore, verdict_key


def _decision(ratios: tuple[float, ...], cut_short: bool = False) -> Decision:
    return Decision(Comparison(2.0, 1.9, ratios, 0.02), faster=True, reason="", cut_short=cut_short)


def test_recorded_blocks_are_judged_again_by_the_margin_asked_now(tmp_path):
    path = tmp_path / "v.json"
    key = verdict_key("graph|llvm|tvm|t2", "a", "b")
    VerdictStore(path).record(key, _decision((0.96, 0.95, 0.97)))
    evidence = VerdictStore(path).recall(key)  # a new process: read from the file
    assert evidence == Evidence(2.0, 1.9, (0.96, 0.95, 0.97))
    assert evidence.judge(0.02)[0] is True  # 4% faster in every block: kept at a 2% margin ...
    assert evidence.judge(0.05)[0] is False  # ... not at 5%: the margin is not part of the key
    assert json.loads(path.read_text()) == {key: [2.0, 1.9, 0.96, 0.95, 0.97]}


def test_a_decision_cut_short_by_the_deadline_is_not_kept(tmp_path):
    store = VerdictStore(tmp_path / "v.json")
    assert store.record("k", _decision((0.9,), cut_short=True)) is None
    assert store.recall("k") is None and not (tmp_path / "v.json").exists()


def test_the_store_keeps_other_processes_entries(tmp_path):
    path = tmp_path / "v.json"
    one, two = VerdictStore(path), VerdictStore(path)
    one.record("a", _decision((0.9, 0.9, 0.9)))
    two.record("b", _decision((1.1, 1.1, 1.1)))  # merged with what the first wrote, not over it
    again = VerdictStore(path)
    assert again.recall("a").ratios == (0.9, 0.9, 0.9) and again.recall("b").judge(0.02)[0] is False
