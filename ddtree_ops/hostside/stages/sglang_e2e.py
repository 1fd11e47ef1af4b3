"""Stage `sglang-e2e`: SGLang serving with no speculation, DFlash, and DFlash + DDTree.

Needs a GPU, SGLang, the deployed plugin (`ddtree-ops deploy`) and `models:` in the host's
inventory entry (target, drafter, block_size, optional prompts file: text lines, or JSON lines
{"prompt": text} / {"input_ids": [...]}). Without a GPU it runs on SGLang's CPU engine where
the Python environment was prepared as a CPU test server (scripts/sglang_cpu_env.sh,
ddtree.sglang.cpu); every row then says device "cpu" and the summary says these are CPU
numbers. Starts one server per variant (no speculation; DFLASH; DFLASH + DDTree at each
selected budget; a budget below the drafter's block is served with a block of budget + 1), each
on a port it must own (`ddtree_ops.hostside.server_process`: a port that is taken, or taken
while the server starts, fails the start at once naming it, and the server that answers must
report our model and port). Sends the prompts at temperature 0 (ignore_eos, so every request
makes max_new_tokens), compares every variant's tokens with the no-speculation run, and
records acceptance length, tokens/s and wall time. Every server started is stopped (its whole
process group), also on failure.

Acceptance length is SGLang's per-request histogram (meta_info.spec_correct_drafts_histogram:
rounds per number of accepted drafts) averaged over rounds, i.e. accepted tokens per verify
round, bonus included: the offline loop's tau. Then the offline loop (`ddtree.decode`) decodes
the same prompts with each variant's method, budget and block at T=0, following that server's
own tokens (so a bf16 near-tie of the target cannot move the text), and every request's
acceptance is held against it (`ddtree_ops.hostside.acceptance`): equal where the offline
choices had no near-tie (less than `offline_near_tie_margin` to spare: the drafter's on the
target's path, the target's past the server's last token), else the rounds before the first
near-tie present and the variant's mean within `acceptance_tolerance`. The margin, unless
given, is twice the largest difference measured between the no-speculation server's top-2 gaps
and the offline target's on the same text (the no-spec row's `margin_noise`). The
`sglang_acceptance` table has a row per variant and prompt, the variant rows the histograms side
by side. A mismatch fails the stage: the server is lossless but does not accept what the same
models accept offline.

A divergence from the no-speculation tokens is judged by the target's top-1/top-2 log-prob
gap at that position (from the no-speculation run): below `near_tie_gap` it is a bf16
near-tie (verify width changes GEMM shapes) and is reported, otherwise the stage fails.

Then each server is driven under load: at every concurrency level of `sglang_concurrency`
(default 1 and 8), that many requests are kept in flight at temperature 0 until
`sglang_requests_per_level` (default max(prompts, 2 x level)) have finished. Per level: output
tokens/s over the level's wall time, acceptance length from SGLang's per-request histograms and
the server's lifetime average (`/server_info` internal_states avg_spec_accept_length) read
before and after, as the `sglang_load` table (one row per variant and level, with the speedup
over no speculation at the same level): the measurements `report` recommends a variant and
budget from, and draws the budget curve from.

Knobs (options.extra): sglang_budgets (default: up to two of options.budgets with
budget + 1 >= block_size, at most 256; given, any of 1..1024), sglang_max_new_tokens (128),
sglang_port (31000), sglang_start_timeout_s (900), sglang_attention_backend ("flashinfer"),
near_tie_gap (0.05), sglang_extra_args (list of extra server arguments), sglang_concurrency
(list, [1, 8]), sglang_requests_per_level (int), sglang_offline_check (true),
offline_near_tie_margin (measured), acceptance_tolerance (0.5 tokens per round).
"""
from __future__ import annotations

import json
import os
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any, Union

from ddtree_ops.hostside import acceptance
from ddtree_ops.hostside.protocol import TIMINGS_TABLE, StageContext, StageResult, timing_row
from ddtree_ops.hostside.server_process import NotOurServerError, PortTakenError, launch, stop_process_group, \
    wait_until_serving

NAME = "sglang-e2e"
DESCRIPTION = "SGLang end to end: no speculation vs DFlash vs DFlash+DDTree (tokens, acceptance, tokens/s)"
TIMED = True  # the runner samples the host's load around it

