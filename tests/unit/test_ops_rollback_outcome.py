"""The rollback's outcome on the operator side: one step, named in words (#49 item 2), from a
host reply that is checked before any of it reaches the screen. The transport is a stand-in
that returns a given reply (the layer below is tested over real SSH in
tests/integration/test_deploy_steps.py)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from ddtree_ops.deploy import RollbackOutcome, rollback_host
from ddtree_ops.errors import RemoteStepError
from ddtree_ops.inventory import parse_inventory
from ddtree_ops.release import build_bundle
from ddtree_ops.transport.base import CommandResult

REPO = Path(__file__).resolve().parents[2]
A, B = "0da44e9253f200fd", "5b18049cbab92ae8"
B8, B16 = {"DDTREE_ENABLE": "1", "DDTREE_BUDGET": "8"}, {"DDTREE_ENABLE": "1", "DDTREE_BUDGET": "16"}


class Replying:
    """Answers every command with one agent reply."""

    def __init__(self, reply: dict):
        self.reply = reply

    def run(self, argv, **_options) -> CommandResult:
        return CommandResult("h0", tuple(argv), 0, json.dumps({"ok": True, "rollback": self.reply}) + "\n", "", 0.1)


@pytest.fixture(scope="module")
def host_and_bundle():
    host = parse_inventory({"hosts": {"h0": {"hostname": "h0.invalid"}}}, source="hosts.yaml", base_dir=REPO).hosts["h0"]
    return host, build_bundle(REPO)


def rolled(host_and_bundle, **reply) -> RollbackOutcome:
    host, bundle = host_and_bundle
    return rollback_host(Replying(reply), host, bundle)


@pytest.mark.parametrize("reply, step", [
    (dict(action="rolled-back", release=B, restored=A, release_defaults=B16, restored_defaults={}),
     f"rolled back release {B} (DDTREE_BUDGET=16, DDTREE_ENABLE=1): release {A} is deployed again"),
    (dict(action="rolled-back", release=A, restored=None), f"rolled back release {A}: the plugin is removed"),
    (dict(action="recovered", interrupted=True, release=B, restored=B, release_defaults=B16, restored_defaults=B8),
     f"undid the interrupted deploy of release {B} (DDTREE_BUDGET=16, DDTREE_ENABLE=1): release {B} "
     "(DDTREE_BUDGET=8, DDTREE_ENABLE=1) is deployed again, as before that deploy"),
    (dict(action="rolled-back", interrupted=True, release=B, restored=A),
     f"finished the interrupted rollback of release {B}: release {A} is deployed again"),
    (dict(action="recovered", release=None), "removed what a killed deploy left; nothing is deployed"),
    (dict(action="nothing-deployed"), "nothing deployed: nothing to roll back"),
])
def test_each_step_is_named(host_and_bundle, reply, step):
    outcome = rolled(host_and_bundle, **reply)
    assert outcome.step == step and outcome.to_dict()["step"] == step


@pytest.mark.parametrize("reply, message", [
    (dict(action="rolled-back\x1b[2J", release=A), "h0: rollback: unknown action"),
    (dict(action="rolled-back", release=A, release_defaults={"PATH": "/tmp"}), "h0: rollback: release_defaults:"),
    (dict(action="rolled-back", release=A, restored_defaults={"DDTREE_BUDGET": "8\x1b]0;pwned\x07"}),
     "h0: rollback: restored_defaults:"),
    (dict(action="rolled-back", release="../../etc"), "h0: rollback: release"),
])
def test_a_forged_reply_is_a_remote_error_naming_the_field(host_and_bundle, reply, message):
    with pytest.raises(RemoteStepError) as err:
        rolled(host_and_bundle, **reply)
    assert str(err.value).startswith(message) and "\n" not in str(err.value)
