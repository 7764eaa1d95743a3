"""``parity_tests.reporting.report``: the per-step gap figure draws every gap a verdict can hold."""

from __future__ import annotations

import dataclasses
import warnings

import numpy as np

from parity_tests.reporting.report import plot_scenario
from parity_tests.session.comparison import compare_case
from parity_tests.tests.helpers import MLP, make

PNG = b"\x89PNG\r\n\x1a\n"


def test_the_gap_figure_draws_zero_nan_inf_and_huge_gaps_without_a_warning():
    """A real comparison's verdict, its per-step gaps and bounds replaced by the extremes a
    divergence can give (an exact zero, NaN and Inf where one side blew up, 1e301, a bound of
    1e-300): drawn between 1e-18 and 1e30, with no warning from matplotlib's log axis."""
    result = compare_case(make(MLP, parallel__devices=1, steps=3), ["torch.single", "tf.single"])
    pair = result.pairs[0]
    verdict = dataclasses.replace(pair.verdict, per_step_gap=np.array([0.0, np.nan, np.inf, 1e301]),
                                  per_step_bound=np.array([1e-300, 1e-10, np.inf, 1e-10]))
    extreme = dataclasses.replace(result, pairs=[dataclasses.replace(pair, verdict=verdict)])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        png = plot_scenario([result, extreme], "mlp")
    assert png.startswith(PNG)


def test_a_report_leaves_the_users_backend_and_figures_alone(tmp_path):
    """Every figure the tool draws (the gap plot, a stage chain, lockstep's panels) is a Figure of its
    own: a user's backend (here ``svg``, standing in for a notebook's inline one) and pyplot's current
    figure are the same after a report is written. ``matplotlib.use("Agg")`` switched it before."""
    import matplotlib

    from parity_tests.reporting.report import write_case_report
    from parity_tests.reporting.stages import plot_stage_chain
    from parity_tests.session.lockstep import LockstepPair, LockstepResult

    before = matplotlib.get_backend()
    matplotlib.use("svg")
    import matplotlib.pyplot as plt

    mine = plt.figure()
    try:
        result = compare_case(make(MLP, parallel__devices=1, steps=3), ["torch.single", "tf.single"])
        steps = np.arange(1.0, 4.0)
        lock = LockstepResult(result, [LockstepPair("torch.single", "tf.single", "parity", "float64 bound", 0 * steps,
                                                    1e-10 + 0 * steps, ["parity"] * 3, 1e-16 * steps, 1e-10 + 0 * steps)])
        assert write_case_report(result, tmp_path / "rep", lockstep=lock).is_file()
        assert (tmp_path / "rep" / "lockstep.png").read_bytes().startswith(PNG)
        assert plot_stage_chain([{"stage": "loss", "gap": 3e-9, "bound": 1e-10}], "a vs b").startswith(PNG)
        assert matplotlib.get_backend() == "svg"
        assert plt.get_fignums() == [mine.number] and plt.gcf() is mine
    finally:
        plt.close(mine)
        matplotlib.use(before)