SHIPPED_PROMPTS = (
    "Write a Python function that returns the n-th Fibonacci number iteratively.",
    "Explain in three sentences why the sky is blue.",
    "def quicksort(items):\n    \"\"\"Sort a list with quicksort.\"\"\"\n",
    "List the first ten prime numbers, separated by commas.",
    "Translate to French: The weather is nice today and we are going to the park.",
    "Write a SQL query that returns the five most recent orders per customer.",
    "Summarize the plot of Romeo and Juliet in two sentences.",
    "Implement binary search in C and explain its complexity.",
)
SHIPPED_DATASET = "sglang-e2e-prompts"  # the `dataset` of the rows when no prompts file is configured
DEFAULT_NEAR_TIE_GAP = 0.05  # nats between the target's top-1 and top-2 log-probs
DEFAULT_CONCURRENCY = (1, 8)
ACCEPTANCE_TABLE = "sglang_acceptance"
Prompt = Union[str, list[int]]  # text, or token ids (a model without a tokenizer)


class ServerMode(Enum):
    NO_SPEC = "no-spec"
    DFLASH = "dflash"
    DDTREE = "ddtree"


@dataclass(frozen=True)
class ServerVariant:
    name: str
    mode: ServerMode
    budget: int | None = None
    block_size: int | None = None  # the drafter's block when shorter than its own (budget + 1)

    def env(self) -> dict[str, str]:
        """The plugin's variables; TOPK = budget (the exact DDTree tree, whatever a deployed
        default says), so that the offline loop's trees are the server's."""
        if self.mode is ServerMode.DDTREE:
            return {"DDTREE_ENABLE": "1", "DDTREE_BUDGET": str(self.budget), "DDTREE_TOPK": str(self.budget),
                    "DDTREE_STRICT": "1"}
        return {"DDTREE_ENABLE": "0"}

    @property
    def method(self) -> str | None:
        """decode-bench's method key for the same method and budget (ddtree.decode.method_key)."""
        if self.mode is ServerMode.DDTREE:
            from ddtree.decode import DDTREE_KEY_PREFIX

            return f"{DDTREE_KEY_PREFIX}{self.budget}"
        return "dflash" if self.mode is ServerMode.DFLASH else None


@dataclass(frozen=True)
class Divergence:
    prompt: int
    position: int  # first differing output token
    expected: int | None  # no-speculation token (None: the variant produced more tokens)
    got: int | None
    gap: float | None  # target's top-1 minus top-2 log-prob there (None: unknown)

    def near_tie(self, threshold: float) -> bool:
        return self.gap is not None and self.gap < threshold


@dataclass(frozen=True)
class LoadLevel:
    """One concurrency level driven against one server."""

    concurrency: int
    requests: int
    tokens: int
    wall_s: float
    accepted_tokens: int  # tokens committed by verify rounds (the histograms; else completion_tokens)
    verify_rounds: int  # verify rounds of the same requests (spec_verify_ct)
    server_accept_before: float | None  # the server's lifetime average, before the level
    server_accept_after: float | None
    peak_in_flight: int  # most requests this client had open at once

    @property
    def tokens_per_s(self) -> float | None:
        return self.tokens / self.wall_s if self.wall_s > 0 else None

    @property
    def acceptance_length(self) -> float | None:
        return self.accepted_tokens / self.verify_rounds if self.verify_rounds else None


@dataclass
class VariantRun:
    variant: ServerVariant
    outputs: list[list[int]] = field(default_factory=list)
    meta: list[dict[str, Any]] = field(default_factory=list)
    wall_s: float = 0.0
    start_s: float = 0.0
    load: list[LoadLevel] = field(default_factory=list)
    prompt_s: list[float] = field(default_factory=list)  # wall time of each /generate call

    def histograms(self) -> list[list[int] | None]:
        return [acceptance.server_histogram(m) for m in self.meta]


def select_budgets(models: dict[str, Any], options_budgets: list[int], extra: dict[str, Any]) -> list[int]:
    if "sglang_budgets" in extra:
        return [int(b) for b in extra["sglang_budgets"]]
    block = int(models.get("block_size", 16))
    usable = [b for b in options_budgets if b + 1 >= block and b <= 256]
    return usable[:2]


