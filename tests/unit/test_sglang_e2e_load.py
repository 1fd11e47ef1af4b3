"""The sglang-e2e stage's load driver against a stand-in server on 127.0.0.1 that speaks
SGLang 0.5.23's `/generate` and `/server_info` shapes (tokenizer_manager.py meta_info:
completion_tokens, spec_verify_ct; internal_state.py: internal_states[*].avg_spec_accept_length).
A unit test of our client: the server start/stop of the stage is tested with the stage."""
from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from ddtree_ops.hostside.protocol import check_knobs
from ddtree_ops.hostside.stages import sglang_e2e as e2e


class StandIn:
    """Answers /generate after `delay_s` with `tokens` ids; each reply says the request took
    `rounds` verify rounds. Counts how many requests were open at once."""

    def __init__(self, tokens: int, rounds: int | None, delay_s: float = 0.05, histogram: list[int] | None = None):
        self.tokens, self.rounds, self.delay_s, self.histogram = tokens, rounds, delay_s, histogram
        self.lock = threading.Lock()
        self.open = self.peak = self.served = 0
        self.accepted_total = self.rounds_total = 0
        stand_in = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):  # quiet
                pass

            def _reply(self, body):
                data = json.dumps(body).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):
                assert self.path == "/server_info"
                with stand_in.lock:
                    avg = stand_in.accepted_total / stand_in.rounds_total if stand_in.rounds_total else None
                states = [{"avg_spec_accept_length": avg}] if avg is not None else [{}]
                self._reply({"internal_states": states, "version": "0.5.23"})

            def do_POST(self):
                assert self.path == "/generate"
                request = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                assert request["sampling_params"]["temperature"] == 0
                with stand_in.lock:
                    stand_in.open += 1
                    stand_in.peak = max(stand_in.peak, stand_in.open)
                time.sleep(stand_in.delay_s)
                meta = {"completion_tokens": stand_in.tokens}
                if stand_in.rounds is not None:
                    meta["spec_verify_ct"] = stand_in.rounds
                if stand_in.histogram is not None:
                    meta["spec_correct_drafts_histogram"] = stand_in.histogram
                with stand_in.lock:
                    stand_in.open -= 1
                    stand_in.served += 1
                    if stand_in.rounds:
                        stand_in.accepted_total += stand_in.tokens
                        stand_in.rounds_total += stand_in.rounds
                self._reply({"text": "x", "output_ids": list(range(stand_in.tokens)), "meta_info": meta})

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.server.shutdown()
        self.server.server_close()


@pytest.mark.slow
def test_a_level_keeps_its_concurrency_in_flight_and_reads_the_counters():
    with StandIn(tokens=12, rounds=4, delay_s=0.2) as server:
        level = e2e.drive_load(server.port, ["a", "b", "c"], concurrency=4, requests=8, max_new_tokens=12)
        assert server.served == 8 and server.peak == 4  # the server saw 4 requests open at once
    assert (level.concurrency, level.requests, level.tokens, level.peak_in_flight) == (4, 8, 96, 4)
    assert level.acceptance_length == 3.0  # sum(completion_tokens) / sum(spec_verify_ct) = 96 / 32
    assert level.server_accept_before is None and level.server_accept_after == 3.0
    assert level.tokens_per_s == pytest.approx(96 / level.wall_s)


@pytest.mark.slow
def test_a_level_counts_the_tokens_verify_rounds_committed_from_the_per_request_histograms():
    # 12 tokens: 1 from the prefill, 11 in 4 rounds (1 + 3 + 3 + 4): SGLang's own ratio says 3.0
    with StandIn(tokens=12, rounds=4, delay_s=0.0, histogram=[1, 0, 2, 1]) as server:
        level = e2e.drive_load(server.port, ["a"], concurrency=2, requests=2, max_new_tokens=12)
    assert (level.accepted_tokens, level.verify_rounds, level.acceptance_length) == (22, 8, 2.75)


@pytest.mark.slow
def test_no_speculation_reports_no_acceptance():
    with StandIn(tokens=5, rounds=None, delay_s=0.0) as server:
        level = e2e.drive_load(server.port, ["a"], concurrency=2, requests=3, max_new_tokens=5)
    assert level.tokens == 15 and level.acceptance_length is None and level.server_accept_after is None


def test_the_load_table_gives_each_level_its_speedup_over_no_speculation_at_that_level():
    def run(variant, *levels):
        r = e2e.VariantRun(variant)
        r.load = [e2e.LoadLevel(c, 8, tokens, 2.0, 0, 0, None, None, c) for c, tokens in levels]
        return r

    no_spec, dflash, tree = e2e.plan_variants([64])
    rows = e2e.load_rows([run(no_spec, (1, 100), (8, 400)), run(dflash, (1, 250), (8, 600)),
                          run(tree, (1, 300), (8, 380))])
    by_key = {(r["variant"], r["concurrency"]): r for r in rows}
    assert by_key[("ddtree-b64", 1)]["speedup_vs_no_spec"] == 3.0
    assert by_key[("ddtree-b64", 8)]["speedup_vs_no_spec"] == 0.95
    assert by_key[("ddtree-b64", 8)]["budget"] == 64 and by_key[("dflash", 8)]["mode"] == "dflash"


def test_concurrency_knob_is_checked_and_defaults_to_one_and_eight():
    assert e2e.concurrency_levels({}) == [1, 8]
    assert e2e.concurrency_levels(check_knobs({"sglang_concurrency": [1, 8, 32]})) == [1, 8, 32]
    for bad in ([0], [], "eight", "0,8", [1.5]):
        with pytest.raises(ValueError, match="sglang_concurrency"):
            check_knobs({"sglang_concurrency": bad})


def test_a_comma_separated_level_list_from_the_command_line_is_read_as_integers():
    assert check_knobs({"sglang_concurrency": "1,8,32"}) == {"sglang_concurrency": [1, 8, 32]}
    assert check_knobs({"sglang_budgets": "64"}) == {"sglang_budgets": [64]}
    assert check_knobs({"sglang_concurrency": 8}) == {"sglang_concurrency": [8]}  # `--set sglang_concurrency=8`
    with pytest.raises(ValueError, match="sglang_concurrency"):
        check_knobs({"sglang_concurrency": "1,x"})


def test_every_set_the_docs_and_the_deploy_hint_print_is_accepted():
    """A `--set` a doc (or `deploy --budget auto`'s hint) tells a person to type is never refused."""
    import re
    from pathlib import Path

    from ddtree_ops.cli.smoke import parse_extra
    from ddtree_ops.deploy_budget import __file__ as hint_source

    repo = Path(__file__).resolve().parents[2]
    texts = [p.read_text(encoding="utf-8") for p in [repo / "README.md", *sorted((repo / "docs").rglob("*.md"))]]
    settings = {m for text in texts for m in re.findall(r"--set ([a-z_]+=[^\s`|)]+)", text) if "..." not in m}
    settings |= {m.replace("{level}", "8") for m in re.findall(r"--set ([a-z_]+=\{level\})", Path(hint_source).read_text())}
    assert "sglang_concurrency=8" in settings and "max_new_tokens=64" in settings
    for setting in sorted(settings):
        parse_extra([setting])
