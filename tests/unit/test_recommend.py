"""Which variant and budget to deploy, per host and concurrency level, from hand-built
`sglang_load` rows: clear wins, DDTree not paying, speculation not paying, and the cases
where one run cannot decide."""
from __future__ import annotations

import pytest

from ddtree_ops.recommend import Choice, recommend, recommend_level


def rows(host="gpu-a", level=1, no_spec=100.0, dflash=200.0, **ddtree):
    out = [{"host": host, "concurrency": level, "mode": "no-spec", "budget": None, "tokens_per_s": no_spec},
           {"host": host, "concurrency": level, "mode": "dflash", "budget": None, "tokens_per_s": dflash}]
    out += [{"host": host, "concurrency": level, "mode": "ddtree", "budget": int(b[1:]), "tokens_per_s": v}
            for b, v in ddtree.items()]
    return [r for r in out if r["tokens_per_s"] is not None]


def test_a_clear_ddtree_win_names_the_budget_and_both_speedups():
    verdict = recommend_level("gpu-a", 1, rows(b64=300.0, b128=240.0))
    assert (verdict.choice, verdict.budget, verdict.tokens_per_s) == (Choice.DDTREE, 64, 300.0)
    assert (verdict.speedup_vs_no_spec, verdict.speedup_vs_dflash) == (3.0, 1.5)
    assert verdict.why.startswith("deploy DDTree with budget 64: 3.0x no speculation, 1.5x DFlash")


def test_ddtree_budgets_within_the_margin_choose_the_smaller():
    verdict = recommend_level("gpu-a", 1, rows(b64=290.0, b128=300.0))
    assert (verdict.choice, verdict.budget) == (Choice.DDTREE, 64)
    assert "budget 128 is within 5%" in verdict.why


def test_ddtree_losing_under_load_says_deploy_dflash():
    verdict = recommend_level("gpu-a", 8, rows(level=8, no_spec=400.0, dflash=600.0, b64=380.0))
    assert (verdict.choice, verdict.budget) == (Choice.DFLASH, None)
    assert verdict.why == "DDTree does not pay at 8 concurrent requests: deploy DFlash (1.5x no speculation)"


def test_speculation_losing_says_deploy_neither():
    verdict = recommend_level("gpu-a", 64, rows(level=64, no_spec=900.0, dflash=500.0, b16=450.0))
    assert verdict.choice is Choice.NO_SPECULATION and verdict.speedup_vs_no_spec == 1.0
    assert "deploy neither" in verdict.why


@pytest.mark.parametrize("table, words", [
    (rows(dflash=200.0, b64=205.0), "within 5%: too close to call"),
    (rows(dflash=None, b64=205.0), "too few points: nothing measured for DFlash"),
    (rows(no_spec=None, dflash=None, b64=float("nan")), "no speculation, DFlash, any DDTree budget"),
])
def test_one_run_that_cannot_decide_says_so_and_names_no_variant(table, words):
    verdict = recommend_level("gpu-a", 1, table)
    assert verdict.choice is Choice.UNDECIDED and verdict.budget is None and verdict.tokens_per_s is None
    assert words in verdict.why


def test_a_verdict_per_host_and_level_in_order():
    table = rows("gpu-b", 8, 400.0, 600.0, b64=380.0) + rows("gpu-a", 1, b64=300.0) + rows("gpu-a", 8, 400.0, 600.0, b64=700.0)
    verdicts = recommend(table)
    assert [(v.host, v.concurrency, v.choice) for v in verdicts] == [
        ("gpu-a", 1, Choice.DDTREE), ("gpu-a", 8, Choice.DDTREE), ("gpu-b", 8, Choice.DFLASH)]
    assert verdicts[0].to_dict()["choice"] == "ddtree" and verdicts[2].to_dict()["budget"] is None


def test_a_host_busy_during_the_measurement_is_undecided_whatever_its_numbers():
    verdict = recommend(rows(b64=300.0), noisy_hosts={"gpu-a": "host load 40.00 on 16 CPUs"})[0]
    assert verdict.choice is Choice.UNDECIDED and verdict.why.startswith("too noisy to decide: host load 40.00")


def test_numbers_from_the_cpu_test_server_never_recommend_a_variant():
    cpu_rows = [{**row, "device": "cpu"} for row in rows(b64=300.0)]
    verdict = recommend_level("local", 1, cpu_rows)
    assert verdict.choice is Choice.UNDECIDED and verdict.budget is None
    assert verdict.why.startswith("CPU numbers") and "GPU host" in verdict.why
    assert recommend_level("gpu-a", 1, [{**row, "device": "cuda"} for row in rows(b64=300.0)]).choice is Choice.DDTREE
