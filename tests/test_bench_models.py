"""bench/many_models.py's arithmetic and repository (the load itself runs in `python -m bench --models`)."""

from __future__ import annotations

import pytest

from bench import many_models as mb


def test_share_sums_each_models_rate_with_both_over_its_rate_alone():
    figures = mb.round_figures({"a": 400.0, "b": 300.0}, {"a": 200.0, "b": 120.0},
                               {"a": 5.0, "b": 8.0}, {"a": 7.5, "b": 20.0})
    assert figures["share"] == pytest.approx(0.5 + 0.4)
    assert figures["p50_ratio"] == pytest.approx({"a": 1.5, "b": 2.5})


def _round(share_one: float, share_two: float, other_cpu: float = 0.0) -> dict:
    def target(share: float) -> dict:
        return {**mb.round_figures({"a": 100.0, "b": 100.0}, {"a": 50.0 * share, "b": 50.0 * share},
                                   {"a": 1.0, "b": 1.0}, {"a": share, "b": share}),
                "phases": {"both": {"other_cpu_cores": other_cpu}}}

    return {"one_server": target(share_one), "two_processes": target(share_two)}


def test_summary_takes_medians_over_rounds_and_the_one_over_two_ratio_within_each_round():
    summary = mb.summarize([_round(0.9, 0.6), _round(1.0, 0.5), _round(0.8, 0.8)])
    assert summary["one_server"]["share_median"] == pytest.approx(0.9)
    assert summary["one_server"]["share_range"] == pytest.approx([0.8, 1.0])
    assert summary["two_processes"]["share_median"] == pytest.approx(0.6)
    assert summary["one_over_two_share_median"] == pytest.approx(1.5)  # of 1.5, 2.0, 1.0
    table = mb.format_table(summary)
    assert "one_server share 0.900" in table and "two_processes share 0.600" in table


def test_summary_of_two_processes_only_has_no_ratio():
    rounds = [{"two_processes": _round(1.0, 0.6)["two_processes"]}]
    summary = mb.summarize(rounds)
    assert "one_server" not in summary and "one_over_two_share_median" not in summary
    assert "two_processes share 0.600" in mb.format_table(summary)


def test_repository_names_each_export_folder_by_its_model(tmp_path):
    exports = [tmp_path / "exports" / "default", tmp_path / "exports" / "minilm"]
    for export in exports:
        export.mkdir(parents=True)
    loads = [mb.Workload("default", exports[0], "input_ids", 100), mb.Workload("all-minilm-l6-v2", exports[1], "texts")]
    repo = mb.repository(loads, tmp_path / "repo")
    assert sorted(p.name for p in repo.iterdir()) == ["all-minilm-l6-v2", "default"]
    assert (repo / "all-minilm-l6-v2").resolve() == exports[1].resolve()


def test_summary_names_the_phases_other_jobs_disturbed():
    summary = mb.summarize([_round(0.9, 0.6), _round(0.9, 0.6, other_cpu=0.8)], max_other_cpu=0.25)
    assert summary["noisy_phases"] == ["one_server both: other processes 0.80 cores",
                                       "two_processes both: other processes 0.80 cores"]
    assert "2 phase(s) ran beside other jobs' CPU" in mb.format_table(summary)
