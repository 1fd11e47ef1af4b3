"""The local transport (subprocess, no shell) and the shell quoting the SSH transport uses."""
from __future__ import annotations

import io
import os
import subprocess
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ddtree_ops.errors import CommandTimeout, RemoteStepError
from ddtree_ops.transport.base import expand_home, shell_quote_argv
from ddtree_ops.transport.local import LocalTransport

HOSTILE = ["a b", "it's", 'say "hi"', "x; touch /tmp/ddtree-pwned", "$(touch /tmp/ddtree-pwned)", "`id`", "*", "\\n", "-e", ""]


def test_run_collects_output_status_and_lines():
    lines = []
    result = LocalTransport("local").run(
        [sys.executable, "-c", "import sys; print('one'); print('two'); sys.stderr.write('err\\n'); sys.exit(3)"],
        on_stdout_line=lines.append,
    )
    assert (result.exit_status, result.stdout, result.stderr.strip(), lines) == (3, "one\ntwo\n", "err", ["one", "two"])
    assert not result.ok and result.tail() == "err"


def test_run_passes_argv_literally():
    result = LocalTransport("local").run([sys.executable, "-c", "import sys, json; print(json.dumps(sys.argv[1:]))", *HOSTILE])
    assert result.stdout.strip() == __import__("json").dumps(HOSTILE)


def test_stdin_bytes_and_stream_env_and_cwd(tmp_path):
    transport = LocalTransport("local")
    echo = [sys.executable, "-c", "import sys, os; d = sys.stdin.buffer.read(); print(len(d), os.environ['X'], os.getcwd())"]
    assert transport.run(echo, stdin=b"abc", env={"X": "1"}, cwd=str(tmp_path)).stdout.split() == ["3", "1", str(tmp_path)]
    big = io.BytesIO(os.urandom(1 << 20))
    assert transport.put_stream(big, echo[:2] + ["import sys; print(len(sys.stdin.buffer.read()))"]).stdout.strip() == str(1 << 20)


def test_timeout_kills_the_command():
    with pytest.raises(CommandTimeout, match=r"local: command timed out: .* ran longer than 0.5s"):
        LocalTransport("local").run([sys.executable, "-c", "import time; time.sleep(30)"], timeout=0.5)


def test_missing_program_is_status_127_not_an_exception():
    result = LocalTransport("local").run(["/nonexistent/python3", "-c", "pass"])
    assert result.exit_status == 127


def test_get_file(tmp_path):
    (tmp_path / "src.txt").write_text("payload")
    LocalTransport("local").get_file(str(tmp_path / "src.txt"), str(tmp_path / "dst.txt"))
    assert (tmp_path / "dst.txt").read_text() == "payload"
    with pytest.raises(RemoteStepError, match="cannot copy"):
        LocalTransport("local").get_file(str(tmp_path / "missing"), str(tmp_path / "x"))


def test_expand_home():
    assert expand_home("~", "/home/u") == "/home/u"
    assert expand_home("~/a b", "/home/u") == "/home/u/a b"
    assert expand_home("~other/x", "/home/u") == "~other/x"
    assert expand_home("/x/~/y", "/home/u") == "/x/~/y"


def _through_sh(argv):
    line = shell_quote_argv([sys.executable, "-c", "import sys, json; print(json.dumps(sys.argv[1:]))", *argv])
    out = subprocess.run(["/bin/sh", "-c", line], capture_output=True, text=True, check=True, env={**os.environ, "HOME": "/home/tilde"})
    return __import__("json").loads(out.stdout)


def test_shell_quoting_survives_hostile_values():
    assert _through_sh(HOSTILE) == HOSTILE
    assert not os.path.exists("/tmp/ddtree-pwned")


def test_shell_quoting_expands_only_a_leading_home():
    assert _through_sh(["~", "~/a b", "~root", "x~/y"]) == ["/home/tilde", "/home/tilde/a b", "~root", "x~/y"]


