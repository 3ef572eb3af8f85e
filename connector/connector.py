"""KVToolConnector: the class vLLM loads (``kv_connector="KVToolConnector"``,
``kv_connector_module_path="connector.connector"``).

A thin facade: it validates the configuration, opens the store, and delegates by role to the
scheduler side or the worker side. It fails closed: a store that cannot be reached at start-up
leaves the engine serving without the connector's help (one warning).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.parallel_state import get_tensor_model_parallel_rank
from vllm.platforms import current_platform
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    SupportsHMA,
)

from .store.breaker import CircuitBreaker
from .store.instrumented import InstrumentedStore
from .config import KV_ROLES, LOADING_ROLES, SAVING_ROLES, ConfigError, check_block_size, load_config
from .data import KVToolMetadata, KVToolWorkerMeta
from .worker.layout import EngineLayout, UnsupportedLayout, check_attention_layout, engine_layout, state_reuse_warnings
from .scheduler.hooktime import HookClock, on_engine_thread
from .core import native
from .core.keys import Namespace
from .metrics import KVToolStats
from .core.ranks import rank_namespace
from .scheduler.scheduler import SchedulerSide
from .store.stack import breaker_policy, open_store_stack
from .store.store import TimedStore
from .worker.worker import WorkerSide

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

logger = logging.getLogger("vllm.kvtool")


class KVToolConnector(KVConnectorBase_V1, SupportsHMA):
    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        self._hook_clock = HookClock()
        self._stopped_sharing = False  # reset_cache, on_cache_reset
        transfer = self._kv_transfer_config
        if transfer.kv_role not in KV_ROLES:
            raise ValueError(f"kvtool connector: kv_role {transfer.kv_role!r} is not one of {', '.join(KV_ROLES)}")
        self.config = load_config(transfer.kv_connector_extra_config)
        loads_enabled = transfer.kv_role in LOADING_ROLES
        saves_enabled = transfer.kv_role in SAVING_ROLES
        answers_enabled = self.config.save_answers
        if role == KVConnectorRole.SCHEDULER and loads_enabled and transfer.kv_load_failure_policy != "recompute":
            # A failed load must be a miss, never a failed request.
            logger.warning("kvtool: kv_load_failure_policy %r changed to 'recompute'", transfer.kv_load_failure_policy)
            transfer.kv_load_failure_policy = "recompute"

        self.layout: EngineLayout | None = None
        try:
            if current_platform.device_type not in ("cpu", "cuda"):
                raise UnsupportedLayout(
                    f"the KV cache is on {current_platform.device_type}; kvtool moves KV on the CPU and on CUDA"
                )
            self.layout = engine_layout(vllm_config, kv_cache_config, self.config.model_id, self.config.weights_digest)
        except UnsupportedLayout as exc:
            logger.warning("kvtool: connector disabled, %s; the engine serves without it", exc)
        if self.layout is not None:  # the block size, which the token grids must fit, is known from here
            check_block_size(self.config, self.layout.groups[0].block_size)
        if self.layout is not None and role == KVConnectorRole.SCHEDULER:
            match_unit = getattr(vllm_config.cache_config, "prefix_match_unit", None)
            for warning in state_reuse_warnings(self.layout.groups, self.config.hash_unit, match_unit, saves_enabled):
                logger.warning("kvtool: %s", warning)
            logger.info("kvtool: keys are built by %s", native.describe())
        self.namespace = self.layout.namespace if self.layout is not None else None
        self._breaker = CircuitBreaker(breaker_policy(self.config))  # the store's health, which both sides consult
        self._store = self._open_store(role) if self.layout is not None else None
        self._scheduler: SchedulerSide | None = None
        self._worker: WorkerSide | None = None
        namespace = self.namespace or _placeholder_namespace()
        if role == KVConnectorRole.SCHEDULER:
            self._scheduler = SchedulerSide(
                self.config,
                namespace,
                self._store,
                loads_enabled=loads_enabled,
                saves_enabled=saves_enabled,
                answers_enabled=answers_enabled,
                groups=self.layout.groups if self.layout is not None else None,
                block_bytes=self.layout.block_bytes if self.layout is not None else (),
                token_bytes=self.layout.token_bytes if self.layout is not None else (),
                breaker=self._breaker,
                mm_named_by_content=_mm_named_by_content(vllm_config),
            )
        else:
            self._worker = WorkerSide(
                _worker_namespace(namespace) if self.layout is not None else namespace,
                self._store,
                self.config,
                saves_enabled=saves_enabled or answers_enabled,
                breaker=self._breaker,
                defer_copies=_v1_model_runner(vllm_config),
            )

    def _open_store(self, role: KVConnectorRole) -> InstrumentedStore | TimedStore:
        # Only the worker lends memory to the store; the scheduler side only asks what exists.
        return open_store_stack(self.config, "worker" if role == KVConnectorRole.WORKER else "scheduler", self._breaker)

    # ---- scheduler side ---------------------------------------------------------------------------

    @on_engine_thread
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        assert self._scheduler is not None
        return self._scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    @on_engine_thread
    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int):
        assert self._scheduler is not None
        self._scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    @on_engine_thread
    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        assert self._scheduler is not None
        return self._scheduler.build_connector_meta(scheduler_output)

    @on_engine_thread
    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        assert self._scheduler is not None
        return self._scheduler.request_finished(request, (list(block_ids),))

    @on_engine_thread
    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        # A prompt's save copies its blocks in the step that computes them; only an answer save (at
        # request end) holds the request's blocks, until the worker reports them copied.
        assert self._scheduler is not None
        return self._scheduler.request_finished(request, tuple(list(ids) for ids in block_ids))

    @property
    def requires_kv_delivery(self) -> bool:
        # A best-effort cache: a save lost to preemption is only a future miss.
        return False

    # ---- worker side ------------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]):
        assert self._worker is not None
        # Without a store too: the worker redoes vLLM's partial copy-on-write copies (hybrid models),
        # which vLLM's own sub-block hits need whatever the store does (the worker then moves no KV).
        if self.layout is None:
            return
        try:
            check_attention_layout(self._vllm_config, self.layout)
            self._worker.register_kv_caches(
                kv_caches,
                [list(names) for names in self.layout.layer_names],
                self._kv_cache_config.num_blocks,
                self.layout.attention,
            )
        except ConfigError:
            raise  # a bad setting (a staging area smaller than one object) stops the engine
        except (ValueError, UnsupportedLayout) as exc:
            # Loads planned by the scheduler side then fail (recompute); nothing is saved.
            logger.warning("kvtool: connector disabled, %s", exc)

    @on_engine_thread
    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        # vLLM's first call of every step, before it touches a block: the last step's save copies,
        # made off the engine thread (connector.worker.stepcopies), must be done.
        if self._worker is not None:
            self._worker.before_step()

    @on_engine_thread
    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        # The one worker hook between vLLM's copy-on-write copies and the forward (see
        # WorkerSide.repair_block_copies); start_load_kv may come after the forward.
        if self._worker is not None and isinstance(connector_metadata, KVToolMetadata):
            self._worker.step_started()
            self._worker.repair_block_copies(connector_metadata.block_copies)
            # Loads start here, before the forward, not in start_load_kv (which vLLM calls after it when
            # no load is synchronous): the fetch overlaps this step's forward and is usually done by
            # get_finished at its end, a step sooner. It only fills the load staging area; the copy into
            # the request's blocks (not in this forward: they wait for their load) happens then.
            self._worker.start_load_kv(connector_metadata)

    @on_engine_thread
    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        assert self._worker is not None
        # The loads started in bind_connector_metadata.

    def wait_for_layer_load(self, layer_name: str) -> None:
        return

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: AttentionMetadata, **kwargs: Any
    ) -> None:
        return

    @on_engine_thread
    def wait_for_save(self):
        assert self._worker is not None
        meta = self._connector_metadata
        if isinstance(meta, KVToolMetadata):
            self._worker.wait_for_save(meta)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        results = self.get_transfer_results(finished_req_ids)
        return results.finished_sending or None, results.finished_recving or None

    @on_engine_thread
    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        """Loads that ended this step (failed ones are failed receives, which vLLM recomputes whole),
        and finished requests whose answer save copied their blocks (vLLM frees them)."""
        if self._worker is None:
            return KVConnectorTransferResults()
        meta = self._connector_metadata
        step_tokens = meta.step_tokens if isinstance(meta, KVToolMetadata) else 1
        received, failed = self._worker.get_finished(step_tokens)
        return KVConnectorTransferResults(
            finished_sending=self._worker.take_sent(), finished_recving=received, failed_recving=failed
        )

    @on_engine_thread
    def build_connector_worker_meta(self) -> KVToolWorkerMeta | None:
        return self._worker.take_worker_meta() if self._worker is not None else None

    @on_engine_thread
    def update_connector_output(self, connector_output: KVConnectorOutput):
        if self._scheduler is not None:
            self._scheduler.record_worker_meta(connector_output.kv_connector_worker_meta)
            self._scheduler.record_transfers(connector_output.finished_recving, connector_output.finished_sending)

    @on_engine_thread
    def has_pending_block_frees(self) -> bool:
        return self._scheduler is not None and self._scheduler.has_pending_block_frees()

    def reset_cache(self) -> bool | None:
        """vLLM reset its caches (a pause or sleep with ``clear_cache``, vLLM's default, before a weight
        update; ``reset_prefix_cache`` with ``reset_connector``): the weights may have changed, and with
        them this engine's KV, under the same namespace (it follows the weights' files). The store is
        shared and other engines' KV is theirs, so nothing is removed; with ``on_cache_reset`` at its
        default this engine stops looking up, loading and saving until it restarts."""
        if self._scheduler is None:
            return None
        if self.config.on_cache_reset == "stop_sharing" and not self._stopped_sharing:
            self._stopped_sharing = True
            self._scheduler.stop_sharing()
            logger.warning(
                "kvtool: vLLM reset its caches (a pause or sleep, a weight update?); this engine no longer loads "
                "or saves KV through the store until it restarts (on_cache_reset: keep_sharing keeps it sharing)"
            )
        return True

    def get_kv_connector_stats(self) -> KVToolStats | None:
        side = self._worker if self._worker is not None else self._scheduler
        taken = side.take_stats() if side is not None else {}
        for name, value in self._hook_clock.take().items():
            taken[name] = taken.get(name, 0) + value
        return KVToolStats(data=taken) if taken else None

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVToolStats | None:
        return KVToolStats(data=dict(data)) if data is not None else KVToolStats()

    @classmethod
    def build_prom_metrics(cls, vllm_config, metric_types, labelnames, per_engine_labelvalues):
        from .metrics import KVToolPromMetrics

        return KVToolPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def shutdown(self):
        if self._worker is not None:
            self._worker.shutdown()
        if self._scheduler is not None and self._scheduler.request_log is not None:
            self._scheduler.request_log.close()
        if self._store is not None:
            self._store.close()
            self._store = None


def _mm_named_by_content(vllm_config: VllmConfig) -> bool:
    """Whether vLLM names multimodal inputs by their content: where its prefix caching and its multimodal
    processor cache are both off it names each by a per-process request counter (``renderers/base.py``,
    ``_process_mm_uuids``); unknown counts as no (only multimodal requests go unkeyed)."""
    try:
        multimodal = vllm_config.model_config.multimodal_config
        if multimodal is None:
            return True
        return not (multimodal.mm_processor_cache_gb == 0 and not vllm_config.cache_config.enable_prefix_caching)
    except Exception:  # noqa: BLE001 - a config not read here: multimodal requests are neither looked up nor saved
        return False


def _v1_model_runner(vllm_config: VllmConfig) -> bool:
    """Whether the engine runs vLLM's V1 model runner, whose per-step hook comes before anything writes a
    block (``stepcopies``); unknown counts as no."""
    try:
        return vllm_config.use_v2_model_runner is False
    except Exception:  # noqa: BLE001 - a config vLLM cannot settle here: copy on the engine's thread
        return False


def _placeholder_namespace() -> Namespace:
    return Namespace(
        model="disabled", dtype="none", kv_layout="none", block_size=1, num_layers=0, num_kv_heads=0, head_size=0
    )


def _worker_namespace(namespace: Namespace) -> Namespace:
    """A worker's namespace: the engine's, with its own TP rank (each rank stores its share of the KV
    heads under its own keys, ``connector.core.ranks``)."""
    if namespace.tp_size == 1:
        return namespace
    return rank_namespace(namespace, get_tensor_model_parallel_rank())
