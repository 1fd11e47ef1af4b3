"""DDTreeWorkerV2: SGLang 0.5.23's DFlashWorkerV2 with tree drafting and tree verification.

Imported only by hook H2, inside SGLang scheduler processes on GPU hosts (it imports the
heavy speculative modules at module level). Written against the 0.5.23 sources pinned in
manifests/sglang-0.5.23.json; it has NOT run on a GPU yet: docs/dev/sglang-ddtree-roadmap.md lists what
is verified and how.

One decode round per batch (bs requests, drafter block size B, budget, N = budget + 1):
1. draft  - the DFlash drafter runs one block of width B (bonus + B-1 mask tokens) under a
            scoped spec override (speculative_num_draft_tokens = B); its hidden states at
            positions 1..B-1 go through this rank's slice of the target's lm_head, which
            keeps only the per-position top-K raw logits and the logsumexp (ddtree.topk);
            with TP > 1 every rank all-gathers those over the TP group and merges them
            into the global top-K log-probs [bs, B-1, K] (K = DDTREE_TOPK <= budget);
2. trees  - the core builds one best-first tree per request on the device
            (ddtree.batched.build_trees_from_top_log_probs) and packs SGLang's verify inputs
            (ddtree.verify: retrieve_index / next_token / next_sibling, FULL mask);
3. verify - the target runs TARGET_VERIFY over the N-wide window with the tree mask;
            SGLang's eagle_sample walks the tree (greedy or target-only sampling); with
            TP > 1 rank 0's decision is broadcast (SpecTpSync, DFlash's own sites);
4. commit - SGLang's move_accept_tokens_to_target_kvcache moves the accepted rows' KV to the
            front of the window; the draft KV of the committed rows is rewritten from the
            target hidden states of the accepted indices (as DFlash does for its prefix);
            the bonus token is carried to the next round; new_seq_lens is published.
Prefill (extend) and idle batches are DFlash's own path, unchanged.
"""
from __future__ import annotations

import contextlib
import logging
import time
from typing import Any, Iterator, Optional

import torch

from sglang.kernels.ops.speculative.cache_locs import assign_extend_cache_locs_func
from sglang.srt.layers.logprob_processor import compute_spec_logprobs
from sglang.srt.layers.sampler import apply_custom_logit_processor
from sglang.srt.lora.layers import unwrap_lora_layer
from sglang.srt.managers.scheduler import GenerationBatchResult
from sglang.srt.model_executor.forward_batch_info import (
    CaptureHiddenMode,
    ForwardBatch,
    ForwardMode,
    enable_num_token_non_padded,
)
from sglang.srt.model_executor.model_runner import SamplingPrewarmResult
from sglang.srt.runtime_context import get_exec, get_observability, get_parallel, get_schedule, get_serving, get_spec
from sglang.srt.speculative.dflash_info import DFlashVerifyInput
from sglang.srt.speculative.dflash_info_v2 import DFlashDraftInputV2
from sglang.srt.speculative.dflash_utils import resolve_dflash_verify_mask_policy
from sglang.srt.speculative.dflash_worker_v2 import (
    DFlashWorkerV2,
    _is_all_greedy,
    _resolve_dflash_embedding_module,
)
from sglang.srt.speculative.eagle_utils import (  # the sampling ops eagle_sample itself uses
    eagle_sample,
    sampling_softmax,
    top_k_renorm_prob,
    top_p_renorm_prob,
)
from sglang.srt.speculative.spec_info import SpeculativeAlgorithm
from sglang.srt.speculative.spec_sampling_mask import SpeculativeSamplingMaskCapture
from sglang.srt.speculative.spec_tp_sync import SpecTpSyncSite
from sglang.srt.speculative.spec_utils import (
    GrammarTree,
    build_grammar_vocab_mask,
    draft_tp_context,
    move_accept_tokens_to_target_kvcache,
)

