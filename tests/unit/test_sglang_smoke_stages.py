"""Smoke stages `plugin` and `sglang-e2e`: skip paths and the pure comparison logic (CPU).
The plugin stage against a real deployment runs in tests/integration/test_deploy_sglang.py."""
from __future__ import annotations

from pathlib import Path

import pytest

from ddtree_ops.hostside.protocol import SmokeOptions, StageContext, Status, check_knobs
from ddtree_ops.hostside.stages import plugin as plugin_stage
from ddtree_ops.hostside.stages import sglang_e2e as e2e
from sglang_plugin.dist import sglang_package_dir


def _ctx(tmp_path: Path, device: str = "cpu", host: dict | None = None, extra: dict | None = None) -> StageContext:
    return StageContext(stage="x", device=device, options=SmokeOptions(extra=extra or {}), host=host or {},
                        run_dir=tmp_path, release_root=tmp_path, expected_release=None,
                        log=lambda m: None, emit_metric=lambda n, v: None)


def test_plugin_stage_skips_without_sglang(tmp_path, monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "sglang" else real(name, *a))
    result = plugin_stage.run(_ctx(tmp_path))
    assert result.status is Status.SKIP and result.reason.startswith("sglang is not installed in ")


@pytest.mark.slow
def test_plugin_stage_names_an_sglang_plugins_list_without_ddtree(tmp_path, monkeypatch):
    monkeypatch.setenv("SGLANG_PLUGINS", "someone_else")
    monkeypatch.setattr(plugin_stage, "_deployed_release", lambda: None)
    monkeypatch.setattr("ddtree.sglang.gate.find_package_dir", lambda: sglang_package_dir())
    result = plugin_stage.run(_ctx(tmp_path))
    assert result.status is Status.SKIP and "also: SGLANG_PLUGINS='someone_else' does not list ddtree" in result.reason
    assert result.metrics["plugins_problem"].startswith("SGLANG_PLUGINS='someone_else'")


@pytest.mark.parametrize("device, host, reason", [
    ("cpu", {"models": {"target": "t", "drafter": "d"}}, "no GPU on this host"),
    ("cuda", {"name": "gpu-a", "inventory": "fleet.yaml"},
     "no `models:` (target, drafter) configured for this host (fleet.yaml: hosts.gpu-a.models)"),
])
def test_e2e_stage_skips_with_a_reason(tmp_path, device, host, reason):
    result = e2e.run(_ctx(tmp_path, device, host))
    assert result.status is Status.SKIP and result.reason.startswith(reason)


def test_e2e_stage_refuses_to_compare_when_sglang_would_skip_the_plugin(tmp_path, monkeypatch):
    """Servers started under an SGLANG_PLUGINS that does not list ddtree would serve plain
    DFlash in the DDTree variants: the stage fails naming the variable instead of comparing."""
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",  # the servers' sglang: present
                        lambda name, *a: real("json") if name == "sglang" else real(name, *a))
    monkeypatch.setenv("SGLANG_PLUGINS", "someone_else")
    result = e2e.run(_ctx(tmp_path, "cuda", {"models": {"target": "t", "drafter": "d"}}))
    assert result.status is Status.FAIL
    assert result.reason.startswith("SGLANG_PLUGINS='someone_else' does not list ddtree")


def test_variants_budgets_and_server_arguments():
    budgets = e2e.select_budgets({"block_size": 16}, [8, 16, 32, 64, 512], {})
    assert budgets == [16, 32]  # budget + 1 >= block size, <= 256, at most two
    assert e2e.select_budgets({}, [16], {"sglang_budgets": [64]}) == [64]
    variants = e2e.plan_variants(budgets)
    assert [v.name for v in variants] == ["no-spec", "dflash", "ddtree-b16", "ddtree-b32"]
    assert variants[2].env() == {"DDTREE_ENABLE": "1", "DDTREE_BUDGET": "16", "DDTREE_TOPK": "16", "DDTREE_STRICT": "1"}
    assert variants[1].env() == {"DDTREE_ENABLE": "0"}
    models = {"target": "Qwen/Qwen3-8B", "drafter": "z-lab/Qwen3-8B-DFlash-b16"}
    argv = e2e.server_argv("/py", models, variants[3], 31003, "flashinfer", ["--mem-fraction-static", "0.8"])
    assert argv[:3] == ["/py", "-m", "sglang.launch_server"]
    assert argv[argv.index("--speculative-algorithm") + 1] == "DFLASH"
    assert argv[argv.index("--speculative-draft-model-path") + 1] == models["drafter"]
    assert argv[argv.index("--page-size") + 1] == "1" and argv[-2:] == ["--mem-fraction-static", "0.8"]
    assert "--speculative-algorithm" not in e2e.server_argv("/py", models, variants[0], 1, "triton", [])


def test_a_budget_below_the_drafters_block_is_served_with_a_block_of_budget_plus_one():
    variants = e2e.plan_variants([1, 4, 8, 16, 32], block_size=16)
    assert [(v.name, v.block_size) for v in variants] == [
        ("no-spec", None), ("dflash", None), ("ddtree-b1", 2), ("ddtree-b4", 5), ("ddtree-b8", 9),
        ("ddtree-b16", None), ("ddtree-b32", None)]
    assert [v.method for v in variants] == [None, "dflash", "ddtree_tb1", "ddtree_tb4", "ddtree_tb8",
                                             "ddtree_tb16", "ddtree_tb32"]
    models = {"target": "t", "drafter": "d"}
    argv = e2e.server_argv("py", models, variants[3], 1, "triton", [])
    assert argv[argv.index("--speculative-dflash-block-size") + 1] == "5"
    assert "--speculative-dflash-block-size" not in e2e.server_argv("py", models, variants[5], 1, "triton", [])
    assert e2e.select_budgets({"block_size": 16}, [16], {"sglang_budgets": [1, 4, 64]}) == [1, 4, 64]


