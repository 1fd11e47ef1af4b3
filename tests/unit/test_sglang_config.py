"""DDTREE_* environment parsing and the pure decisions behind hooks H1-H3."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ddtree.sglang.config import DEFAULT_BUDGET, DDTreeConfig, enable_setting, load_config, plugins_filter_problem
from ddtree.sglang.errors import PluginConfigError, UnsupportedSetupError
from ddtree.sglang.hooks import (
    WorkerChoice,
    around_verify_mask_policy,
    choose_mask_policy,
    drafter_scope,
    choose_worker,
    plan_after_handle_dflash,
    set_active_config,
)
from ddtree.sglang.support import (
    ServerSetup,
    check_attention_backend_class,
    check_server_setup,
    check_tensor_parallel_head,
    plan_verify_width,
    resolve_draft_block_size,
)

ON = DDTreeConfig(enabled=True, budget=63, topk=8)
OFF = DDTreeConfig()
GOOD_SETUP = ServerSetup("flashinfer", None, 1, 1, False)


def test_defaults_leave_ddtree_off_and_strict():
    config = load_config({})
    assert config == DDTreeConfig(enabled=False, budget=DEFAULT_BUDGET, topk=DEFAULT_BUDGET, strict=True)
    assert config.verify_width == DEFAULT_BUDGET + 1


def test_an_empty_switch_keeps_its_default():
    """`DDTREE_STRICT=${UNSET}` in a template must not turn strict mode off."""
    assert load_config({"DDTREE_ENABLE": "1", "DDTREE_STRICT": ""}).strict is True
    assert load_config({"DDTREE_ENABLE": " "}).enabled is False
    assert load_config({"DDTREE_ENABLE": "1", "DDTREE_STRICT": "0"}).strict is False


def test_full_configuration_round_trips_through_the_environment():
    env = {"DDTREE_ENABLE": "yes", "DDTREE_BUDGET": " 127 ", "DDTREE_TOPK": "16",
           "DDTREE_STRICT": "off", "DDTREE_METRICS_INTERVAL": "0"}
    config = load_config(env)
    assert config == DDTreeConfig(enabled=True, budget=127, topk=16, strict=False, metrics_interval=0)
    assert load_config(config.as_env()) == config


@pytest.mark.parametrize("env, message", [
    ({"DDTREE_BUDGET": "abc"}, "DDTREE_BUDGET: expected an integer, got 'abc'"),
    ({"DDTREE_BUDGET": "0"}, "DDTREE_BUDGET: must be between 1 and 1024, got 0"),
    ({"DDTREE_BUDGET": "-3"}, "DDTREE_BUDGET: must be between 1 and 1024, got -3"),
    ({"DDTREE_ENABLE": "maybe"}, "DDTREE_ENABLE: expected one of 1/0/true/false/yes/no/on/off, got 'maybe'"),
    ({"DDTREE_BUDGET": "8", "DDTREE_TOPK": "9"}, "DDTREE_TOPK: must be <= DDTREE_BUDGET (8), got 9"),
    ({"DDTREE_BUDGTE": "8"}, "DDTREE_BUDGTE: unknown variable"),
    ({"DDTREE_METRICS_INTERVAL": "1.5"}, "DDTREE_METRICS_INTERVAL: expected an integer, got '1.5'"),
])
def test_bad_values_name_the_variable_and_the_value(env, message):
    with pytest.raises(PluginConfigError) as err:
        load_config(env)
    assert str(err.value).startswith(message)


def test_the_operator_cli_variables_are_not_ours():
    assert load_config({"DDTREE_OPS_DEBUG_LOG": "/tmp/x", "DDTREE_OPS_INVENTORY": "h.yaml"}) == DDTreeConfig()


@settings(max_examples=60, deadline=None)
@given(budget=st.integers(1, 1024), data=st.data())
def test_topk_defaults_to_budget_and_never_exceeds_it(budget, data):
    assert load_config({"DDTREE_BUDGET": str(budget)}).topk == budget
    topk = data.draw(st.integers(1, budget))
    assert load_config({"DDTREE_BUDGET": str(budget), "DDTREE_TOPK": str(topk)}).topk == topk


def test_verify_width_must_cover_the_drafter_block():
    assert plan_verify_width(block_size=16, budget=15) == 16
    assert plan_verify_width(block_size=16, budget=255) == 256
    with pytest.raises(UnsupportedSetupError, match="DDTREE_BUDGET=8 gives verify width 9 < drafter block size 16"):
        plan_verify_width(block_size=16, budget=8)


def test_block_size_resolution_follows_sglang_order():
    assert resolve_draft_block_size(8, 16) == 8
    assert resolve_draft_block_size(None, 10) == 10
    assert resolve_draft_block_size(None, None) == 16


@pytest.mark.parametrize("setup, message", [
    (ServerSetup("fa3", None, 1, 1, False), "--attention-backend fa3"),
    (ServerSetup(None, "trtllm_mha", 1, 1, False), "--decode-attention-backend trtllm_mha"),
    # target verify runs on the prefill backend in SGLang's default speculative attention mode
    (ServerSetup("flashinfer", None, 1, 1, False, prefill_attention_backend="fa3"), "--prefill-attention-backend fa3"),
    (ServerSetup("triton", None, 16, 1, False), "--page-size 16"),
    (ServerSetup("triton", None, 1, 2, False), "pipeline parallelism"),
    (ServerSetup("triton", None, 1, 1, True), "DP attention"),
])
def test_unsupported_setups_are_refused_with_the_reason(setup, message):
    with pytest.raises(UnsupportedSetupError, match=message):
        check_server_setup(setup)


def test_tensor_parallelism_needs_a_vocab_parallel_head():
    check_tensor_parallel_head(tp_size=1, vocab_parallel=False)
    check_tensor_parallel_head(tp_size=8, vocab_parallel=True)
    with pytest.raises(UnsupportedSetupError, match="tensor parallelism 4 needs a vocab-parallel target lm_head"):
        check_tensor_parallel_head(tp_size=4, vocab_parallel=False)


def test_undecided_backend_and_page_size_pass_h1_and_are_checked_later():
    check_server_setup(ServerSetup(None, None, None, 1, False))
    check_attention_backend_class("TritonAttnBackend")
    with pytest.raises(UnsupportedSetupError, match="FlashAttentionBackend captures target verify without a tree mask"):
        check_attention_backend_class("FlashAttentionBackend")


def test_h1_sets_the_verify_width_only_when_enabled():
    assert plan_after_handle_dflash(OFF, block_size=16, setup=GOOD_SETUP) is None
    assert plan_after_handle_dflash(ON, block_size=16, setup=GOOD_SETUP) == 64
    with pytest.raises(UnsupportedSetupError):
        plan_after_handle_dflash(ON, block_size=16, setup=ServerSetup("fa3", None, 1, 1, False))


def test_h2_picks_our_worker_only_for_dflash_when_enabled():
    assert choose_worker(ON, is_dflash=True, has_platform_worker=False) is WorkerChoice.DDTREE
    assert choose_worker(ON, is_dflash=False, has_platform_worker=False) is WorkerChoice.ORIGINAL
    assert choose_worker(OFF, is_dflash=True, has_platform_worker=False) is WorkerChoice.ORIGINAL
    with pytest.raises(UnsupportedSetupError, match="out-of-tree platform"):
        choose_worker(ON, is_dflash=True, has_platform_worker=True)


def test_h3_forces_the_tree_mask_for_dflash_and_leaves_dspark_alone():
    assert choose_mask_policy(ON, algorithm="DFLASH", backend_name="FlashInferAttnBackend",
                              build_custom_mask=False) == ("FlashInferAttnBackend", True)
    assert choose_mask_policy(ON, algorithm="DSPARK", backend_name="FlashAttentionBackend",
                              build_custom_mask=False) == ("FlashAttentionBackend", False)
    assert choose_mask_policy(OFF, algorithm="DFLASH", backend_name="TritonAttnBackend",
                              build_custom_mask=False) == ("TritonAttnBackend", False)
    with pytest.raises(UnsupportedSetupError, match="TRTLLMHAAttnBackend"):
        choose_mask_policy(ON, algorithm="DFLASH", backend_name="TRTLLMHAAttnBackend", build_custom_mask=False)


def test_h3_leaves_a_draft_runners_backend_alone(monkeypatch):
    """SGLang asks the mask policy for draft runners too and then passes them no mask
    (decode_cuda_graph_runner.py:2114-2125): a fa3/fa4/trtllm_mha drafter must not be refused;
    the same backend for the target still is. (The spec bag is a stand-in: the hook reads only
    its algorithm.)"""
    import sys
    import types

    bag = types.SimpleNamespace(speculative_algorithm="DFLASH")
    monkeypatch.setitem(sys.modules, "sglang.srt.runtime_context", types.SimpleNamespace(get_spec=lambda: bag))
    calls = []

    def original(attn_backend):
        calls.append(attn_backend)
        return "TRTLLMHAAttnBackend", False

    set_active_config(ON)
    try:
        with drafter_scope():  # the worker builds and captures its drafter in here
            assert around_verify_mask_policy(original, "draft backend") == ("TRTLLMHAAttnBackend", False)
        with pytest.raises(UnsupportedSetupError, match="TRTLLMHAAttnBackend"):
            around_verify_mask_policy(original, "target backend")
    finally:
        set_active_config(None)
    assert calls == ["draft backend", "target backend"]


@pytest.mark.parametrize("value, names_a_problem", [
    (None, False), ("", False), ("ddtree", False), (" other , ddtree ", False),
    ("other", True), ("ddtree2,other", True), (",", True), (" ", True),
])
def test_sglang_plugins_without_ddtree_is_named(value, names_a_problem):
    """SGLang: a non-empty SGLANG_PLUGINS is split on commas and stripped; any plugin it does not
    name is skipped (a value of only separators allows none)."""
    problem = plugins_filter_problem(value)
    assert (problem is not None) is names_a_problem
    if problem:
        assert problem.startswith(f"SGLANG_PLUGINS={value!r} does not list ddtree") and "\n" not in problem


def test_the_sglang_plugins_rule_is_sglangs():
    from sglang_plugin.dist import sglang_package_dir

    loader = (sglang_package_dir() / "srt" / "plugins" / "__init__.py").read_text()
    assert "allowed_set = {x.strip() for x in allowed_str.split(\",\") if x.strip()}" in loader
    assert "if allowed_set is not None and ep.name not in allowed_set:" in loader


def _defaults_file(tmp_path, variables):
    import json

    path = tmp_path / "ddtree_server_defaults.json"
    path.write_text(json.dumps({"variables": variables, "provenance": {"run": "r1", "concurrency": 8}}))
    return path


def test_deployed_defaults_apply_and_each_environment_variable_wins(tmp_path):
    from ddtree.sglang.config import enable_setting

    path = _defaults_file(tmp_path, {"DDTREE_ENABLE": "1", "DDTREE_BUDGET": "64"})
    config = load_config({}, defaults_path=path)
    assert (config.enabled, config.budget, config.topk) == (True, 64, 64)
    assert enable_setting({}, defaults_path=path) is True
    config = load_config({"DDTREE_BUDGET": "16"}, defaults_path=path)
    assert (config.enabled, config.budget) == (True, 16)  # env wins for the budget, the file still enables
    assert load_config({"DDTREE_ENABLE": "0"}, defaults_path=path).enabled is False
    assert load_config({"DDTREE_BUDGET": " "}, defaults_path=path).budget == 64  # blank: the default
    assert load_config({}, defaults_path=tmp_path / "absent.json").budget == DEFAULT_BUDGET


@pytest.mark.parametrize("variables, expected", [
    ({"DDTREE_BUDGTE": "64"}, "DDTREE_BUDGTE: not a server default"),
    ({"DDTREE_DRAFT_BLOCK_SIZE": "16"}, "DDTREE_DRAFT_BLOCK_SIZE: not a server default"),
    ({"DDTREE_BUDGET": "0"}, "DDTREE_BUDGET: must be between 1 and"),
    ({"DDTREE_ENABLE": "maybe"}, "DDTREE_ENABLE: expected one of"),
    ({"DDTREE_BUDGET": 64}, "variables: expected an object of strings"),
])
def test_a_bad_defaults_file_is_refused_naming_the_file(tmp_path, variables, expected):
    path = _defaults_file(tmp_path, variables)
    with pytest.raises(PluginConfigError) as err:
        load_config({"DDTREE_BUDGET": "8"} if "BUDGTE" in expected else {}, defaults_path=path)
    assert str(err.value).startswith(f"{path}: ") and expected in str(err.value)


def test_an_unreadable_defaults_file_is_refused_naming_the_file(tmp_path):
    path = tmp_path / "ddtree_server_defaults.json"
    path.write_text("{not json")
    with pytest.raises(PluginConfigError, match="unreadable server defaults"):
        load_config({}, defaults_path=path)
    from ddtree.sglang.config import enable_setting

    # DDTREE_ENABLE=0 in the environment keeps an installed plugin harmless even then.
    assert enable_setting({"DDTREE_ENABLE": "0"}, defaults_path=path) is False
    assert enable_setting({}, defaults_path=path) is None


def test_a_defaults_file_nested_past_the_stack_is_a_config_error_naming_it(tmp_path):
    """#49 item 7: json.loads raised RecursionError, which no caller expected."""
    import os

    path = tmp_path / "ddtree_server_defaults.json"
    path.write_text("[" * 20_000 + "]" * 20_000)
    with pytest.raises(PluginConfigError, match=rf"^{path}: unreadable server defaults: nested too deep$"):
        load_config({"DDTREE_ENABLE": "1"}, defaults_path=path)
    assert enable_setting({}, defaults_path=path) is None
    path.write_text("[" * 100_000 + "]" * 100_000)  # the file: too large to read at all
    with pytest.raises(PluginConfigError, match=r"unreadable server defaults: larger than 65536 bytes$"):
        load_config({}, defaults_path=path)
    path.unlink()
    os.mkfifo(path)  # read as a file, a FIFO would hang the server's start
    with pytest.raises(PluginConfigError, match=r"unreadable server defaults: not a plain file$"):
        load_config({}, defaults_path=path)