from ddtree.sglang.errors import HookSelfCheckError, UnsupportedSetupError
from ddtree.sglang.hooks import active_config, drafter_scope
from ddtree.sglang.prometheus_export import PrometheusExport
from ddtree.sglang.round_metrics import RoundMetrics, trees_branch
from ddtree.sglang.support import (
    check_attention_backend_class,
    check_tensor_parallel_head,
    check_verify_buffers_fit,
    verify_graph_buffers,
)
from ddtree.sglang.tree_round import (
    HeadShard,
    TreeVerifyView,
    accepted_rows_first,
    committed_tokens_and_bonus,
    draft_kv_rewrite,
    head_vocab_segments,
    local_draft_top_k,
    mask_prefix_bound,
    pack_for_gather,
    pack_round_inputs,
    pack_trees,
    trees_from_top_k,
    unpack_gathered,
    unpack_trees,
)
from ddtree.topk import ShardTopK, merge_top_k

logger = logging.getLogger("ddtree.sglang")


class DDTreeWorkerV2(DFlashWorkerV2):
    """DFLASH with DDTree: draft at the drafter's block size B, verify a tree of width N."""

    def __init__(self, server_args: Any, gpu_id: int, nccl_port: int, target_worker: Any):
        self.ddtree = active_config()
        if self.ddtree.draft_block_size is None:
            raise HookSelfCheckError(
                "DDTree: hook H1 (sglang.srt.arg_groups.speculative_hook._handle_dflash) did not "
                "run before the worker was built: DDTREE_DRAFT_BLOCK_SIZE is unset"
            )
        self.verify_width = int(get_spec().speculative_num_draft_tokens)  # N, set by H1
        if self.verify_width != self.ddtree.verify_width:
            raise HookSelfCheckError(
                f"DDTree: speculative_num_draft_tokens is {self.verify_width}, H1 set "
                f"{self.ddtree.verify_width} (DDTREE_BUDGET={self.ddtree.budget})"
            )
        self.draft_block = int(self.ddtree.draft_block_size)  # B
        self._refuse_unsupported_before_init()
        with self._draft_width():
            # DFlash sizes the draft runner, its buffers and block size from the spec bag.
            super().__init__(server_args, gpu_id, nccl_port, target_worker)
        if int(self.block_size) != self.draft_block:
            raise HookSelfCheckError(f"DDTree: DFlash chose block size {self.block_size}, expected {self.draft_block}")
        self.speculative_num_draft_tokens = self.verify_width
        self._context_len = int(self.target_worker.model_runner.model_config.context_len)
        self._refuse_unsupported_after_init()
        self._metrics = RoundMetrics(self.ddtree.metrics_interval, self.device, self._log_metrics,
                                     max_acceptance=self.draft_block)
        # With --enable-metrics, the same snapshots go to SGLang's /metrics (rank 0 only, as the log line).
        self._prometheus = (PrometheusExport(get_serving().served_model_name, self.ddtree.budget, self.draft_block)
                            if get_parallel().tp_rank == 0 and get_observability().enable_metrics else None)
        if get_parallel().tp_rank == 0:
            logger.info(
                "DDTree worker ready: block size %d, budget %d, verify width %d",
                self.draft_block, self.ddtree.budget, self.verify_width,
            )

    # ------------------------------------------------------------------ setup

    @contextlib.contextmanager
    def _draft_width(self) -> Iterator[None]:
        """Scope in which the spec bag says B: everything that belongs to the drafter."""
        with drafter_scope(), get_spec().override(speculative_num_draft_tokens=self.draft_block):
            yield

    def _refuse_unsupported_before_init(self) -> None:
        spec = get_spec()
        reasons = []
        if int(get_schedule().page_size) != 1:
            reasons.append(f"page size {get_schedule().page_size} (only 1)")
        if get_parallel().attn_dp_enabled:
            reasons.append("DP attention")
        if spec.speculative_draft_window_size is not None:
            reasons.append("--speculative-draft-window-size (compact draft cache)")
        if spec.speculative_use_rejection_sampling or spec.speculative_use_block_verification:
            reasons.append("rejection sampling / block verification (target-only tree sampling only)")
        if self.verify_width < self.draft_block:
            reasons.append(f"verify width {self.verify_width} < drafter block size {self.draft_block}")
        if reasons:
            raise UnsupportedSetupError("DDTree does not support: " + "; ".join(reasons))

    def _refuse_unsupported_after_init(self) -> None:
        reasons = []
        if self.selector is not None or self.lilicorr is not None or self._is_domino:
            reasons.append("selector / LiLiCorr / Domino drafters (DDTree needs the drafter's logits)")
        lm_head = unwrap_lora_layer(getattr(self.target_worker.model_runner.model, "lm_head", None))
        if lm_head is None or not hasattr(lm_head, "weight") or lm_head.weight.dtype not in (
            torch.float16, torch.bfloat16, torch.float32
        ):
            reasons.append("a target lm_head without a dense weight (quantized heads)")
        if reasons:
            raise UnsupportedSetupError("DDTree does not support: " + "; ".join(reasons))
        # The drafter borrows the target's (vocab-parallel) head: read its layout once.
        shard = getattr(lm_head, "shard_indices", None)
        check_tensor_parallel_head(tp_size=int(get_parallel().tp_group.world_size), vocab_parallel=shard is not None)
        self._head_shard = None if shard is None else HeadShard(*(int(getattr(shard, f)) for f in HeadShard._fields))
        self._head_segments = head_vocab_segments(self._head_shard, int(lm_head.weight.shape[0]))

    def _refuse_unsupported_target_verify(self) -> None:
        runner = self.target_worker.model_runner
        # The target's verify backend, resolved as SGLang resolves it for the mask policy: H3
        # checks it at graph capture; this also covers --disable-cuda-graph.
        backend_name, _ = resolve_dflash_verify_mask_policy(runner.attn_backend)
        check_attention_backend_class(backend_name)
        decode_graphs = get_exec().graph.cuda_graph_config.decode
        if decode_graphs.backend == "disabled" or not decode_graphs.bs or torch.device(self.device).type != "cuda":
            return
        # get_batch_sizes_to_capture: the configured sizes, capped by the request pool.
        max_bs = min(max(decode_graphs.bs), int(runner.req_to_token_pool.size))
        buffers = verify_graph_buffers(
            backend_class=backend_name, max_bs=max_bs, width=self.verify_width,
            vocab_size=int(runner.model_config.vocab_size), context_len=self._context_len,
        )
        free_bytes, _total = torch.cuda.mem_get_info(self.device)
        check_verify_buffers_fit(
            buffers, free_bytes=free_bytes, budget=self.ddtree.budget, max_bs=max_bs, context_len=self._context_len
        )

    def _maybe_build_draft_sampler(self):
        # DFlash folds an argmax head into the draft CUDA graph; DDTree needs per-position
        # top-K log-probs (_draft_top_k), computed eagerly after the draft forward.
        return None

    def prewarm_sampling(self) -> SamplingPrewarmResult:
        """The sampled verify's memory, measured at the width it runs at. DFlash rehearses its
        chain sampler on [bs*B, V]; DDTree's eagle_sample target-only path holds fp32
        [bs*N, V] probabilities (softmax, top-k renorm, top-p renorm, zeros_like draft probs,
        eagle_utils.py:720-750), so the scheduler's headroom and KV sizing need them at N."""
        if torch.device(self.device).type != "cuda":
            return self.model_runner.prewarm_sampling()
        width = self.verify_width  # N, not DFlash's block size B
        vocab_size = int(self.target_worker.model_runner.model_config.vocab_size)
        bs = self._prewarm_batch_size(width)  # the largest batch an N-wide verify can see
        rows = bs * width
        logits = torch.zeros((rows, vocab_size), dtype=torch.float32, device=self.device)  # [bs*N, V]
        temperatures = torch.ones((rows, 1), dtype=torch.float32, device=self.device)
        top_ks = torch.full((rows,), vocab_size // 2, dtype=torch.int32, device=self.device)
        top_ps = torch.full((rows,), 0.95, dtype=torch.float32, device=self.device)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base_bytes = torch.cuda.memory_stats()["allocated_bytes.all.current"]
        probs = sampling_softmax(logits, temperatures=temperatures)
        probs = top_k_renorm_prob(probs, top_ks)
        probs = top_p_renorm_prob(probs, top_ps)
        draft_probs = torch.zeros_like(probs)
        torch.cuda.synchronize()
        peak_bytes = torch.cuda.memory_stats()["allocated_bytes.all.peak"] - base_bytes
        del probs, draft_probs
        input_bytes = logits.numel() * logits.element_size()
        result = SamplingPrewarmResult(sampling_input_bytes=input_bytes, sampling_headroom_bytes=peak_bytes + input_bytes)
        self.model_runner.sampling_prewarm_result = result
        if get_parallel().tp_rank == 0:
            logger.info("DDTree sampling pre-warm at verify width %d: bs=%d peak=%d B headroom=%d B",
                        width, bs, peak_bytes, result.sampling_headroom_bytes)
        return result

    def alloc_memory_pool(self, *args: Any, **kwargs: Any):
        # The scheduler calls this after building the worker (scheduler.py:1103-1110), outside
        # __init__: the drafter's pools are sized with the bag at B, as DFlash sizes them.
        with self._draft_width():
            return super().alloc_memory_pool(*args, **kwargs)

    def init_attention_backends(self):
        # The scheduler calls this after the target's backends and every KV pool exist and
        # before any CUDA graph is captured (scheduler.py:1128-1146): the last moment to refuse.
        self._refuse_unsupported_target_verify()
        with self._draft_width():
            super().init_attention_backends()
        if self._need_mamba_verify_commit:
            raise UnsupportedSetupError("DDTree does not support hybrid (mamba) targets")

    def init_cuda_graphs(self):
        with self._draft_width():
            super().init_cuda_graphs()

    # ------------------------------------------------------------------ one round

    def forward_batch_generation(self, batch, on_publish=None, grammar_barrier=None, pp_proxy_tensors=None):
        if batch.forward_mode.is_extend() or batch.is_extend_in_batch or batch.forward_mode.is_idle():
            return super().forward_batch_generation(
                batch, on_publish=on_publish, grammar_barrier=grammar_barrier, pp_proxy_tensors=pp_proxy_tensors
            )
        if batch.spec_info is None or not isinstance(batch.spec_info, DFlashDraftInputV2):
            raise RuntimeError(
                f"DDTree expected DFlashDraftInputV2 state on the running batch, got {type(batch.spec_info).__name__}"
            )
        self._validate_phase1_sampling_support(batch)
        draft_input = batch.spec_info
        batch.seq_lens.record_stream(torch.get_device_module(self.device).current_stream())
        bs = len(batch.seq_lens)
        width = self.verify_width
        prefix_lens = batch.seq_lens  # [bs] committed tokens; the root sits at this position
        req_to_token = self.model_runner.req_to_token_pool.req_to_token

        # The N-wide verify window (prepare_for_decode reserved 2N slots per request).
        window_locs = assign_extend_cache_locs_func(
            req_pool_indices=batch.req_pool_indices, req_to_token=req_to_token,
            start_offset=prefix_lens, end_offset=prefix_lens + width,
            batch_size=bs, draft_token_num=width, device=self.device,
        )  # [bs*N]
        # The round's window, planned once for the draft block (its first B columns), the
        # verify and the draft-KV rewrite, as DFlash plans its window (dflash_worker_v2.py:2586-2598).
        plan = self.target_worker.model_runner.kv_index_translator.plan(
            req_pool_indices=batch.req_pool_indices, seq_lens=prefix_lens,
            seq_lens_cpu=batch.seq_lens_cpu if batch.seq_lens_cpu is not None else draft_input.nxt_kv_lens_cpu,
            write_virtual=window_locs, read_extent=width,
        )
        draft_hidden = self._draft_block_hidden(batch, draft_input, window_locs, plan, bs)  # [bs, B, H]

        timer = _EventTimer(self.device)
        with draft_tp_context(self.draft_parallel_layout):  # as DFlash's greedy head does
            top = self._draft_top_k(draft_hidden)  # [bs, B-1, K] global top-K + logsumexp
        trees = self._rank0_trees(trees_from_top_k(top, self.ddtree.budget))
        prefix_bound = mask_prefix_bound(draft_input.nxt_kv_lens_sum, bs, self._context_len)
        inputs, custom_mask = pack_round_inputs(trees, draft_input.bonus_tokens, prefix_lens, width, prefix_bound)
        build_ms = timer.stop()

        grammar_tree = None
        if batch.has_grammar:  # async copy of the links, started before the verify (as EAGLE)
            grammar_tree = GrammarTree.from_device(
                inputs.retrieve_next_token, inputs.retrieve_next_sibling, inputs.input_ids
            )

        logits_output, can_run_cuda_graph, target_out = self._target_verify(
            batch, draft_input, inputs, custom_mask, window_locs, plan
        )
        grammar_mask = None
        if grammar_tree is not None:
            grammar_mask = build_grammar_vocab_mask(
                reqs=batch.reqs, tree=grammar_tree, sampling_info=batch.sampling_info,
                device=logits_output.next_token_logits.device, barrier=grammar_barrier,
            )
        sampling_info = batch.sampling_info
        if sampling_info is not None and sampling_info.has_custom_logit_processor:
            # eagle_sample applies penalties, bias and grammar but not these; DFlash's own
            # verify applies them to each of a request's rows first, and so do we (N rows).
            apply_custom_logit_processor(logits_output.next_token_logits, sampling_info, num_tokens_in_batch=width)
        view = TreeVerifyView.from_inputs(inputs, custom_mask, accept_width=self.draft_block)
        predict, accept_lens, accept_index = eagle_sample(
            view, batch, logits_output, grammar_mask, watermark_state=self.model_runner.watermark_state,
        )  # [bs*N] int32, [bs] int32 (root included), [bs, B] int32 flat rows
        # TP > 1: every rank must commit rank 0's path. eagle_sample's sampled path broadcasts
        # its decisions itself (eagle_utils.py:797-805); its CUDA greedy path does not.
        if _is_all_greedy(batch.sampling_info):
            for decision in (predict, accept_lens, accept_index):
                self._tp_sync.sync(SpecTpSyncSite.DFLASH_ACCEPT_GREEDY, decision)
        out_tokens, bonus = committed_tokens_and_bonus(predict, accept_index, accept_lens)  # [bs, B], [bs]
        new_seq_lens = prefix_lens + accept_lens.to(prefix_lens.dtype)
        self._capture_sampling_masks(batch, draft_input, logits_output, accept_index, out_tokens, accept_lens)

        # Accepted rows' target KV to the window front (accept_lens - 1 = drafts only).
        batch.out_cache_loc = window_locs
        move_accept_tokens_to_target_kvcache(
            batch, accept_index, accept_lens - 1, self.target_worker.model_runner.token_to_kv_pool_allocator
        )
        if batch.return_logprob:
            compute_spec_logprobs(batch, logits_output, predict, accept_index=accept_index)
        if on_publish is not None:
            on_publish(new_seq_lens)

        # Draft KV of the committed rows, from the target hidden states of the accepted indices.
        hidden = logits_output.hidden_states
        if hidden is None:
            raise RuntimeError("DDTree verify requires target hidden states, but got None")
        # Graph replay may append padding rows: only the bs*N real rows are ours.
        rewrite = draft_kv_rewrite(
            hidden[: bs * width], accept_index, self._draft_write_ids(plan), prefix_lens, width
        )  # B rows per request
        self._append_target_hidden_to_draft_kv_by_loc(
            target_hidden=rewrite.target_hidden,
            cache_loc=rewrite.cache_loc,
            cache_loc_2d=rewrite.cache_loc_2d,
            positions=rewrite.positions,
            commit_lens=accept_lens.to(torch.int32),
        )
        logits_output.hidden_states = None
        self._metrics.record(accept_lens, inputs.tree_sizes, build_ms, branching=trees_branch(trees))

        return GenerationBatchResult(
            logits_output=logits_output,
            next_token_ids=out_tokens.reshape(-1),
            accept_lens=accept_lens.to(torch.int32),
            can_run_cuda_graph=can_run_cuda_graph,
            next_draft_input=self._make_next_draft_input_decode(bonus_tokens=bonus, new_seq_lens=new_seq_lens),
            speculative_num_draft_tokens=width,
            speculative_output_stride=self.draft_block,  # out_tokens is [bs, B]
            new_seq_lens=new_seq_lens,
            routed_experts_output=target_out.routed_experts_output,
            indexer_topk_output=target_out.indexer_topk_output,
        )

    def _capture_sampling_masks(self, batch, draft_input, logits_output, accept_index, out_tokens, accept_lens) -> None:
        """Requests that ask for sampling masks get them, as DFlash gives them
        (dflash_worker_v2.py:2938-2949): SGLang's capture builds the target's policy per verify
        row; the committed token j of request b came from row accept_index[b, j], so those
        rows are the ones kept (a chain keeps rows 0..B-1 in order)."""
        bs, width = out_tokens.shape[0], self.verify_width
        capture = SpeculativeSamplingMaskCapture.from_logits(
            batch.sampling_info, next_token_logits=logits_output.next_token_logits,
            draft_input=draft_input, draft_token_num=width, bs=bs,
        )
        if capture is None:
            return
        if capture.target_probs is not None:  # [bs, N, V] -> [bs, B, V] along the accepted path
            vocab = capture.target_probs.shape[-1]
            capture.target_probs = accepted_rows_first(
                capture.target_probs.reshape(bs * width, vocab), accept_index, width
            ).view(bs, -1, vocab)
        logits_output.sampling_mask_output = capture.build_output(out_tokens=out_tokens, commit_lens=accept_lens)

    def _draft_top_k(self, draft_hidden: torch.Tensor) -> ShardTopK:
        """[bs, B-1, K] global top-K raw logits + logsumexp of the draft positions. Each rank
        scores only its lm_head rows; with TP > 1 the per-rank top-K and logsumexp are
        all-gathered (two collectives, no host sync) and merged."""
        lm_head = unwrap_lora_layer(self.target_worker.model_runner.model.lm_head)
        k = self.ddtree.topk
        local = local_draft_top_k(draft_hidden, lm_head.weight, self._head_segments, k)
        tp_group = get_parallel().tp_group
        world = int(tp_group.world_size)
        if world == 1:
            return local
        floats, ids = pack_for_gather(local)  # [bs, D, K+1] float32, [bs, D, K] int64
        gathered = unpack_gathered(tp_group.all_gather(floats, dim=0), tp_group.all_gather(ids, dim=0), world)
        return merge_top_k(gathered, k)

    def _rank0_trees(self, trees):
        """TP > 1: every rank verifies rank 0's trees. Ranks build them from identical gathered
        top-K, but a tie order in topk/sort or a different GPU could still diverge, and ranks
        verifying different tokens would silently corrupt the sharded forward and the KV.
        One broadcast of [bs, 4*budget + 2] int64 per round (SGLang's eagle_sample broadcasts
        only its decisions, eagle_utils.py:797-805)."""
        tp_group = get_parallel().tp_group
        if int(tp_group.world_size) == 1:
            return trees
        packed = pack_trees(trees)  # [bs, 4*budget + 2] int64
        tp_group.broadcast(packed, src=0)
        return unpack_trees(packed, trees.budget, self.draft_block - 1)

    def _draft_block_hidden(self, batch, draft_input, window_locs, plan, bs: int) -> torch.Tensor:
        """Run the drafter over [bonus, mask x (B-1)] at positions prefix..prefix+B-1, writing
        its KV into the first B slots of the window. Returns hidden states [bs, B, H]."""
        block, width = self.draft_block, self.verify_width
        self._ensure_draft_block_buffers(bs)
        block_ids = self._draft_block_ids_buf[:bs]  # [bs, B] int64
        block_ids.fill_(int(self._mask_token_id))
        block_ids[:, 0].copy_(draft_input.bonus_tokens)
        positions_2d = self._draft_block_positions_buf[:bs]  # [bs, B] int64
        torch.add(batch.seq_lens.unsqueeze(1), self._block_pos_offsets, out=positions_2d)
        draft_locs = window_locs.view(bs, width)[:, :block].reshape(-1)  # [bs*B]

        target_model = self.target_worker.model_runner.model
        embed = unwrap_lora_layer(_resolve_dflash_embedding_module(self.draft_model, target_model))
        if self._full_embed_gpu is not None:
            noise = torch.nn.functional.embedding(block_ids, self._full_embed_gpu)
        else:
            noise = embed(block_ids)
        if self._noise_embed_scale != 1.0:
            noise = noise * self._noise_embed_scale

        seq_lens_cpu = self._draft_seq_lens_cpu_buf[:bs]
        if batch.seq_lens_cpu is not None:
            seq_lens_cpu.copy_(batch.seq_lens_cpu)
            seq_lens_cpu.add_(block)
        elif draft_input.nxt_kv_lens_cpu is not None:
            seq_lens_cpu.copy_(draft_input.nxt_kv_lens_cpu)
        else:
            for i, req in enumerate(batch.reqs):
                seq_lens_cpu[i] = req.kv.kv_allocated_len
        forward_batch = ForwardBatch(
            forward_mode=ForwardMode.TARGET_VERIFY,
            batch_size=bs,
            input_ids=block_ids.flatten(),
            req_pool_indices=batch.req_pool_indices,
            seq_lens=batch.seq_lens,
            out_cache_loc=draft_locs,
            seq_lens_sum=int(seq_lens_cpu.sum()),
            seq_lens_cpu=seq_lens_cpu,
            positions=positions_2d.reshape(-1),
            input_embeds=noise.view(-1, noise.shape[-1]),
            spec_algorithm=SpeculativeAlgorithm.DFLASH,
            spec_info=self._draft_block_spec_info,
            capture_hidden_mode=CaptureHiddenMode.NULL,
            num_token_non_padded=(
                torch.full((), bs * block, dtype=torch.int32, device=self.device)
                if enable_num_token_non_padded() else None
            ),
            global_num_token_non_padded_cpu=bs * block,
            can_run_decode_cuda_graph=batch.can_run_decode_cuda_graph,
        )
        plan.bind(forward_batch, self.draft_model_runner.kv_index_translator, cols=slice(0, block))
        # No spec-bag override here: the drafter's runners and graphs were built at B, and the
        # forward reads its width from spec_info (captured_req_width, num_tokens_per_req);
        # flipping the process-global bag every round would retrace torch.compile guards.
        with torch.inference_mode(), draft_tp_context(self.draft_parallel_layout):
            draft_out = self.draft_model_runner.forward(forward_batch)
        hidden = draft_out.logits_output.hidden_states
        if hidden is None:
            raise RuntimeError("DDTree: the DFlash drafter returned no hidden states")
        return hidden.view(bs, block, -1)

    def _target_verify(self, batch, draft_input, inputs, custom_mask, window_locs, plan):
        width = self.verify_width
        verify_input = DFlashVerifyInput(
            draft_token=inputs.draft_tokens(),
            positions=inputs.positions.reshape(-1),
            draft_token_num=width,
            custom_mask=custom_mask,
            capture_hidden_mode=CaptureHiddenMode.FULL,
            kv_loc_plan=plan,
        )
        batch.out_cache_loc = window_locs
        seq_lens_cpu_backup, seq_lens_sum_backup = batch.seq_lens_cpu, batch.seq_lens_sum
        if seq_lens_cpu_backup is not None:  # host bound for planning: prefix + the window
            batch.seq_lens_cpu = seq_lens_cpu_backup + width
            batch.seq_lens_sum = int(batch.seq_lens_cpu.sum())
        elif draft_input.nxt_kv_lens_cpu is not None:
            batch.seq_lens_cpu = draft_input.nxt_kv_lens_cpu
            batch.seq_lens_sum = int(draft_input.nxt_kv_lens_sum)
        verify_forward_batch, _ = verify_input.prepare_for_verify(batch, self.target_worker)
        batch.seq_lens_cpu, batch.seq_lens_sum = seq_lens_cpu_backup, seq_lens_sum_backup
        target_out = self.target_worker.forward_batch_generation(
            batch=None, forward_batch=verify_forward_batch, is_verify=True, skip_attn_backend_init=True,
        )
        logits_output = target_out.logits_output
        target_lp = self._target_logits_processor
        if target_lp is not None and target_lp.is_deferred_shard(logits_output.next_token_logits):
            logits_output.next_token_logits = target_lp.finish_deferred_gather(logits_output.next_token_logits)
        return logits_output, target_out.can_run_cuda_graph, target_out

    def _log_metrics(self, snapshot: Any) -> None:
        if get_parallel().tp_rank == 0:
            logger.info(snapshot.line())
            logger.info(snapshot.json_line())
            if self._prometheus is not None:
                self._prometheus.export(snapshot)


class _EventTimer:
    """Tree-build time from CUDA events, read only when the metrics are logged (no sync here)."""

    def __init__(self, device: Any):
        self.cuda = torch.device(device).type == "cuda"
        if self.cuda:
            self.start = torch.cuda.Event(enable_timing=True)
            self.end = torch.cuda.Event(enable_timing=True)
            self.start.record()
        else:
            self.t0 = time.perf_counter()

    def stop(self) -> Optional[Any]:
        if self.cuda:
            self.end.record()
            start, end = self.start, self.end
            return lambda: start.elapsed_time(end)
        elapsed = (time.perf_counter() - self.t0) * 1e3
        return lambda: elapsed
