"""The SSH transport against real sshd processes on 127.0.0.1: commands, quoting, host keys,
auth, closed ports, frozen and killed servers, ssh_config aliases and ProxyJump."""
from __future__ import annotations

import json
import os
import socket
import sys
import threading
import time

import pytest

from ddtree_ops.cli.app import main
from ddtree_ops.errors import (
    AuthenticationFailed,
    CommandTimeout,
    ConnectionLost,
    ConnectionRefused,
    ConnectTimeout,
    HostKeyRejected,
    RemoteStepError,
)
from ddtree_ops.transport.factory import open_transport
from sshd_fleet import free_port, keygen

pytestmark = pytest.mark.sshd

ECHO_ARGV = [sys.executable, "-c", "import sys, json; print(json.dumps(sys.argv[1:]))"]
HOSTILE = ["a b", "it's", 'say "hi"', "x; touch /tmp/ddtree-ssh-pwned", "$(touch /tmp/ddtree-ssh-pwned)", "`id`", "*", ""]


def test_commands_streams_env_cwd_and_files(sshd_fleet, tmp_path):
    fleet = sshd_fleet(1)
    host = fleet.inventory().hosts["h0"]
    lines = []
    with open_transport(host) as transport:
        result = transport.run(
            [sys.executable, "-c", "import os, sys; print('a'); print(os.environ['K'], os.getcwd()); sys.stderr.write('e'); sys.exit(4)"],
            env={"K": "v w"}, cwd=str(tmp_path), on_stdout_line=lines.append,
        )
        assert (result.exit_status, result.stdout, result.stderr) == (4, f"a\nv w {tmp_path}\n", "e")
        assert lines == ["a", f"v w {tmp_path}"]
        assert json.loads(transport.run(ECHO_ARGV + HOSTILE).stdout) == HOSTILE
        size = transport.run([sys.executable, "-c", "import sys; print(len(sys.stdin.buffer.read()))"], stdin=os.urandom(3 << 20))
        assert size.stdout.strip() == str(3 << 20)
        (tmp_path / "remote.bin").write_bytes(b"\x00\x01payload")
        transport.get_file(str(tmp_path / "remote.bin"), str(tmp_path / "copy.bin"))
        assert (tmp_path / "copy.bin").read_bytes() == b"\x00\x01payload"
        with pytest.raises(RemoteStepError, match="cannot read"):
            transport.get_file(str(tmp_path / "nope"), str(tmp_path / "x"))
        payload = os.urandom(1 << 20) + b"\xff\xfe\n\x00"  # raw bytes, not UTF-8, many chunks
        chunks: list[bytes] = []
        reverse = "import sys; sys.stdout.buffer.write(sys.stdin.buffer.read()[::-1]); sys.stderr.write('done')"
        streamed = transport.run_streaming([sys.executable, "-c", reverse], chunks.append, stdin=payload)
        assert b"".join(chunks) == payload[::-1] and (streamed.exit_status, streamed.stderr) == (0, "done")
        home = transport.run(["printf", "%s", "~/x y"]).stdout
        assert home == f"{fleet.hosts[0].home}/x y"  # expanded by the host's shell, as the host's ~
        sock = transport._client.get_transport().sock
        assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) != 0
    assert not os.path.exists("/tmp/ddtree-ssh-pwned")


def test_closed_port_is_refused(sshd_fleet, capsys):
    fleet = sshd_fleet(1)
    port = free_port()
    inventory = fleet.write_inventory(extra_hosts={"dead": {"hostname": "127.0.0.1", "port": port}})
    hosts = fleet.inventory(extra_hosts={"dead": {"hostname": "127.0.0.1", "port": port}}).hosts
    with pytest.raises(ConnectionRefused, match=f"dead: connection refused: nothing listens on 127.0.0.1:{port}"):
        open_transport(hosts["dead"])
    assert main(["hosts", "check", "-i", str(inventory), "-H", "dead", "--json"]) == 4
    capsys.readouterr()
    assert main(["hosts", "check", "-i", str(inventory), "--json"]) == 6
    doc = json.loads(capsys.readouterr().out)
    assert doc["hosts"]["dead"]["state"] == "unreachable" and doc["hosts"]["h0"]["ok"]


def test_unresolvable_and_hostile_hostname_is_unreachable(sshd_fleet):
    fleet = sshd_fleet(1)
    host = fleet.inventory(host_overrides={"h0": {"hostname": "127.0.0.1; touch /tmp/ddtree-ssh-pwned"}}).hosts["h0"]
    with pytest.raises(Exception) as caught:
        open_transport(host)
    assert type(caught.value).__name__ == "HostUnreachable" and "cannot resolve" in str(caught.value)
    assert not os.path.exists("/tmp/ddtree-ssh-pwned")


