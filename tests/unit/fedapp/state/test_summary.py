"""summary.json says whether every planned round trained, and why not."""

from __future__ import annotations

from fedapp.state.results import summarize


def _round(n: int, ok: int, clients: list[dict] | None = None, **metrics: object) -> dict:
    return {"round": n, "metrics": {"clients_ok": ok, **metrics}, "clients": clients or []}


def test_a_run_with_an_untrained_round_has_not_finished() -> None:
    rounds = [_round(1, 3), _round(2, 0, [{"status": "rejected", "client_id": 0}]), _round(3, 3)]
    s = summarize(rounds, 1.0, done=True)
    assert not s["finished"] and s["rounds_trained"] == 2 and s["rounds_untrained"] == [2]
    assert "1 of 3 rounds aggregated no client update (rounds 2)" in s["stopped_reason"]


def test_rounds_a_budget_refused_do_not_void_finished_but_are_named() -> None:
    refused = [{"status": "refused", "client_id": i, "reason": "budget: training round 3 would spend"} for i in (0, 1)]
    rounds = [_round(1, 2), _round(2, 2), _round(3, 0, refused), _round(4, 0, budget_exhausted=True)]
    s = summarize(rounds, 1.0, done=True)
    assert s["finished"] and s["rounds_refused_by_budget"] == [3, 4] and s["rounds_untrained"] == []
    assert "the privacy budget refused 2 of 4 rounds (rounds 3, 4)" in s["stopped_reason"]


def test_a_complete_run_has_no_stopped_reason() -> None:
    s = summarize([_round(1, 2), _round(2, 2)], 1.0, done=True)
    assert s["finished"] and s["stopped_reason"] is None


def test_a_round_poisson_sampling_left_with_fewer_than_two_clients_is_named_not_failed() -> None:
    rounds = [_round(1, 3), _round(2, 0, [], clients_sampled=1), _round(3, 0, [], clients_sampled=0), _round(4, 2)]
    s = summarize(rounds, 1.0, done=True)
    assert s["finished"] and s["rounds_unsampled"] == [2, 3] and s["rounds_untrained"] == []
    assert "client sampling drew too few clients to run 2 of 4 rounds (rounds 2, 3)" in s["stopped_reason"]


def test_a_secure_round_sampled_below_the_unmasking_minimum_is_named_not_failed() -> None:
    """Under SecAgg+ a Poisson sample of 2 is never unmasked: the strategy contacts nobody and says why; a round whose
    two clients were contacted and rejected still counts as untrained."""
    rounds = [_round(1, 3), _round(2, 0, [], clients_sampled=2, below_secure_minimum=True), _round(3, 3)]
    s = summarize(rounds, 1.0, done=True)
    assert s["finished"] and s["rounds_unsampled"] == [2] and s["rounds_untrained"] == []
    rejected = [{"status": "rejected", "client_id": i} for i in (0, 1)]
    s = summarize([_round(1, 3), _round(2, 0, rejected, clients_sampled=2), _round(3, 3)], 1.0, done=True)
    assert not s["finished"] and s["rounds_untrained"] == [2]


def test_the_final_summary_is_the_last_file_a_run_writes(tmp_path, monkeypatch) -> None:
    """The launcher ends a run as soon as summary.json says it ended, so the plots come before it."""
    import json

    from fedapp.state import results

    seen_by_plots: list[dict] = []
    monkeypatch.setattr(results, "plot_run", lambda run_dir, rounds, audit=None: seen_by_plots.append(
        json.loads((run_dir / "summary.json").read_text())))
    writer = results.ResultsWriter(tmp_path, {"strategy": "fedavg", "dataset": "digits", "seed": 1})
    writer.write_round(_round(1, 2))
    writer.finish(amend={"finished": False, "stopped_reason": "resumed without training"})
    assert len(seen_by_plots) == 1 and not seen_by_plots[0]["finished"] and not seen_by_plots[0]["stopped_reason"]
    final = json.loads((writer.run_dir / "summary.json").read_text())
    assert final["stopped_reason"] == "resumed without training" and not final["finished"]
