"""What tuning says about its own options (issue 43): a kernel selection with no budget is refused, a budget
too thin to search is named."""
from __future__ import annotations

import pytest

from graphopt.errors import UserError
from pipeline.context import TuneOptions
from pipeline.tuning import MIN_TRIALS_PER_TASK, budget_warning


def test_kernels_without_a_budget_are_refused_not_ignored():
    with pytest.raises(UserError, match=r"--kernels matmul picks the kernels to tune, but --trials is 0: add "
                                        r"--trials N"):
        TuneOptions(kernels="matmul").validate()
    with pytest.raises(UserError, match="--skip-tune is given"):
        TuneOptions(trials=100, kernels="0,3", skip=True).validate()
    assert TuneOptions(trials=100, kernels="matmul").validate().enabled


def test_a_budget_too_thin_to_search_is_named():
    warning = budget_warning(6, 5)
    assert warning is not None and "--trials 6 over 5 tasks is about 1.2 trials each" in warning
    assert f"--trials {5 * MIN_TRIALS_PER_TASK} or more" in warning
    assert budget_warning(5 * MIN_TRIALS_PER_TASK, 5) is None
