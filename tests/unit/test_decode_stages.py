"""The `lossless` and `decode-bench` smoke stages, run in-process against the stage protocol
(a tiny target saved with save_pretrained and a tiny DFlash drafter stand in for real models)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

from ddtree_ops.hostside.protocol import SmokeOptions, StageContext, Status  # noqa: E402
from ddtree_ops.hostside.stages import decode_bench, lossless  # noqa: E402

from ddtree.lossless import TINY_VOCAB, build_tiny_target, save_tiny_dflash_drafter, tiny_dflash_config  # noqa: E402


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def context(tmp_path: Path, stage: str, host: dict, **options) -> StageContext:
    logs: list[str] = []
    return StageContext(
        stage=stage, device="cpu", options=SmokeOptions(**options), host=host, run_dir=tmp_path / "run",
        release_root=tmp_path, expected_release=None, log=logs.append, emit_metric=lambda name, value: None,
    )


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("models")
    target = build_tiny_target(seed=0, dtype=torch.float32)
    target.model.save_pretrained(root / "tiny-target")
    save_tiny_dflash_drafter(root / "tiny-drafter", tiny_dflash_config())
    prompts = root / "prompts.jsonl"
    generator = torch.Generator().manual_seed(0)
    prompts.write_text("".join(json.dumps({"input_ids": torch.randint(0, TINY_VOCAB, (6,), generator=generator).tolist()}) + "\n"
                               for _ in range(2)))
    return {"target": str(root / "tiny-target"), "drafter": str(root / "tiny-drafter"), "block_size": 6,
            "prompts": str(prompts)}


@pytest.mark.slow
def test_lossless_stage_passes_on_cpu(tmp_path):
    result = lossless.run(context(tmp_path, "lossless", {"name": "local"}))
    assert result.status is Status.PASS, result.reason
    assert result.metrics["mismatch_count"] == 0 and result.metrics["sampling_p_value"] > 1e-3
    assert result.metrics["profile"] == "quick" and result.metrics["budgets"] == [4, 32]
    assert result.metrics["sampling_samples"] == lossless.QUICK.samples
    methods = {row["method"] for row in result.tables["lossless"]}
    assert methods == {"baseline", "dflash", "ddtree_tb4", "ddtree_tb32",
                       "dflash+dflash-adapter", "ddtree_tb32+dflash-adapter"}
    taus = result.metrics["tau.seed0.bs8"]
    assert taus[1] > taus[0] > 1.0  # the drafter speculated, and a bigger tree accepted more


@pytest.mark.slow
def test_lossless_stage_fails_when_draft_positions_are_off_by_one(tmp_path, monkeypatch):
    from ddtree import decode

    real = decode.compile_tree_inputs

    def shifted(*args, **kwargs):
        inputs = real(*args, **kwargs)
        positions = inputs.position_ids.clone()
        positions[0, 1:] += 1  # every draft node one position too far
        return inputs._replace(position_ids=positions)

    monkeypatch.setattr(decode, "compile_tree_inputs", shifted)
    result = lossless.run(context(tmp_path, "lossless", {"name": "local"}, extra={"lossless_samples": 20}))
    assert result.status is Status.FAIL
    assert "differs from AR on prompt 0 (model seed 0) at new token" in result.reason
    assert {row["method"] for row in result.tables["lossless"] if not row["identical_to_ar"]} >= {"ddtree_tb32"}
    assert all(row["identical_to_ar"] for row in result.tables["lossless"] if row["method"] in ("baseline", "dflash"))


def test_lossless_profiles_and_the_full_stage():
    from ddtree_ops.hostside.stages import lossless_full

    assert lossless.select_profile({}) is lossless.QUICK
    full = lossless.select_profile({"lossless_full": True})
    assert full == lossless.FULL and full.budgets == (1, 4, 16, 64) and len(full.models) == 2
    assert lossless.select_profile({"lossless_full": True, "lossless_tokens": 8}).new_tokens == 8
    assert lossless.QUICK.budgets[0] < lossless.QUICK.budgets[-1] and len(lossless.QUICK.budgets) >= 2
    assert lossless_full.NAME == "lossless-full" and callable(lossless_full.run)


def test_decode_bench_skips_without_models(tmp_path):
    result = decode_bench.run(context(tmp_path, "decode-bench", {"name": "gpu-a", "inventory": "fleet/eval.yaml"}))
    assert result.status is Status.SKIP
    assert result.reason == "no models configured for this host (fleet/eval.yaml: hosts.gpu-a.models)"


@pytest.mark.slow
def test_decode_bench_measures_every_method(tmp_path, models):
    ctx = context(tmp_path, "decode-bench", {"name": "local", "models": models}, budgets=[4, 16],
                  extra={"max_new_tokens": 12})
    result = decode_bench.run(ctx)
    assert result.status is Status.PASS, result.reason
    rows = {row["method"]: row for row in result.tables["methods"]}
    assert set(rows) == {"baseline", "dflash", "ddtree_tb4", "ddtree_tb16"}
    for row in rows.values():
        assert row["dataset"] == "prompts" and row["model"] == "tiny-target" and row["requests"] == 2
        assert row["identical_to_ar"] == 1.0 and row["tau"] >= 1.0 and row["speedup"] > 0
        assert abs(sum(row["histogram"].values()) - 1.0) < 1e-9
    assert rows["ddtree_tb16"]["budget"] == 16
    assert set(rows["ddtree_tb16"]["stage_split"]) == {"draft", "tree_build", "tree_compile", "verify", "commit"}
    assert result.metrics["tau.baseline"] == 1.0
    predicted = {(r["method"], r["budget"]): r for r in result.tables["predictions"]}
    assert set(predicted) == {("ar", None), ("dflash", None), ("ddtree", 4), ("ddtree", 8), ("ddtree", 16)}
    assert {r["concurrency"] for r in predicted.values()} == {1}  # a CPU host: one request at a time
    assert predicted[("ddtree", 16)]["tau"] == pytest.approx(rows["ddtree_tb16"]["tau"], abs=1e-4)
    assert predicted[("ddtree", 8)]["tau_measured"] is False and predicted[("ddtree", 8)]["width"] == 9
    assert all(r["tokens_per_s"] > 0 and r["round_ms"] > 0 for r in predicted.values())


@pytest.mark.parametrize(
    "change, message",
    [
        ({"target": "/nowhere/model"}, "hosts.local.models: model path /nowhere/model: no such folder"),
        ({"block_size": 16}, "hosts.local.models: block size 16 is not supported by"),
        ({"prompts": "/nowhere/prompts.jsonl"}, "hosts.local.models: prompts: no such file: /nowhere/prompts.jsonl"),
    ],
)
def test_decode_bench_fails_with_one_clear_message(tmp_path, models, change, message):
    ctx = context(tmp_path, "decode-bench", {"name": "local", "models": {**models, **change}}, budgets=[4])
    result = decode_bench.run(ctx)
    assert result.status is Status.FAIL
    assert result.reason.startswith(message), result.reason
    assert "\n" not in result.reason


def test_decode_bench_refuses_a_drafter_with_another_vocabulary(tmp_path, models):
    other = save_tiny_dflash_drafter(tmp_path / "wide-drafter", tiny_dflash_config(vocab_size=2 * TINY_VOCAB))
    ctx = context(tmp_path, "decode-bench", {"name": "local", "models": {**models, "drafter": str(other)}}, budgets=[4])
    result = decode_bench.run(ctx)
    assert result.status is Status.FAIL
    assert "has vocabulary 192, the target has 96" in result.reason


def test_decode_bench_tokenizes_text_prompts_through_ddtree(tmp_path, models):
    """The shipped text prompts: the tokenizer saved with the target is loaded by
    `ddtree.hf_target.load_tokenizer` (the stage never imports transformers itself)."""
    import shutil

    from tokenizers import Tokenizer, models as tokenizer_models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["[UNK]", "</s>", "how", "many", "write", "a", "python", "function", "the"]
    core = Tokenizer(tokenizer_models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    core.pre_tokenizer = pre_tokenizers.Whitespace()
    target = tmp_path / "tiny-target-with-tokenizer"
    shutil.copytree(models["target"], target)
    PreTrainedTokenizerFast(tokenizer_object=core, unk_token="[UNK]", eos_token="</s>").save_pretrained(target)
    host_models = {key: value for key, value in models.items() if key != "prompts"} | {"target": str(target)}
    ctx = context(tmp_path, "decode-bench", {"name": "local", "models": host_models}, budgets=[4],
                  extra={"max_new_tokens": 6, "max_prompts": 2})
    result = decode_bench.run(ctx)
    assert result.status is Status.PASS, result.reason
    rows = {row["method"]: row for row in result.tables["methods"]}
    assert rows["baseline"]["dataset"] == decode_bench.DATASET_NAME and rows["baseline"]["requests"] == 2
    assert rows["ddtree_tb4"]["identical_to_ar"] == 1.0