def test_the_offline_check_settings_and_their_knobs():
    settings = e2e.OfflineSettings.from_extra({})
    assert (settings.enabled, settings.margin, settings.tolerance) == (True, None, 0.5)  # None: measured
    extra = check_knobs({"sglang_offline_check": False, "offline_near_tie_margin": 0.1, "acceptance_tolerance": 0.2})
    assert e2e.OfflineSettings.from_extra(extra) == e2e.OfflineSettings(False, 0.1, 0.2)
    for knob, bad in (("sglang_offline_check", "yes"), ("offline_near_tie_margin", -1), ("acceptance_tolerance", "x")):
        with pytest.raises(ValueError, match=knob):
            check_knobs({knob: bad})


def test_divergences_are_judged_by_the_targets_top2_gap():
    reference = e2e.VariantRun(e2e.plan_variants([])[0], outputs=[[1, 2, 3], [4, 5, 6], [7, 8]],
                               meta=[{"output_top_logprobs": [[[-0.1, 1, ""], [-3.0, 9, ""]]] * 3},
                                     {"output_top_logprobs": [[[-0.50, 4, ""], [-0.52, 7, ""]]] * 3},
                                     {}])
    candidate = e2e.VariantRun(e2e.plan_variants([])[1], outputs=[[1, 2, 9], [4, 7, 6], [7, 8, 1]])
    found = e2e.compare_runs(reference, candidate)
    assert [(d.prompt, d.position, d.expected, d.got) for d in found] == [(0, 2, 3, 9), (1, 1, 5, 7), (2, 2, None, 1)]
    assert found[0].gap == pytest.approx(2.9) and not found[0].near_tie(0.05)
    assert found[1].gap == pytest.approx(0.02) and found[1].near_tie(0.05)
    assert found[2].gap is None and not found[2].near_tie(0.05)


def test_summary_reports_acceptance_length_and_throughput():
    run = e2e.VariantRun(e2e.plan_variants([32])[2], outputs=[[1] * 30, [2] * 10],
                         meta=[{"spec_accept_length": 3.0}, {"spec_accept_length": 5.0}], wall_s=2.0, start_s=40)
    assert e2e.summarize(run) == {"variant": "ddtree-b32", "tokens": 40, "wall_s": 2.0, "tokens_per_s": 20.0,
                                  "acceptance_length": 4.0, "server_start_s": 40.0}


def test_prompts_file_or_shipped_prompts(tmp_path):
    assert e2e.load_prompts({}) == list(e2e.SHIPPED_PROMPTS)
    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "a"}\nplain b\n\n')
    assert e2e.load_prompts({"prompts": str(path)}) == ["a", "plain b"]


def test_token_id_prompts_and_the_cpu_server_arguments(tmp_path):
    path = tmp_path / "ids.jsonl"
    path.write_text('{"input_ids": [1, 2, 3]}\n{"prompt": "text"}\n')
    prompts = e2e.load_prompts({"prompts": str(path)})
    assert prompts == [[1, 2, 3], "text"]
    assert e2e.prompt_payload(prompts[0]) == {"input_ids": [1, 2, 3]}
    assert e2e.prompt_payload(prompts[1]) == {"text": "text"}
    models = {"target": "t", "drafter": "d"}
    variant = e2e.plan_variants([8])[2]
    gpu = e2e.server_argv("py", models, variant, 1, "flashinfer", [])
    cpu = e2e.server_argv("py", models, variant, 1, "flashinfer", [], cpu=True, token_ids=True)
    assert "--device" not in gpu and gpu[gpu.index("--attention-backend") + 1] == "flashinfer"
    assert cpu[cpu.index("--device") + 1] == "cpu" and cpu[cpu.index("--attention-backend") + 1] == "ddtree_cpu"
    assert cpu.count("--attention-backend") == 1 and "--skip-tokenizer-init" in cpu
    assert cpu[cpu.index("--dtype") + 1] == "bfloat16"


def test_a_cpu_host_runs_the_e2e_stage_only_when_its_environment_was_prepared(tmp_path, monkeypatch):
    from ddtree.sglang.cpu import environment

    ctx = _ctx(tmp_path, "cpu", {"models": {"target": "t", "drafter": "d"}})
    monkeypatch.setattr(environment, "prepared", lambda site_packages=None: False)
    assert not e2e.serves_on_cpu(ctx) and "not prepared as a CPU test server" in e2e.missing_prerequisite(ctx)
    monkeypatch.setattr(environment, "prepared", lambda site_packages=None: True)
    assert e2e.serves_on_cpu(ctx)
    assert not e2e.serves_on_cpu(_ctx(tmp_path, "cuda", {"models": {"target": "t", "drafter": "d"}}))


def test_the_no_speculation_runs_top2_and_the_measured_margin_noise():
    from ddtree_ops.hostside.offline_acceptance import MarginNoise

    meta = {"output_top_logprobs": [[[-0.1, 7, None], [-2.6, 3, None]], [], [[-0.5, 1, None], [-0.6, 2, None]]]}
    assert e2e.server_top2(meta) == [(7, 3, pytest.approx(2.5)), None, (1, 2, pytest.approx(0.1))]
    noise = MarginNoise([0.01, 0.02, 0.05, 0.4], flips=1).summary()
    assert noise == {"positions": 4, "median": 0.05, "p99": 0.4, "max": 0.4, "flips": 1}
    assert MarginNoise([], 0).summary()["max"] is None