def test_frozen_sshd_before_connect_is_bounded(sshd_fleet):
    fleet = sshd_fleet(1, connect_timeout=1)
    host = fleet.inventory().hosts["h0"]
    fleet.hosts[0].freeze()  # TCP still accepts (kernel backlog); no banner ever comes
    try:
        started = time.monotonic()
        with pytest.raises(ConnectTimeout, match=r"h0: timed out: 127.0.0.1:\d+: no SSH handshake within 1s \(the host "
                                                 r"accepted the connection but did not answer"):
            open_transport(host)
        assert time.monotonic() - started < 10  # bounded by connect_timeout, not a hang
    finally:
        fleet.hosts[0].thaw()


def test_a_port_that_is_no_ssh_server_is_named_as_such_without_tracebacks(sshd_fleet, tmp_path, capsys, monkeypatch):
    """A web server on the port answers and hangs up at once: not a timeout, and Paramiko's
    own logged traceback stays out of the terminal (it goes to the debug log)."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(4)
    port = listener.getsockname()[1]

    def answer_like_http() -> None:
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            conn.sendall(b"HTTP/1.1 400 Bad Request\r\n\r\n")
            conn.close()

    threading.Thread(target=answer_like_http, daemon=True).start()
    fleet = sshd_fleet(1, connect_timeout=60)
    inventory = fleet.write_inventory(host_overrides={"h0": {"port": port}})
    monkeypatch.setenv("DDTREE_OPS_DEBUG_LOG", str(tmp_path / "debug.log"))
    try:
        started = time.monotonic()
        assert main(["hosts", "check", "-i", str(inventory), "-H", "h0", "--json"]) == 4
        assert time.monotonic() - started < 30  # it hung up: no waiting for the 60 s timeout
        captured = capsys.readouterr()
        error = json.loads(captured.out)["hosts"]["h0"]["error"]
        assert "connection lost" in error and "without an SSH banner (is it an SSH server?)" in error
        assert "Traceback" not in captured.err and "paramiko" not in captured.err
        assert "Error reading SSH protocol banner" in (tmp_path / "debug.log").read_text()
    finally:
        listener.close()


def test_frozen_sshd_mid_command_is_bounded(sshd_fleet):
    fleet = sshd_fleet(1)
    host = fleet.inventory().hosts["h0"]
    with open_transport(host) as transport:
        timer = threading.Timer(0.5, fleet.hosts[0].freeze)
        timer.start()
        try:
            started = time.monotonic()
            with pytest.raises(CommandTimeout, match=r"h0: command timed out: .* ran longer than 2s"):
                transport.run([sys.executable, "-c", "import time\nfor i in range(100): print(i, flush=True); time.sleep(0.1)"], timeout=2)
            assert time.monotonic() - started < 30  # bounded by the timeout, not by the 10 s command
        finally:
            timer.join()
            fleet.hosts[0].thaw()


def test_waiting_for_the_exit_status_after_eof_does_not_spin(sshd_fleet, monkeypatch):
    """The remote closes its output (EOF arrives), then exits 0.6 s later. Paramiko's channel
    pipe stays readable after EOF, so a select() loop would spin thousands of times, holding
    the GIL the other hosts' threads need."""
    import ddtree_ops.transport.ssh as ssh_module

    calls = []
    real_select = ssh_module.select.select

    def counting_select(*args):
        calls.append(args)
        return real_select(*args)

    fleet = sshd_fleet(1)
    host = fleet.inventory().hosts["h0"]
    with open_transport(host) as transport:
        monkeypatch.setattr(ssh_module.select, "select", counting_select)
        result = transport.run(["sh", "-c", "echo out; exec >&- 2>&-; sleep 0.6; exit 3"])
    assert (result.exit_status, result.stdout) == (3, "out\n")
    assert len(calls) < 20, f"{len(calls)} select() calls while waiting for the exit status"


def test_killed_sshd_mid_command_is_connection_lost(sshd_fleet):
    fleet = sshd_fleet(1)
    host = fleet.inventory().hosts["h0"]
    with open_transport(host) as transport:
        timer = threading.Timer(0.5, fleet.hosts[0].kill)
        timer.start()
        with pytest.raises(ConnectionLost, match="h0: connection lost"):
            transport.run([sys.executable, "-c", "import time; time.sleep(20)"], timeout=15)
        timer.join()
        with pytest.raises(ConnectionLost):
            transport.run(["true"])  # the connection stays dead; never a fake result


def test_unknown_host_key_refused_then_trusted_on_first_use(sshd_fleet, capsys):
    fleet = sshd_fleet(2)
    fleet.known_hosts.write_text(fleet.hosts[1].known_hosts_line())  # h0 unknown
    hosts = fleet.inventory().hosts
    with pytest.raises(HostKeyRejected, match=r"h0: host key refused: \[127.0.0.1\]:\d+ is not in .*known_hosts \(ssh-ed25519 SHA256:.*--accept-new-host-keys"):
        open_transport(hosts["h0"])
    inventory = fleet.write_inventory()
    assert main(["hosts", "check", "-i", str(inventory), "-H", "h0"]) == 4
    assert main(["hosts", "check", "-i", str(inventory), "-H", "h0", "--accept-new-host-keys"]) == 0
    assert fleet.known_hosts.read_text().count(f"[127.0.0.1]:{fleet.hosts[0].port} ssh-ed25519 ") == 1
    assert main(["hosts", "check", "-i", str(inventory)]) == 0  # recorded: no flag needed now
    capsys.readouterr()


