"""Run and release ids become path parts (releases/<id>/, runs/<run-id>/<host>/): only the
safe shape passes, wherever they enter; the error is one line naming the value."""
from __future__ import annotations

import pytest

from ddtree_ops.errors import ConfigError, ExitCode, RemoteStepError, UsageError
from ddtree_ops.ids import IdKind, check_cli_id, check_host_id, check_optional_host_id, check_record_id, is_safe_id

HOSTILE = ["../x", "a/b", "", ".", "..", ".hidden", "-rf", "a b", "x\n", "a\0b", "é", "/abs", "x" * 129, 7, None]
GOOD = ["20261130-172400-3f9a1c", "0123456789abcdef", "a", "A.b_c-d", "x" * 128, "a..b"]


@pytest.mark.parametrize("value", GOOD)
def test_safe_ids_pass_unchanged(value):
    assert is_safe_id(value)
    assert check_cli_id(IdKind.RUN, value) == value
    assert check_host_id("gpu-a", IdKind.RELEASE, value, "push: previous") == value


@pytest.mark.parametrize("value", HOSTILE, ids=repr)
def test_hostile_ids_are_refused_with_one_line_naming_the_value(value):
    assert not is_safe_id(value)
    with pytest.raises(UsageError) as usage:
        check_cli_id(IdKind.RUN, value)
    assert usage.value.exit_code is ExitCode.USAGE
    with pytest.raises(RemoteStepError) as remote:
        check_host_id("gpu-a", IdKind.RELEASE, value, "push: previous")
    assert str(remote.value).startswith("gpu-a: push: previous: unsafe release id ")
    with pytest.raises(ConfigError) as record:
        check_record_id("runs/x/run.json", IdKind.RUN, value, "run_id")
    for err in (usage.value, remote.value, record.value):
        text = str(err)
        assert "\n" not in text and len(text) < 260  # one line, a very long value cut short
        assert repr(value)[:20] in text


def test_absent_optional_host_ids_pass():
    assert check_optional_host_id("gpu-a", IdKind.RELEASE, None, "push: previous") is None
    with pytest.raises(RemoteStepError, match="gpu-a"):
        check_optional_host_id("gpu-a", IdKind.RELEASE, "../up", "push: previous")