def plan_variants(budgets: list[int], block_size: int | None = None) -> list[ServerVariant]:
    """No speculation, DFlash, then DDTree per budget; a budget whose verify width (budget + 1)
    is below the drafter's block `block_size` drafts with a block of budget + 1 (the plugin
    refuses a verify narrower than the draft block)."""
    def short_block(budget: int) -> int | None:
        return budget + 1 if block_size is not None and budget + 1 < block_size else None

    return [ServerVariant("no-spec", ServerMode.NO_SPEC), ServerVariant("dflash", ServerMode.DFLASH)] + [
        ServerVariant(f"ddtree-b{b}", ServerMode.DDTREE, b, short_block(b)) for b in budgets
    ]


def server_argv(python: str, models: dict[str, Any], variant: ServerVariant, port: int,
                attention_backend: str, extra_args: list[str], *, cpu: bool = False,
                token_ids: bool = False) -> list[str]:
    argv = [python, "-m", "sglang.launch_server", "--model-path", models["target"], "--host", "127.0.0.1",
            "--port", str(port), "--page-size", "1", "--enable-metrics"]
    if cpu:  # the CPU test server (ddtree.sglang.cpu): its device, dtype and attention backend
        from ddtree.sglang.cpu.environment import SERVER_ARGS

        argv += list(SERVER_ARGS)
    else:
        argv += ["--attention-backend", attention_backend]
    if token_ids:  # prompts given as token ids: the model needs no tokenizer
        argv.append("--skip-tokenizer-init")
    if variant.mode is not ServerMode.NO_SPEC:
        argv += ["--speculative-algorithm", "DFLASH", "--speculative-draft-model-path", models["drafter"]]
        if variant.block_size is not None:
            argv += ["--speculative-dflash-block-size", str(variant.block_size)]
    return argv + list(extra_args)


def first_divergence(reference: list[int], candidate: list[int]) -> int | None:
    return acceptance.first_difference(reference, candidate)


def top2_gap(meta: dict[str, Any], position: int) -> float | None:
    """Top-1 minus top-2 log-prob at an output position, from SGLang's output_top_logprobs."""
    rows = meta.get("output_top_logprobs") or []
    if position >= len(rows) or not rows[position] or len(rows[position]) < 2:
        return None
    first, second = rows[position][0][0], rows[position][1][0]
    return float(first) - float(second)


def compare_runs(reference: VariantRun, candidate: VariantRun) -> list[Divergence]:
    found = []
    for index, (ref, got) in enumerate(zip(reference.outputs, candidate.outputs)):
        position = first_divergence(ref, got)
        if position is None:
            continue
        found.append(Divergence(
            prompt=index, position=position,
            expected=ref[position] if position < len(ref) else None,
            got=got[position] if position < len(got) else None,
            gap=top2_gap(reference.meta[index], position),
        ))
    return found


def acceptance_of(meta: list[dict[str, Any]]) -> float | None:
    """Accepted tokens per verify round over the requests' histograms (SGLang's per-request
    spec_accept_length divides by rounds the prefill's token too: only a fallback)."""
    counts = [h for h in (acceptance.server_histogram(m) for m in meta) if h]
    if counts:
        return acceptance.mean_length(acceptance.add_histograms(counts))
    accept = [m["spec_accept_length"] for m in meta if "spec_accept_length" in m]
    return sum(accept) / len(accept) if accept else None


def summarize(run: VariantRun) -> dict[str, Any]:
    tokens = sum(len(o) for o in run.outputs)
    accept = acceptance_of(run.meta)
    return {
        "variant": run.variant.name,
        "tokens": tokens,
        "wall_s": round(run.wall_s, 3),
        "tokens_per_s": round(tokens / run.wall_s, 2) if run.wall_s > 0 else None,
        "acceptance_length": None if accept is None else round(accept, 4),
        "server_start_s": round(run.start_s, 1),
    }


# ----------------------------------------------------------------------------- server I/O


def _http_json(url: str, payload: dict[str, Any] | None, timeout: float) -> Any:
    import urllib.request

    data = None if payload is None else json.dumps(payload).encode()
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout) as response:
        body = response.read().decode()
    return json.loads(body) if body.strip() else None


def server_accept_length(port: int) -> float | None:
    """SGLang's lifetime average acceptance length (`/server_info`), the mean over its DP ranks;
    None when the server reports none (no speculation, or nothing verified yet)."""
    info = _http_json(f"http://127.0.0.1:{port}/server_info", None, timeout=30) or {}
    values = [float(state["avg_spec_accept_length"]) for state in info.get("internal_states") or []
              if isinstance(state, dict) and isinstance(state.get("avg_spec_accept_length"), (int, float))]
    return sum(values) / len(values) if values else None


