"""qualification.entry_from_run: what one host's run earns. Only the hashes ddtree-ops
computed (`hashes`) are recorded, over every pinned file; the host's own numbers are only
checked against them. (The sshd-fleet attacks are in tests/integration/test_hostile_qualify.py.)"""
from __future__ import annotations

from pathlib import Path

from ddtree_ops.outcome import HostOutcome
from ddtree_ops.qualification import entry_from_run
from ddtree_ops.results import HostRecord, RunRecord, StageRecord, StageStatus

PINNED = ["srt/a.py", "srt/b.py", "srt/c.py"]
OURS = {rel: f"{i:064x}" for i, rel in enumerate(PINNED, start=1)}


def run_with_plugin_stage(**metrics: object) -> RunRecord:
    stage = StageRecord(stage="plugin", index=0, status=StageStatus.PASS,
                        metrics={"structure_ok": True, "pinned": False, "sglang": "0.5.99", **metrics})
    host = HostRecord(host="h0", meta={}, stages={"plugin": stage}, outcome=HostOutcome.PASS)
    return RunRecord(run_id="r1", path=Path("/nonexistent"), meta={"stages": ["plugin"]}, hosts={"h0": host})


def entry(run: RunRecord, hashes: dict[str, str], pinned: list[str] = PINNED):
    return entry_from_run(run, "h0", ["plugin"], "rel1", "2026-12-06T00:00:00Z", version="0.5.99",
                          hashes=hashes, pinned=pinned)


def test_the_entry_holds_our_hashes_for_every_pinned_file_never_the_hosts():
    said = {PINNED[0]: OURS[PINNED[0]]}  # the host vouches for one file only
    found, why = entry(run_with_plugin_stage(file_sha256=said), dict(OURS))
    assert why == "" and found is not None
    assert found.files == OURS and (found.sglang, found.run, found.host) == ("0.5.99", "r1", "h0")


def test_a_pinned_file_we_could_not_hash_is_refused_counting_the_files():
    ours = {rel: OURS[rel] for rel in PINNED[:2]}
    found, why = entry(run_with_plugin_stage(), ours)
    assert found is None
    assert why == "ddtree-ops hashed 2 of the 3 pinned files (missing on the host: srt/c.py)"


def test_no_pinned_files_means_nothing_to_vouch_for():
    found, why = entry(run_with_plugin_stage(), {}, pinned=[])
    assert found is None and why == "no shipped manifest pins any file to hash for sglang 0.5.99"


def test_a_host_whose_own_hashes_differ_from_ours_is_refused_naming_the_file():
    found, why = entry(run_with_plugin_stage(file_sha256={PINNED[1]: "0" * 64}), dict(OURS))
    assert found is None
    assert why == "the host's plugin stage reported other hashes for srt/b.py than ddtree-ops read from its files"


def test_a_failed_or_missing_stage_earns_nothing():
    run = run_with_plugin_stage()
    run.hosts["h0"].stages["plugin"].status = StageStatus.FAIL
    assert entry(run, dict(OURS))[0] is None
    found, why = entry_from_run(run_with_plugin_stage(), "h0", ["plugin", "sglang-e2e"], "rel1", "now",
                                version="0.5.99", hashes=dict(OURS), pinned=PINNED)
    assert found is None and why == "sglang-e2e not_run"


def test_changed_code_earns_nothing_without_an_end_to_end_pass():
    """#49 item 9: pinned code changed (as the host's gate saw it): `plugin` alone, a static
    check, earns nothing; with sglang-e2e passed too, the entry records both stages."""
    changed = ["srt/a.py: hooked definitions changed: eagle_sample"]
    found, why = entry_from_run(run_with_plugin_stage(), "h0", ["plugin"], "rel1", "now", version="0.5.99",
                                hashes=dict(OURS), pinned=PINNED, code_changed=changed)
    assert found is None
    assert why == ("code changed in srt/a.py: hooked definitions changed: eagle_sample: a static check (plugin) "
                   "cannot vouch for it; sglang-e2e must pass too")
    run = run_with_plugin_stage()
    run.hosts["h0"].stages["sglang-e2e"] = StageRecord(stage="sglang-e2e", index=1, status=StageStatus.PASS)
    found, why = entry_from_run(run, "h0", ["plugin", "sglang-e2e"], "rel1", "now", version="0.5.99",
                                hashes=dict(OURS), pinned=PINNED, code_changed=changed)
    assert why == "" and found.stages == {"plugin": "pass", "sglang-e2e": "pass"}


def test_recording_an_entry_replaces_a_link_at_the_file_and_never_writes_through_it(tmp_path):
    """#49: the qualification file is written whole under a temporary name and renamed: a link
    a co-user put at its name meanwhile is replaced, its target (someone's key file) untouched."""
    from ddtree_ops.qualification import add_entry, load_file

    path = tmp_path / "sglang-qualified.json"
    qualified = load_file(path, str(tmp_path / "hosts.yaml"), create=True)  # no file yet
    victim = tmp_path / "authorized_keys"
    victim.write_text("ssh-ed25519 AAAA... operator\n")
    path.symlink_to(victim)
    found, _ = entry(run_with_plugin_stage(), dict(OURS))
    add_entry(qualified, found)
    assert victim.read_text() == "ssh-ed25519 AAAA... operator\n"
    assert not path.is_symlink() and load_file(path, "").entries == [found]
