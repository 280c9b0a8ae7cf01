"""The benchmark report's ratios (benchmarks/report.py), against a brute force over the rounds."""

import importlib.util
import math
from pathlib import Path

import numpy as np
import pytest

_spec = importlib.util.spec_from_file_location("report", Path(__file__).parents[1] / "benchmarks" / "report.py")
report = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(report)


def _timing(rounds: list[float]) -> dict:
    return {"min": min(rounds), "median": float(np.median(rounds)), "rounds": rounds}


def _drifting_results(seed: int = 0) -> dict:
    """Two cases whose every engine slows together in some rounds (a drifting machine)."""
    rng = np.random.default_rng(seed)
    results = {}
    for case, (jt, ort, ov) in {"a": (1.0, 1.1, 0.9), "b": (2.0, 1.8, 2.4)}.items():
        drift = rng.choice([1.0, 2.0], size=9)
        noise = rng.uniform(0.97, 1.03, size=(3, 9))
        results[case] = {name: _timing(list(base * drift * noise[i]))
                         for i, (name, base) in enumerate((("jtile", jt), ("ort", ort), ("openvino", ov)))}
    return results


def test_paired_ratios_are_the_median_of_each_rounds_ratio():
    results = _drifting_results()
    paired = report.ratios(results, ("ort", "openvino"), paired=True)
    for case in results:
        mine = np.array(results[case]["jtile"]["rounds"])
        for peer in ("ort", "openvino"):
            expected = float(np.median(np.array(results[case][peer]["rounds"]) / mine))
            assert paired[case][peer] == pytest.approx(expected, rel=1e-12)
    logs = [math.log(paired[c]["ort"]) for c in results]
    assert report.geomeans(results, ("ort", "openvino"), paired=True)["ort"] == pytest.approx(
        math.exp(sum(logs) / len(logs)), rel=1e-12)


def test_the_best_peers_rounds_are_the_faster_peer_in_each_round():
    results = report.with_best(_drifting_results(1), ("ort", "openvino"))
    for times in results.values():
        expected = np.minimum(times["ort"]["rounds"], times["openvino"]["rounds"])
        np.testing.assert_array_equal(times[report.BEST]["rounds"], expected)
        assert times[report.BEST]["min"] == min(times["ort"]["min"], times["openvino"]["min"])


def test_the_paired_table_is_printed_only_for_results_with_rounds():
    results = _drifting_results(2)
    others = ("ort", "openvino")
    assert len(report.tables(results, others)) == 4
    assert "Median over rounds" in report.tables(results, others)[2]
    best_only = {case: {name: {k: t[k] for k in ("min", "median")} for name, t in times.items()}
                 for case, times in results.items()}
    assert report.tables(best_only, others) == [report.table(best_only, others)]
    assert report.ratios(best_only, others, paired=True) == {}