SAMPLING = {"temperature": 0, "ignore_eos": True}  # every request makes exactly max_new_tokens


def drive_load(port: int, prompts: list[Prompt], concurrency: int, requests: int, max_new_tokens: int,
               timeout_s: float = 600) -> LoadLevel:
    """Keep `concurrency` requests in flight (T=0, prompts in turn) until `requests` finished."""
    sampling = {**SAMPLING, "max_new_tokens": max_new_tokens}
    lock = threading.Lock()
    in_flight = [0, 0]  # now, peak

    def one(index: int) -> dict[str, Any]:
        with lock:
            in_flight[0] += 1
            in_flight[1] = max(in_flight)
        try:
            payload = {**prompt_payload(prompts[index % len(prompts)]), "sampling_params": sampling}
            return _http_json(f"http://127.0.0.1:{port}/generate", payload, timeout=timeout_s)
        finally:
            with lock:
                in_flight[0] -= 1

    before = server_accept_length(port)
    began = time.monotonic()
    with ThreadPoolExecutor(max_workers=concurrency) as pool:
        replies = list(pool.map(one, range(requests)))
    wall_s = time.monotonic() - began
    tokens = accepted = rounds = 0
    for reply in replies:
        if not isinstance(reply, dict) or "output_ids" not in reply:
            raise RuntimeError(f"/generate reply has no output_ids (got {str(reply)[:120]})")
        tokens += len(reply["output_ids"])
        meta = reply.get("meta_info") or {}
        counts = acceptance.server_histogram(meta)
        if counts:  # tokens the verify rounds committed, as the offline loop counts them
            accepted += sum((k + 1) * c for k, c in enumerate(counts))
            rounds += acceptance.rounds_of(counts)
        elif isinstance(meta.get("spec_verify_ct"), int) and meta["spec_verify_ct"] > 0:  # no histogram: SGLang's own ratio
            accepted += int(meta.get("completion_tokens", len(reply["output_ids"])))
            rounds += meta["spec_verify_ct"]
    return LoadLevel(concurrency, requests, tokens, wall_s, accepted, rounds, before,
                     server_accept_length(port), in_flight[1])


def load_rows(runs: list[VariantRun]) -> list[dict[str, Any]]:
    """The `sglang_load` table: a row per variant and level, speedup over no speculation
    (the first run) at the same level."""
    base = {level.concurrency: level.tokens_per_s for level in runs[0].load}
    rows = []
    for run_ in runs:
        for level in run_.load:
            reference = base.get(level.concurrency)
            rows.append({
                "variant": run_.variant.name, "mode": run_.variant.mode.value, "budget": run_.variant.budget,
                "method": run_.variant.method, "block_size": run_.variant.block_size,
                "concurrency": level.concurrency, "requests": level.requests, "tokens": level.tokens,
                "wall_s": round(level.wall_s, 3),
                "tokens_per_s": None if level.tokens_per_s is None else round(level.tokens_per_s, 2),
                "acceptance_length": None if level.acceptance_length is None else round(level.acceptance_length, 4),
                "server_accept_before": level.server_accept_before, "server_accept_after": level.server_accept_after,
                "peak_in_flight": level.peak_in_flight,
                "speedup_vs_no_spec": (round(level.tokens_per_s / reference, 3)
                                       if reference and level.tokens_per_s else None),
            })
    return rows


def concurrency_levels(extra: dict[str, Any]) -> list[int]:
    return [int(c) for c in extra.get("sglang_concurrency", DEFAULT_CONCURRENCY)]