@pytest.mark.slow
@settings(max_examples=60, deadline=None)
@given(st.lists(st.text(alphabet=st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00"), max_size=12).filter(lambda s: not s.startswith("~")), max_size=4))
def test_shell_quoting_roundtrips_any_text(argv):
    assert _through_sh(argv) == argv


STREAM_CODE = ("import sys, os; data = sys.stdin.buffer.read(); sys.stdout.buffer.write(data[::-1]); "
               "sys.stderr.write('done'); sys.exit(3)")


def test_run_streaming_hands_over_raw_bytes_in_order():
    payload = os.urandom(1 << 20) + b"\xff\xfe\n\x00"  # not UTF-8, several pipe buffers
    chunks: list[bytes] = []
    result = LocalTransport("local").run_streaming([sys.executable, "-c", STREAM_CODE], chunks.append, stdin=payload)
    assert b"".join(chunks) == payload[::-1]
    assert (result.exit_status, result.stdout, result.stderr) == (3, "", "done")


@pytest.mark.slow
def test_idle_timeout_kills_a_silent_command_and_spares_a_talking_one():
    import time

    from ddtree_ops.errors import ConnectionLost

    transport = LocalTransport("local")
    beating = "import time\nfor i in range(12): print(i, flush=True); time.sleep(0.5)\n"
    result = transport.run([sys.executable, "-c", beating], timeout=20, idle_timeout=3)
    assert result.exit_status == 0 and result.stdout.split() == [str(i) for i in range(12)]  # 6 s: twice the idle limit
    started = time.monotonic()
    silent = "import time\nprint('started', flush=True)\ntime.sleep(300)\n"
    with pytest.raises(ConnectionLost, match=r"local: connection lost: .* sent nothing for 3s \(it froze\); killed"):
        transport.run([sys.executable, "-c", silent], timeout=90, idle_timeout=3)
    assert time.monotonic() - started < 30  # the idle limit (10x margin), not the 90 s timeout


def test_output_past_its_bounds_stops_a_local_command_too():
    from ddtree_ops.errors import OutputLimitExceeded

    transport = LocalTransport("local")
    flood = [sys.executable, "-c", "import time\nfor i in range(100000): print('line %d' % i, flush=True)\ntime.sleep(60)"]
    with pytest.raises(OutputLimitExceeded, match=r"local: .* sent more than 100000 bytes; stopped"):
        transport.run(flood, max_output_bytes=100_000, timeout=50)
    killed = transport.run([sys.executable, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGKILL)"])
    assert killed.status_text == "killed by SIGKILL (exit -9)"


class _AnswerAfter(io.RawIOBase):
    """A stdin stream: `head` (a full 64 KiB read and a short tail), then nothing until the
    command has answered it (as push's files wait for the agent's request)."""

    def __init__(self, head: bytes, answered):
        self.head, self.answered, self.gave_up = io.BytesIO(head), answered, False

    def readable(self) -> bool:
        return True

    def read(self, size: int = -1) -> bytes:
        chunk = self.head.read(size)
        if chunk:
            return chunk
        self.gave_up = not self.answered.wait(20)  # a wide margin: the command needs well under a second
        return b""


def test_stdin_sent_so_far_reaches_the_command_before_the_stream_waits():
    """What a stream gave is delivered before its next read, which may wait on the command: a
    short last chunk left in a buffer would deadlock (a push whose agent and offer were 64 KiB
    and a little more waited for its command timeout)."""
    import threading

    head = b"x" * ((64 << 10) + 100)
    answered = threading.Event()
    code = f"import sys; sys.stdin.buffer.read({len(head)}); print('read', flush=True); sys.stdin.buffer.read()"
    stream = _AnswerAfter(head, answered)
    result = LocalTransport("local").run([sys.executable, "-c", code], stdin=stream,
                                         on_stdout_line=lambda line: answered.set(), timeout=60)
    assert result.exit_status == 0 and result.stdout == "read\n"
    assert not stream.gave_up  # it answered while the stream waited, not after the stream gave up
