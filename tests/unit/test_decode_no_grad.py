"""Every decode loop runs its forwards without autograd: a loop that records a graph is slower
(and holds activations), so decode-bench would compare the methods unfairly. Checked on the
target's and the drafter's own modules, with forward hooks that see the grad mode the loop
really ran them in."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from ddtree.decode import DecodeConfig, generate_autoregressive, generate_ddtree, generate_dflash  # noqa: E402
from ddtree.dflash_drafter import load_dflash_drafter  # noqa: E402
from ddtree.drafters import NoisyTargetDrafter  # noqa: E402
from ddtree.lossless import TINY_VOCAB, build_tiny_target, prompt_set, save_tiny_dflash_drafter, tiny_dflash_config  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")


class GradModes:
    """Records, for every forward of the hooked modules, whether autograd was on."""

    def __init__(self, *modules: torch.nn.Module):
        self.seen: list[bool] = []
        self._handles = [m.register_forward_pre_hook(self._record) for m in modules]

    def _record(self, module, args):
        self.seen.append(torch.is_grad_enabled())

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()


@pytest.fixture(scope="module")
def target():
    return build_tiny_target(seed=0)


@pytest.fixture(scope="module")
def dflash(tmp_path_factory, target):
    folder = save_tiny_dflash_drafter(tmp_path_factory.mktemp("drafter") / "d", tiny_dflash_config(), target_hidden=64)
    return load_dflash_drafter(str(folder), target)


def _loops(target, drafter):
    prompt = prompt_set(1, 7, TINY_VOCAB, seed=1)[0]
    config = DecodeConfig(max_new_tokens=12)
    return {
        "autoregressive": lambda: generate_autoregressive(target, prompt, config),
        "dflash": lambda: generate_dflash(target, drafter, prompt, config),
        "ddtree": lambda: generate_ddtree(target, drafter, prompt, config, budget=8),
    }


@pytest.mark.parametrize("method", ["autoregressive", "dflash", "ddtree"])
@pytest.mark.parametrize("drafter_kind", ["noisy-target", "dflash"])
def test_every_forward_of_every_loop_runs_without_grad(target, dflash, method, drafter_kind):
    drafter = NoisyTargetDrafter(target, block_size=6, noise=0.5) if drafter_kind == "noisy-target" else dflash
    modules = [target.model] + ([drafter.net] if drafter_kind == "dflash" else [])
    modes = GradModes(*modules)
    try:
        assert torch.is_grad_enabled()  # the caller's mode: the loop must switch it off itself
        _loops(target, drafter)[method]()
    finally:
        modes.close()
    assert modes.seen, "no forward was observed: the hooks did not see the loop"
    assert not any(modes.seen), f"{method}: {sum(modes.seen)} of {len(modes.seen)} forwards ran with autograd on"