def run_variant(ctx: StageContext, variant: ServerVariant, models: dict[str, Any], prompts: list[Prompt],
                *, port: int, max_new_tokens: int, start_timeout_s: float, attention_backend: str,
                extra_args: list[str], levels: list[int] = (), requests_per_level: int | None = None,
                cpu: bool = False, token_ids: bool | None = None) -> VariantRun:
    """One server: started on `port` (which it must own), the prompts one at a time, the load
    levels, stopped. `prompts` may be token ids of text prompts (`token_ids` False: the server
    keeps its tokenizer)."""
    log_path = ctx.artifacts_dir / f"server-{variant.name}.log"
    env = {k: v for k, v in os.environ.items() if not k.startswith("DDTREE_")}
    env.update(variant.env())
    if cpu:
        from ddtree.sglang.cpu.environment import SERVER_ENV

        env.update(SERVER_ENV)
    if token_ids is None:
        token_ids = any(isinstance(p, list) for p in prompts)
    argv = server_argv(sys.executable, models, variant, port, attention_backend, extra_args, cpu=cpu,
                       token_ids=token_ids)
    ctx.log(f"{variant.name}: {' '.join(argv)}")
    run = VariantRun(variant)
    started = time.monotonic()
    process = launch(argv, env, log_path, port)
    try:
        wait_until_serving(process, port, start_timeout_s, model_path=str(models["target"]), log_path=log_path)
        run.start_s = time.monotonic() - started
        sampling = {**SAMPLING, "max_new_tokens": max_new_tokens}
        began = time.monotonic()
        for prompt in prompts:
            payload = {**prompt_payload(prompt), "sampling_params": sampling}
            if variant.mode is ServerMode.NO_SPEC:
                payload.update(return_logprob=True, top_logprobs_num=2)
            asked = time.monotonic()
            reply = _http_json(f"http://127.0.0.1:{port}/generate", payload, timeout=600)
            run.prompt_s.append(time.monotonic() - asked)
            if "output_ids" not in reply:
                raise RuntimeError(f"{variant.name}: /generate reply has no output_ids (keys {sorted(reply)})")
            run.outputs.append([int(t) for t in reply["output_ids"]])
            run.meta.append(reply.get("meta_info", {}))
        run.wall_s = time.monotonic() - began
        for level in levels:
            requests = requests_per_level or max(len(prompts), 2 * level)
            run.load.append(drive_load(port, prompts, level, requests, max_new_tokens))
            ctx.log(f"{variant.name} at {level} concurrent: {run.load[-1].tokens_per_s or 0:.1f} tokens/s")
    finally:
        stop_process_group(process)
    return run


def prompt_payload(prompt: Prompt) -> dict[str, Any]:
    return {"input_ids": prompt} if isinstance(prompt, list) else {"text": prompt}


def _prompt_line(line: str) -> Prompt:
    if not line.lstrip().startswith("{"):
        return line
    record = json.loads(line)
    return [int(t) for t in record["input_ids"]] if "input_ids" in record else record["prompt"]


def load_prompts(models: dict[str, Any]) -> list[Prompt]:
    """Lines of the `prompts` file: plain text, {"prompt": text} or {"input_ids": [...]}."""
    path = models.get("prompts")
    if not path:
        return list(SHIPPED_PROMPTS)
    text = Path(os.path.expanduser(path)).read_text(encoding="utf-8")
    return [_prompt_line(line) for line in text.splitlines() if line.strip()]


def dataset_name(models: dict[str, Any]) -> str:
    """The rows' `dataset`: the prompts file's stem (as decode-bench names it), else the shipped set."""
    path = models.get("prompts")
    return Path(os.path.expanduser(path)).stem if path else SHIPPED_DATASET


def serves_on_cpu(ctx: StageContext) -> bool:
    """No GPU, but this environment was prepared as a CPU test server (docs/sglang-plugin.md)."""
    from ddtree.sglang.cpu.environment import prepared

    return ctx.device != "cuda" and prepared()


def missing_prerequisite(ctx: StageContext) -> str | None:
    if ctx.device != "cuda" and not serves_on_cpu(ctx):
        return ("no GPU on this host (torch sees no CUDA device), and this Python environment is not "
                "prepared as a CPU test server (scripts/sglang_cpu_env.sh; docs/sglang-plugin.md)")
    if not ctx.host.get("models"):
        where = f"{ctx.host.get('inventory') or 'the inventory'}: hosts.{ctx.host.get('name', '?')}.models"
        return f"no `models:` (target, drafter) configured for this host ({where})"
    import importlib.util

    if importlib.util.find_spec("sglang") is None:
        return f"sglang is not installed in {sys.executable}"
    return None


# ----------------------------------------------------------------------------- against the offline loop


@dataclass(frozen=True)
class OfflineSettings:
    enabled: bool
    margin: float | None  # logits (acceptance.NearTie); None: measured (acceptance.auto_margin)
    tolerance: float  # tokens per round: a variant's mean against the offline one

    @classmethod
    def from_extra(cls, extra: dict[str, Any]) -> "OfflineSettings":
        margin = extra.get("offline_near_tie_margin")
        return cls(bool(extra.get("sglang_offline_check", True)), None if margin is None else float(margin),
                   float(extra.get("acceptance_tolerance", acceptance.DEFAULT_ACCEPTANCE_TOLERANCE)))


