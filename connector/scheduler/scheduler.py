"""Scheduler side: finds stored prefixes, plans loads and saves, reports per-request hit details."""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

from ..config import KVToolConfig, divergence_grid, lead_pointers
from ..data import BlockTransfer, KVToolMetadata, RequestLoad, RequestSave
from ..core.groups import NULL_BLOCK_ID, CacheGroup, GroupKind
from ..core.keys import Namespace
from .answers import plan_answer_save
from .promptsaves import PromptSaves
from ..store.breaker import CircuitBreaker
from ..calls import BoundedCalls
from ..counters import Counters, WarnOnce
from .lookups import POINTER_READ_SHARE, LookupBatcher, pointer_reader
from .lookupwait import LookupPacing
from ..core.prefix import plan_load, single_group
from ..core.profit import HitJudge
from ..core.ranks import on_every_rank, rank_components
from ..core.search import find_saved_objects, find_stored_prefixes
from ..store.store import KVStore, StoreError
from .requestlog import RequestLog
from .tracking import KeySpace, TrackedRequest

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

logger = logging.getLogger("vllm.kvtool")


class SchedulerSide:
    def __init__(
        self,
        config: KVToolConfig,
        namespace: Namespace,
        store: KVStore | None,
        *,
        loads_enabled: bool,
        saves_enabled: bool,
        answers_enabled: bool = False,
        lookup_calls: BoundedCalls | None = None,
        groups: tuple[CacheGroup, ...] | None = None,
        block_bytes: tuple[int, ...] = (),
        token_bytes: tuple[int, ...] = (),
        breaker: CircuitBreaker | None = None,
        mm_named_by_content: bool = True,  # ``tracking.KeySpace``
    ):
        self._config = config
        self._namespace = namespace.key_component()
        self._block_size = namespace.block_size
        self._groups = groups or single_group(namespace.block_size)
        self._grid = divergence_grid(config, namespace.block_size)
        self._store = store
        self._loads_enabled = loads_enabled and store is not None
        self._saves_enabled = saves_enabled and store is not None
        self._answers_enabled = answers_enabled and store is not None
        self._has_state_group = any(g.kind is GroupKind.STATE for g in self._groups)
        self._pending_saves: list[RequestSave] = []  # answer saves, sent with the next step's metadata
        self._holding: set[str] = set()  # finished requests whose blocks an answer save holds
        lead = lead_pointers(config, self._block_size) and not self._has_state_group  # a state takes no extension
        self._space = KeySpace(
            self._block_size, config.hash_unit, self._namespace, self._groups, self._grid, lead, mm_named_by_content
        )
        self._tracked: dict[str, TrackedRequest] = {}
        self._ranks = rank_components(namespace)  # every TP rank's namespace, rank 0 (this side's) first
        self._pending_loads: list[RequestLoad] = []
        self._warn_once = WarnOnce(logger)
        self.stats = Counters()
        self._lookups = (
            LookupBatcher(
                # With tensor parallelism a prefix is stored only where every rank's worker holds it.
                on_every_rank(store.exists, self._ranks),
                config.lookup_timeout_s,
                calls=lookup_calls,
                read=pointer_reader(store, config.lookup_timeout_s * POINTER_READ_SHARE, self._block_size),
                extend_min_tokens=config.extend_min_tokens,
                find=find_stored_prefixes if self._loads_enabled else find_saved_objects,
                on_late=lambda why, store_s: self._pacing.late(why, store_s),
            )
            if store is not None
            else None
        )
        self.request_log = RequestLog(config.request_log, self.stats) if config.request_log else None
        self._step = 0  # scheduler steps built so far (the request timelines count in them)
        self._judge = HitJudge(block_bytes, config.skip_unprofitable_loads, token_bytes)  # do hits pay?
        # How long lookups wait, and what a late one says of the store.
        self._pacing = LookupPacing(
            self._judge.model, breaker, config.lookup_timeout_s, stats=self.stats, slow_call_s=config.slow_call_ms / 1e3
        )

    # -- lookup -------------------------------------------------------------------------------------

    def _track(self, request: Request) -> TrackedRequest:
        tracked = self._tracked.get(request.request_id)
        if tracked is None:
            tracked = TrackedRequest.start(request, self._space, time.monotonic(), self._step)
            self._tracked[request.request_id] = tracked
            self._count_unhashable(tracked)
        return self._refreshed(tracked)

    def _live(self, req_id: str) -> TrackedRequest | None:
        """A tracked request, keyed for what its blocks hold now."""
        tracked = self._tracked.get(req_id)
        return self._refreshed(tracked) if tracked is not None else None

    def _refreshed(self, tracked: TrackedRequest) -> TrackedRequest:
        if tracked.refresh(self._space):
            # A streaming-input session's next chunk: it is never looked up (vLLM resumes it from the
            # blocks it holds), and its prompt is saved anew when complete, under the new keys.
            self.stats.add("session_chunks_rekeyed")
            self._count_unhashable(tracked)
        return tracked

    def _count_unhashable(self, tracked: TrackedRequest) -> None:
        if tracked.unhashable:
            self.stats.add("requests_unhashable")
            self._warn_once("unhashable", f"kvtool: a request is neither looked up nor stored: {tracked.unhashable}")

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        """The external hit, or None while its lookup is in flight (vLLM retries on a later step).

        Lookups never block: they are sent in one batch per step (``build_connector_meta``) and
        answered on a background thread. A hit is loaded asynchronously (``load_kv_async=True``).
        """
        tracked = self._track(request)
        tracked.local_tokens = num_computed_tokens
        req_id = request.request_id
        if self._lookups is None or len(tracked.keys.tokens) < 2 or tracked.unhashable:
            return 0, False
        if getattr(request, "skip_reading_prefix_cache", False):
            # vLLM drops any hit of a request that reads no cached prefix (prompt_logprobs): no lookup, so
            # no step waits for one; its prompt is still saved.
            tracked.lookup = "not looked up: the request reads no cached prefix (prompt_logprobs)"
            return 0, False
        if not self._loads_enabled:
            # A producer only learns what is stored already, for its save; it never waits for that.
            self._lookups.want(req_id, tracked.keys)
            return 0, False
        if tracked.load_failure is not None:
            return 0, False  # its load failed: vLLM recomputes, and a second try would likely fail too
        if not self._worth_a_lookup(tracked, num_computed_tokens):
            return 0, False
        outcome = self._lookups.poll(req_id)
        if outcome is None and self._pacing.bypassed():
            self.stats.add("lookups_bypassed")  # the store is failing or slow: a miss, no waiting
            outcome = StoreError("the store is bypassed (failing or slow); not looked up")
        if outcome is None:
            gain = len(tracked.keys.tokens) - 1 - num_computed_tokens
            self._lookups.want(req_id, tracked.keys, self._pacing.request_wait_s(gain))
            outcome = self._pacing.settle(self._lookups, req_id)
        if outcome is None:
            return None, False
        self._mark(tracked, "answered")
        self._lookups.forget(req_id)  # a preempted request that comes back looks up afresh
        self.stats.add("lookups")
        if isinstance(outcome, StoreError):
            self.stats.add("lookup_errors")
            self._warn_once("lookup", f"kvtool: store lookup failed, serving as a cache miss: {outcome}")
            tracked.lookup, tracked.plan, tracked.stored = f"error: {outcome}", None, None
            return 0, False
        if outcome.pointer_read_failed:
            self.stats.add("pointer_reads_failed")
        plan = plan_load(tracked.keys, outcome, num_computed_tokens)
        verdict = self._judge(tracked.keys, outcome, num_computed_tokens, plan, tracked.explore)
        tracked.load_skipped = None
        if verdict.skipped is not None:
            self.stats.add(f"loads_{verdict.skipped}")
            tracked.load_skipped = f"{verdict.skipped}: {verdict.detail}"
        elif verdict.detail == "explored":
            self.stats.add("loads_explored")
        plan = verdict.plan
        tracked.plan, tracked.stored = plan, outcome
        tracked.stored_prefix_tokens = outcome.tokens
        tracked.lookup = "hit" if plan.external_tokens else "miss"
        tracked.offered = True
        return plan.external_tokens, plan.external_tokens > 0

    def _worth_a_lookup(self, tracked: TrackedRequest, local_tokens: int) -> bool:
        """``HitJudge.lookup_verdict``, decided when first asked and again where there is more to gain since
        (preempted, re-keyed). A saving engine always looks up: its saves use what a lookup finds stored."""
        if self._saves_enabled or self._answers_enabled:
            return True
        gain = len(tracked.keys.tokens) - 1 - local_tokens
        if tracked.lookup_gain is None or gain > tracked.lookup_gain:
            verdict = self._judge.lookup_verdict(gain)
            tracked.lookup_gain, tracked.lookup_worth, tracked.explore = gain, not verdict.skipped, verdict.explore
            if verdict.skipped:
                tracked.lookup = f"not looked up: {verdict.skipped}"
                self.stats.add("lookups_not_worth")
        return tracked.lookup_worth

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        tracked = self._track(request)
        block_ids = [list(ids) for ids in blocks.get_block_ids()]
        tracked.block_ids = block_ids
        if not tracked.offered:
            # vLLM calls this again when a request whose load ended is scheduled: nothing new to load.
            return
        tracked.offered = False
        plan = tracked.plan
        tracked.granted_external = max(0, num_external_tokens) if plan is not None else 0
        if num_external_tokens <= 0 or plan is None:
            if plan is not None and plan.external_tokens:
                tracked.lookup = "hit not taken by the scheduler"
            return
        # The scheduler takes the whole hit or none of it (vLLM 0.32, but for one model's bounded
        # replay). Full-attention objects cover whole blocks, so a shorter grant still loads correct
        # bytes for what it claims; a state holds for exactly the planned boundary, and a window for a
        # shorter hit starts at other blocks: with any other group, any other grant fails the load.
        end_block = (plan.local_tokens + num_external_tokens - 1) // self._block_size
        if num_external_tokens != plan.external_tokens and any(g.kind is not GroupKind.FULL for g in self._groups):
            self._warn_once("grant", "kvtool: the scheduler granted part of a hybrid model's hit; recomputing")
            self._send_load(tracked, RequestLoad(request.request_id, (), failure="partial grant of a hybrid hit"))
            return
        transfers = []
        for obj in plan.objects:
            if obj.block_index > end_block:
                continue
            ids = block_ids[obj.group] if obj.group < len(block_ids) else []
            block_id = ids[obj.block_index] if obj.block_index < len(ids) else NULL_BLOCK_ID
            if block_id == NULL_BLOCK_ID:
                if self._groups[obj.group].kind is GroupKind.SLIDING:
                    continue  # a block the window left: vLLM does not attend it, nothing to fill
                # Any other group must get its block, or vLLM would compute on bytes nobody filled.
                self._warn_once("no-block", "kvtool: vLLM gave a hit no block for a group's object; recomputing")
                self._send_load(tracked, RequestLoad(request.request_id, (), failure="no block for an object"))
                return
            transfers.append(
                BlockTransfer(block_id, obj.kind, obj.token_start, obj.token_end, obj.chain_hash, obj.group)
            )
        model = self._judge.model
        recompute_s = model.prefill_s(num_external_tokens) if model.ready else None
        self._send_load(tracked, RequestLoad(request.request_id, tuple(transfers), recompute_s=recompute_s))

    def _send_load(self, tracked: TrackedRequest, load: RequestLoad) -> None:
        """A load (a failing one too): until it is reported, the blocks hold nothing computed (no answer save)."""
        self._pending_loads.append(load)
        tracked.loading = True

    # -- metadata -----------------------------------------------------------------------------------

    def _mark(self, tracked: TrackedRequest | None, name: str) -> None:
        if tracked is not None and tracked.timeline is not None:
            if name == "computing" and tracked.load_failure is None:  # a load's whole delay, for the model
                self._judge.request_computed(tracked.timeline, tracked.plan, time.monotonic())
            tracked.timeline.mark(name, time.monotonic(), self._step)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVToolMetadata:
        step_tokens = getattr(scheduler_output, "total_num_scheduled_tokens", 0)
        self._pacing.step_built(step_tokens)
        if self._lookups is not None:
            self._lookups.flush()  # this step's lookups, as one batch in the background
        for req_id in getattr(scheduler_output, "num_scheduled_tokens", None) or {}:
            self._mark(self._tracked.get(req_id), "computing")
        for load in self._pending_loads:
            if not load.failure:
                self._mark(self._tracked.get(load.req_id), "load_sent")
        self._step += 1
        meta = KVToolMetadata(loads=self._pending_loads, saves=self._pending_saves)
        meta.step_tokens = step_tokens
        self._pending_loads, self._pending_saves = [], []
        # vLLM 0.32 copies a sub-block prefix hit's shared tail block (copy-on-write) only partly on a
        # hybrid model (connector.worker.worker.WorkerSide.repair_block_copies): have the worker redo them.
        meta.block_copies = tuple(
            (copy.src_block_id, copy.dst_block_id)
            for copy in getattr(scheduler_output, "kv_cache_block_copies", None) or ()
        )
        if not self._saves_enabled:
            return meta
        # vLLM's current block tables (never an append-only mirror: a sliding window or a Mamba group
        # frees blocks and reuses their ids) and this step's exact Mamba boundary states.
        block_state = getattr(scheduler_output, "kv_connector_block_state", None)
        saves = PromptSaves(
            self._groups,
            self.stats,
            block_state.get_block_ids if block_state is not None else None,
            scheduler_output.num_scheduled_tokens,
            self._stored_found,
        )
        for new_req in scheduler_output.scheduled_new_reqs:
            tracked = self._live(new_req.req_id)
            if tracked is None:
                continue
            tracked.block_ids = [list(ids) for ids in new_req.block_ids]
            saves.plan(meta, tracked, new_req.num_computed_tokens)
        cached = scheduler_output.scheduled_cached_reqs
        for index, req_id in enumerate(cached.req_ids):
            tracked = self._live(req_id)
            if tracked is None:
                continue
            tracked.take_blocks(cached.new_block_ids[index], resumed=req_id in cached.resumed_req_ids)
            saves.plan(meta, tracked, cached.num_computed_tokens[index])
        if block_state is not None and block_state.boundary_state_offloads:
            for req_id, entries in block_state.boundary_state_offloads.items():
                saves.boundary_states(meta, self._live(req_id), entries)
        return meta

    def _stored_found(self, tracked: TrackedRequest) -> Any:
        """What a lookup of the request found stored, where it is answered but not taken yet."""
        return self._lookups.poll(tracked.request.request_id) if tracked.stored is None and self._lookups else None

    def record_transfers(self, received: set[str] | None, sent: set[str] | None) -> None:
        """Loads the worker reported received (their blocks are filled, or vLLM recomputes), and answer
        saves it reported sent (vLLM frees their blocks)."""
        for req_id in received or ():
            if (tracked := self._tracked.get(req_id)) is not None:
                tracked.loading = False
                self._mark(tracked, "load_done")
        self._holding.difference_update(sent or ())

    def has_pending_block_frees(self) -> bool:
        """Answer saves hold finished requests' blocks a step or two: vLLM waits for them, not preempts."""
        return bool(self._holding)

    def stop_sharing(self) -> None:
        """No lookup, load or save from now on (``KVToolConnector.reset_cache``: new weights, maybe)."""
        self._lookups, self._loads_enabled, self._saves_enabled, self._answers_enabled = None, False, False, False

    def record_worker_meta(self, worker_meta: object) -> None:
        """Loads that failed, the cost model's measurements, prompt saves that left objects unstored."""
        samples = getattr(worker_meta, "load_samples", ()), getattr(worker_meta, "step_samples", ())
        if (line := self._judge.observe(*samples, time.monotonic())) is not None:
            logger.info(line)
        for req_id, failure in getattr(worker_meta, "load_failures", {}).items():
            if (tracked := self._tracked.get(req_id)) is not None:
                tracked.load_failure = failure
        for req_id in getattr(worker_meta, "unsaved", ()):
            if (tracked := self._tracked.get(req_id)) is not None:  # its answer save puts them again
                tracked.prompt_unsaved = True

    def take_stats(self) -> dict[str, int]:
        taken = self.stats.take() | (self._lookups.take_stats() if self._lookups is not None else {})
        more = getattr(self._store, "take_stats", None)
        for name, value in (more() if more is not None else {}).items():
            taken[name] = taken.get(name, 0) + value
        return taken

    def request_finished(
        self, request: Request, block_ids: tuple[list[int], ...] | None = None
    ) -> tuple[bool, dict[str, Any] | None]:
        """Report the request's hit details; with answer saves on, plan the save of prompt + answer and
        hold the request's blocks (True) until the worker has copied them."""
        if self._lookups is not None:
            self._lookups.forget(request.request_id)
        tracked = self._tracked.pop(request.request_id, None)
        if tracked is None:
            return False, None
        self._mark(tracked, "finished")
        self._refreshed(tracked)  # a session whose next chunk arrived: its blocks hold that prompt's start
        answer = (
            plan_answer_save(tracked, block_ids, self._space, has_state_group=self._has_state_group, stats=self.stats)
            if self._answers_enabled
            else None
        )
        if answer is not None:
            self._pending_saves.append(answer)
            self._holding.add(request.request_id)
        details = tracked.hit_details(self._ranks).to_dict()
        if self.request_log is not None:
            self.request_log.write(request, details)
        return answer is not None, {"kvtool": details}