def test_changed_host_key_always_refused(sshd_fleet, tmp_path, capsys):
    fleet = sshd_fleet(2)
    other = tmp_path / "other_key"
    keygen(other)
    kind, blob = other.with_suffix(".pub").read_text().split()[:2]
    fleet.known_hosts.write_text(fleet.hosts[1].known_hosts_line() + f"[127.0.0.1]:{fleet.hosts[0].port} {kind} {blob}\n")
    before = fleet.known_hosts.read_text()
    inventory = fleet.write_inventory()
    with pytest.raises(HostKeyRejected, match=r"h0: host key refused: the host key of 127.0.0.1:\d+ CHANGED"):
        open_transport(fleet.inventory().hosts["h0"], accept_new_host_keys=True)
    assert main(["push", "-i", str(inventory), "--accept-new-host-keys", "--json"]) == 6
    doc = json.loads(capsys.readouterr().out)
    assert "CHANGED" in doc["hosts"]["h0"]["error"] and doc["hosts"]["h1"]["ok"]
    assert fleet.known_hosts.read_text() == before
    assert not (fleet.hosts[0].workdir / "current").exists()


def test_wrong_client_key_is_auth_failure(sshd_fleet, tmp_path):
    fleet = sshd_fleet(1)
    stranger = tmp_path / "stranger"
    keygen(stranger)
    host = fleet.inventory(host_overrides={"h0": {"identity_file": str(stranger)}}).hosts["h0"]
    with pytest.raises(AuthenticationFailed, match="h0: authentication failed"):
        open_transport(host)
    missing = fleet.inventory(host_overrides={"h0": {"identity_file": str(tmp_path / "nokey")}}).hosts["h0"]
    with pytest.raises(AuthenticationFailed, match="identity_file .*nokey does not exist"):
        open_transport(missing)


def test_ssh_config_alias_identity_and_proxyjump(sshd_fleet, tmp_path):
    fleet = sshd_fleet(2)
    config = tmp_path / "ssh_config"
    config.write_text(
        f"Host jumpbox\n  HostName 127.0.0.1\n  Port {fleet.hosts[0].port}\n  IdentityFile {fleet.client_key}\n"
        f"Host behind\n  HostName 127.0.0.1\n  Port {fleet.hosts[1].port}\n  IdentityFile {fleet.client_key}\n"
        f"  ProxyJump jumpbox\n"
    )
    inv = fleet.inventory(extra_hosts={"via-alias": {"hostname": "behind", "ssh_config": str(config), "workdir": str(tmp_path / "w")}})
    host = inv.hosts["via-alias"]
    # The inventory's defaults set identity_file; drop it so ssh_config's IdentityFile is what works.
    host = type(host)(**{**host.__dict__, "identity_file": None, "port": None})
    with open_transport(host) as transport:
        assert transport.target.proxy_jump == "jumpbox" and transport.target.port == fleet.hosts[1].port
        assert transport.run(["echo", "through the jump"]).stdout == "through the jump\n"
        assert len(transport._clients) == 2


BEATING = "import time\nfor i in range(12): print(i, flush=True); time.sleep(0.5)\n"
FALLS_SILENT = "import time\nprint('started', flush=True)\ntime.sleep(300)\n"


def test_idle_timeout_stops_a_silent_command_and_spares_a_talking_one(sshd_fleet):
    fleet = sshd_fleet(1)
    with open_transport(fleet.inventory().hosts["h0"]) as transport:
        result = transport.run([sys.executable, "-c", BEATING], timeout=20, idle_timeout=3)
        assert result.exit_status == 0 and result.stdout.split() == [str(i) for i in range(12)]  # 6 s: twice the idle limit
        started = time.monotonic()
        with pytest.raises(ConnectionLost, match=r"h0: connection lost: .* sent nothing for 3s \(the host or "
                                                 r"the connection froze\); channel closed"):
            transport.run([sys.executable, "-c", FALLS_SILENT], timeout=90, idle_timeout=3)
        assert time.monotonic() - started < 30  # the idle limit (10x margin), not the 90 s timeout


def test_ssh_config_cannot_loosen_host_key_checks(sshd_fleet, tmp_path):
    """`StrictHostKeyChecking no` (or accept-new) in ssh_config is ignored: an unknown key is
    still refused, and nothing is written to known_hosts."""
    fleet = sshd_fleet(1)
    config = tmp_path / "ssh_config"
    config.write_text("Host *\n  StrictHostKeyChecking no\n")
    fleet.known_hosts.write_text("")
    host = fleet.inventory(host_overrides={"h0": {"ssh_config": str(config)}}).hosts["h0"]
    with pytest.raises(HostKeyRejected, match=r"is not in .*known_hosts"):
        open_transport(host)
    assert fleet.known_hosts.read_text() == ""