def server_top2(meta: dict[str, Any]) -> list[tuple[int, int, float] | None]:
    """Per output position of a no-speculation reply: its top-2 token ids and their log-prob gap."""
    found = []
    for row in meta.get("output_top_logprobs") or []:
        if not row or len(row) < 2:
            found.append(None)
            continue
        found.append((int(row[0][1]), int(row[1][1]), float(row[0][0]) - float(row[1][0])))
    return found


def check_against_offline(ctx: StageContext, models: dict[str, Any], prompt_ids: list[list[int]],
                          runs: list[VariantRun], max_new_tokens: int, settings: OfflineSettings,
                          device: str) -> tuple[dict[str, acceptance.VariantCheck], dict[str, Any]]:
    """The offline loop on every speculative variant's method, budget and block; per variant
    the per-request checks (`ddtree_ops.hostside.acceptance`); and how far this host's server
    and offline target were measured to differ (MarginNoise.summary), against the margin."""
    from ddtree_ops.hostside.offline_acceptance import OfflineLoop, OfflineMethod

    speculative = [r for r in runs if r.variant.mode is not ServerMode.NO_SPEC]
    methods = [OfflineMethod(r.variant.name, r.variant.budget, r.variant.block_size) for r in speculative]
    loop = OfflineLoop(models, device)
    try:  # each variant's offline run follows that server's own tokens (DecodeConfig.forced_tokens)
        offline = loop.decode(methods, prompt_ids, max_new_tokens, ctx.log,
                              texts={r.variant.name: r.outputs for r in speculative})
        reference = runs[0]
        noise = loop.margin_noise(prompt_ids, reference.outputs, [server_top2(m) for m in reference.meta]).summary()
    finally:
        loop.close()
    margin = settings.margin if settings.margin is not None else acceptance.auto_margin(noise["max"])
    noise["near_tie_margin"] = margin
    ctx.log(f"server vs offline target, top-2 logit gap differences: {noise}")
    checks = {}
    for run_ in speculative:
        requests = []
        for index, (tokens, counts) in enumerate(zip(run_.outputs, run_.histograms())):
            requests.append(acceptance.check_request(index, tokens, counts or [], offline[run_.variant.name][index],
                                                     margin))
        checks[run_.variant.name] = acceptance.VariantCheck(run_.variant.name, requests, settings.tolerance)
    return checks, noise


