"""Ansible filters for docs/ansible/smoke.yml (Ansible loads filter_plugins/ next to a playbook).

`ddtree_verdict`: a host's verdict from its smoke runner's output lines, by ddtree-ops' own
rule (ddtree_ops.record_verdict: the stage records of the stages asked for, never the host's
run_end), so the play and `ddtree-ops smoke` can never disagree about a host. It runs on the
control node, in the Python that runs ansible-playbook: ddtree-ops installed there is used,
else the checkout this playbook belongs to.
"""
import sys
from pathlib import Path


def _verdict_from_lines():
    try:
        from ddtree_ops.record_verdict import verdict_from_lines
    except ImportError:
        sys.path.insert(0, str(Path(__file__).resolve().parents[3]))  # <checkout>/docs/ansible/filter_plugins
        from ddtree_ops.record_verdict import verdict_from_lines
    return verdict_from_lines


def ddtree_verdict(lines, stages, run_id, host):
    """{"outcome", "passed", "stages": {stage: status}, "reason"}; `stages`: "env,import"."""
    asked = [s.strip() for s in str(stages).split(",") if s.strip()]
    return _verdict_from_lines()([str(line) for line in lines], asked, str(run_id), str(host))


class FilterModule(object):
    def filters(self):
        return {"ddtree_verdict": ddtree_verdict}
