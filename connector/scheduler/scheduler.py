"""Scheduler side: finds stored prefixes, plans loads and saves, reports per-request hit details."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ..config import KVToolConfig, divergence_grid, lead_pointers
from ..data import BlockTransfer, KVToolMetadata, RequestLoad, RequestSave, StoredObject
from ..core.groups import NULL_BLOCK_ID, CacheGroup, GroupKind
from ..core.keys import KeyKind, Namespace
from .answers import plan_answer_save
from ..store.breaker import CircuitBreaker
from ..calls import BoundedCalls
from ..counters import Counters, WarnOnce
from .lookups import POINTER_READ_SHARE, LookupBatcher, pointer_reader
from .lookupwait import LookupPacing
from ..core.prefix import plan_load, plan_save, single_group
from ..core.refs import ObjectRef
from ..core.profit import HitJudge
from ..core.ranks import on_every_rank, rank_components
from ..core.search import find_saved_objects, find_stored_prefixes
from ..store.store import KVStore, StoreError
from ..core.saveplans import add_state_saves, last_put_key, save_transfer, state_transfers
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
        self._current_tables: Callable[[str], tuple[list[int], ...] | None] | None = None
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
        self._current_tables = block_state.get_block_ids if block_state is not None else None
        for new_req in scheduler_output.scheduled_new_reqs:
            tracked = self._live(new_req.req_id)
            if tracked is None:
                continue
            tracked.block_ids = [list(ids) for ids in new_req.block_ids]
            self._maybe_save(meta, tracked, new_req.num_computed_tokens, scheduler_output)
        cached = scheduler_output.scheduled_cached_reqs
        for index, req_id in enumerate(cached.req_ids):
            tracked = self._live(req_id)
            if tracked is None:
                continue
            tracked.take_blocks(cached.new_block_ids[index], resumed=req_id in cached.resumed_req_ids)
            self._maybe_save(meta, tracked, cached.num_computed_tokens[index], scheduler_output)
        if block_state is not None and block_state.boundary_state_offloads:
            self._save_boundary_states(meta, block_state.boundary_state_offloads)
        self._current_tables = None
        return meta

    def _save_boundary_states(self, meta: KVToolMetadata, offloads: dict[str, list[tuple[int, int, int]]]) -> None:
        """Save the Mamba states vLLM's align mode keeps at boundaries inside a prompt, from the exact
        blocks it names, in the step that computes them (a later step's forward may overwrite them).

        With them a prompt that shares only the first blocks of a stored one, or the stored prompt
        itself sent unchanged, hits at the last boundary its state group holds."""
        for req_id, entries in offloads.items():
            tracked = self._live(req_id)
            if tracked is None or tracked.unhashable:
                continue
            transfers = state_transfers(tracked.keys, self._groups, entries)
            if transfers:
                self.stats.add("state_checkpoints", len(transfers))
                add_state_saves(meta.saves, req_id, transfers, len(tracked.keys.tokens))

    def _maybe_save(
        self, meta: KVToolMetadata, tracked: TrackedRequest, num_computed: int, scheduler_output: SchedulerOutput
    ) -> None:
        """Publish the prompt's KV in the step that completes it (so a max_tokens=1 request publishes too)."""
        if tracked.save_scheduled or tracked.unhashable:
            return
        req_id = tracked.request.request_id
        scheduled = scheduler_output.num_scheduled_tokens.get(req_id, 0)
        prompt_len = len(tracked.keys.tokens)
        if num_computed + scheduled < prompt_len:
            return
        tracked.save_scheduled = True
        planned = plan_save(tracked.keys)
        present = self._known_present(tracked, planned)
        missing = [s for s, found in zip(planned, present, strict=True) if not found]
        sources = [self._source_block(tracked, s, num_computed) for s in missing]
        usable = [(s, block_id) for s, block_id in zip(missing, sources, strict=True) if block_id is not None]
        if len(usable) != len(missing):
            # A sliding-window group gave up the blocks its window left (an earlier chunk's): a lookup
            # that needs them will not find them, which is a miss, never a wrong block.
            self.stats.add("save_objects_not_held", len(missing) - len(usable))
        if not usable:
            return
        params = getattr(tracked.request, "kv_transfer_params", None) or {}
        meta.saves.append(
            RequestSave(
                req_id,
                tuple(save_transfer(tracked.keys, s, block_id) for s, block_id in usable),
                already_stored=tuple(
                    StoredObject(s.kind, s.token_start, s.token_end, s.group, s.chain_hash)
                    for s, found in zip(planned, present, strict=True)
                    if found
                ),
                prompt_tokens=prompt_len,
                state_groups=tracked.keys.state_groups,
                tag=params.get("kvtool_tag"),
                last_block_key=next((s.key for s in reversed(planned) if s.kind is KeyKind.BLOCK), None),
                tail_key=next((s.key for s in planned if s.kind is KeyKind.TAIL), None),
                turn=tracked.turn,
            )
        )
        tracked.saved_keys |= frozenset(s.key for s, _ in usable)
        tracked.save_objects += len(usable)
        tracked.last_saved_key = last_put_key(tracked.keys, [s for s, _ in usable])
        tails = [s.token_end for s, _ in usable if s.kind is KeyKind.TAIL]
        tracked.tail_boundary_saved = tails[0] if tails else None

    def _source_block(self, tracked: TrackedRequest, save: ObjectRef, computed_before_step: int) -> int | None:
        """The block a save object is copied from, or None when the request no longer holds it."""
        tables = self._current_tables(tracked.request.request_id) if self._current_tables is not None else None
        if tables is None:
            if self._groups[save.group].kind is not GroupKind.FULL:
                return None  # only full attention's table only grows; another group's mirror may be stale
            tables = tracked.block_ids
        ids = tables[save.group] if save.group < len(tables) else []
        if save.block_index >= len(ids) or ids[save.block_index] == NULL_BLOCK_ID:
            return None
        if save.block_index < self._groups[save.group].live_from_block(computed_before_step):
            return None  # freed when this step began: its id may already hold another request's KV
        return ids[save.block_index]

    def _known_present(self, tracked: TrackedRequest, saves: list[ObjectRef]) -> list[bool]:
        """Which of the prompt's objects a lookup already found stored (no copy needed for those)."""
        polled = self._lookups.poll(tracked.request.request_id) if tracked.stored is None and self._lookups else None
        return tracked.known_present(saves, polled)

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