def run(ctx: StageContext) -> StageResult:
    reason = missing_prerequisite(ctx)
    if reason:
        return StageResult.skipped(reason)
    from importlib.metadata import entry_points

    if not any(ep.name == "ddtree" for ep in entry_points(group="sglang.srt.plugins")):
        return StageResult.failed(f"the DDTree plugin is not deployed in {sys.executable} (run `ddtree-ops deploy`)")
    from ddtree.sglang.config import ENV_SGLANG_PLUGINS, plugins_filter_problem

    filtered_out = plugins_filter_problem(os.environ.get(ENV_SGLANG_PLUGINS))
    if filtered_out:  # the servers would skip the plugin: the DDTree variants would be plain DFlash
        return StageResult.failed(filtered_out)
    models = dict(ctx.host["models"])
    extra = ctx.options.extra
    budgets = select_budgets(models, ctx.options.budgets, extra)
    if not budgets:
        return StageResult.failed(f"no budget with budget + 1 >= block size {models.get('block_size', 16)} selected")
    prompts = load_prompts(models)
    near_tie = float(extra.get("near_tie_gap", DEFAULT_NEAR_TIE_GAP))
    offline = OfflineSettings.from_extra(extra)
    max_new_tokens = int(extra.get("sglang_max_new_tokens", 128))
    cpu = serves_on_cpu(ctx)
    device = "cpu" if cpu else "cuda"
    if cpu:
        ctx.log("no GPU: serving with SGLang's CPU engine (ddtree.sglang.cpu); speeds are CPU numbers")
    token_ids = any(isinstance(p, list) for p in prompts)
    sent: list[Prompt] = prompts
    if offline.enabled:  # both sides must start from the same ids: the server gets ours
        from ddtree_ops.hostside.offline_acceptance import encode_text_prompts

        sent = encode_text_prompts(models, prompts)
    block = int(models["block_size"]) if models.get("block_size") else None
    base_port = int(extra.get("sglang_port", 31000))
    runs: list[VariantRun] = []
    try:
        for offset, variant in enumerate(plan_variants(budgets, block)):
            runs.append(run_variant(
                ctx, variant, models, sent, port=base_port + offset, max_new_tokens=max_new_tokens,
                start_timeout_s=float(extra.get("sglang_start_timeout_s", 900)),
                attention_backend=str(extra.get("sglang_attention_backend", "flashinfer")),
                extra_args=[str(a) for a in extra.get("sglang_extra_args", [])],
                levels=concurrency_levels(extra), requests_per_level=extra.get("sglang_requests_per_level"),
                cpu=cpu, token_ids=token_ids,
            ))
    except (PortTakenError, NotOurServerError) as err:
        return StageResult.failed(str(err))
    reference = runs[0]
    table, failures = [], []
    model_name = str(models["target"]).rstrip("/").rsplit("/", 1)[-1]
    for run_ in runs:
        row = {**summarize(run_), "device": device, "method": run_.variant.method, "budget": run_.variant.budget,
               "block_size": run_.variant.block_size, "dataset": dataset_name(models), "model": model_name,
               "temperature": 0.0, "max_new_tokens": max_new_tokens}
        divergences = compare_runs(reference, run_) if run_ is not reference else []
        hard = [d for d in divergences if not d.near_tie(near_tie)]
        row.update(divergent_prompts=len(divergences), near_ties=len(divergences) - len(hard))
        table.append(row)
        for d in hard:
            failures.append(f"{run_.variant.name}: prompt {d.prompt} differs at token {d.position} "
                            f"(expected {d.expected}, got {d.got}, top-2 gap {d.gap})")
        ctx.emit_metric(f"{run_.variant.name}.tokens_per_s", row["tokens_per_s"])
        ctx.emit_metric(f"{run_.variant.name}.acceptance_length", row["acceptance_length"])
    tables: dict[str, Any] = {}
    notes = []
    if offline.enabled:
        checks, noise = check_against_offline(ctx, models, sent, runs, max_new_tokens, offline, device)
        tables[ACCEPTANCE_TABLE] = [r.row(name) for name, check in checks.items() for r in check.requests]
        table[0]["margin_noise"] = noise
        ctx.emit_metric("offline_margin_noise", noise)
        if noise["max"] is not None and noise["max"] >= noise["near_tie_margin"]:
            notes.append(f"the server's and the offline target's top-2 gaps were seen to differ by up to "
                         f"{noise['max']:g}, not below offline_near_tie_margin {noise['near_tie_margin']:g}: raise it")
        for row in table:
            check = checks.get(row["variant"])
            if check is None:
                continue
            row.update(check.summary())
            failures += check.problems
            for key in ("offline_acceptance_length", "acceptance_histogram", "offline_acceptance_histogram"):
                ctx.emit_metric(f"{row['variant']}.{key}", row[key])
    timings = [timing_row(f"{r.variant.name}.tokens_per_s", [len(out) / sec for out, sec in
                                                           zip(r.outputs, r.prompt_s) if sec > 0], "tok/s", 2)
               for r in runs if any(sec > 0 for sec in r.prompt_s)]
    base = table[0]["tokens_per_s"] or 0
    for row in table:
        row["speedup_vs_no_spec"] = round(row["tokens_per_s"] / base, 3) if base and row["tokens_per_s"] else None
    tables = {"sglang_e2e": table, "sglang_load": [{**row, "device": device} for row in load_rows(runs)],
              **tables, TIMINGS_TABLE: timings}
    if failures:
        more = f" (and {len(failures) - 3} more)" if len(failures) > 3 else ""
        return StageResult.failed("; ".join(failures[:3] + notes) + more, tables=tables)
    best = max(table[2:], key=lambda r: r["tokens_per_s"] or 0)
    where = " (CPU numbers: SGLang's CPU engine, not GPU speed)" if cpu else ""
    held = "; every request's acceptance as the offline loop's (near-ties allowed)" if offline.enabled else ""
    return StageResult.passed(
        f"{len(prompts)} prompts identical to no speculation (near-ties allowed){held}; best {best['variant']}: "
        f"{best['speedup_vs_no_spec']}x, acceptance length {best['acceptance_length']}{where}"
        + "".join(f"; {note}" for note in notes),
        tables=tables,
    )
