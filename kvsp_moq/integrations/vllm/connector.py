"""``KVSPConnector``: the class vLLM loads (``kv_connector_module_path``), docs/vllm.md.

    KVTransferConfig(kv_connector="KVSPConnector",
                     kv_connector_module_path="kvsp_moq.integrations.vllm.connector",
                     kv_role="kv_both", kv_load_failure_policy="recompute",
                     kv_connector_extra_config={...})   # .settings.ConnectorSettings

vLLM creates the class twice: once in the scheduler (``KVConnectorRole.SCHEDULER``) and once
per worker (``WORKER``); the two talk only through the step metadata (:mod:`.plan`). This
module is the only one that imports vLLM; it forwards every call to the role's vLLM-free
half, :class:`~.scheduler.SchedulerSide` or :class:`~.worker.WorkerSide`. Both roles derive
the same Compatibility Descriptors from the engine's model (:mod:`.descriptor`): the scheduler
one per tensor-parallel rank (and adapter), each worker its own rank's.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorWorkerMetadata,
)

from ...kvsp.compat import compat_id
from .descriptor import EngineModel, kv_scales_digest
from .plan import StepPlan, merge_counts, merge_marks
from .scheduler import SchedulerSide
from .settings import ConnectorSettings
from .stream import role_of
from .worker import WorkerSide

if TYPE_CHECKING:
    import torch
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

__all__ = ["KVSPConnector", "KVSPConnectorMetadata", "KVSPWorkerExtension", "KVSPWorkerMetadata"]

log = logging.getLogger(__name__)


def _log_like_vllm() -> None:
    """The connector's (and the client library's) log records go where vLLM's go."""
    ours, theirs = logging.getLogger("kvsp_moq"), logging.getLogger("vllm")
    if not ours.handlers and theirs.handlers:
        for handler in theirs.handlers:
            ours.addHandler(handler)
        ours.setLevel(logging.INFO)
        ours.propagate = False


@dataclass
class KVSPConnectorMetadata(KVConnectorMetadata):
    """One step's plan, scheduler -> workers."""

    plan: StepPlan = field(default_factory=StepPlan)


@dataclass
class KVSPWorkerMetadata(KVConnectorWorkerMetadata):
    """One step's per-request counters, workers -> scheduler (summed over workers)."""

    counts: dict[str, dict[str, int]] = field(default_factory=dict)
    #: Per-request time marks of streams (CLOCK_MONOTONIC ns, :mod:`.worker`).
    marks: dict[str, dict[str, list[int]]] = field(default_factory=dict)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        if isinstance(other, KVSPWorkerMetadata):
            merge_counts(self.counts, other.counts)
            merge_marks(self.marks, other.marks)
        return self


def _tensor_parallel_rank() -> int:
    """This worker's tensor-parallel rank (0 where vLLM's groups are not set up)."""
    from vllm.distributed.parallel_state import get_tensor_model_parallel_rank, model_parallel_is_initialized

    return int(get_tensor_model_parallel_rank()) if model_parallel_is_initialized() else 0


class KVSPConnector(KVConnectorBase_V1):
    """KV blocks shared through KVSP: IS lookup, MOQT layer-wise loads, publication."""

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole,
                 kv_cache_config: KVCacheConfig | None = None) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        _log_like_vllm()
        self.kv_role = str(self._kv_transfer_config.kv_role or "kv_both")
        role_of(self.kv_role)  # StreamError for a role the connector does not know
        settings = ConnectorSettings.from_extra(self._kv_transfer_config.kv_connector_extra_config)
        # a consumer engine (prefill→decode) publishes nothing: its KV comes from producers
        self.settings = replace(settings, publish=False) if self.kv_role == "kv_consumer" else settings
        self.model = EngineModel.of(vllm_config, self.settings.model_name, self.settings.block_tokens)
        self.rank = _tensor_parallel_rank() if role != KVConnectorRole.SCHEDULER else 0
        self.descriptor = self.model.descriptor(self.rank)
        self.compat_id = compat_id(self.descriptor)
        self.scheduler: SchedulerSide | None = None
        self.worker: WorkerSide | None = None
        if role == KVConnectorRole.SCHEDULER:
            self.scheduler = SchedulerSide(self.settings, self.model, kv_role=self.kv_role)
        else:
            self.worker = WorkerSide(self.settings, self.descriptor, self.rank, page_tokens=self.model.page_tokens)
        log.info("KVSP connector (%s, rank %d of %d): compat %s, %s, B = %s (%d pages), scopes %s", role.name,
                 self.rank, self.model.world_size, self.compat_id.hex()[:16], self.model.kv_dtype,
                 self.model.block_tokens, self.model.block_tokens // self.model.page_tokens, sorted(self.settings.scopes))

    # -- worker side ------------------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        from vllm.distributed.kv_transfer.kv_connector.utils import get_current_attn_backends

        backends = get_current_attn_backends(self._vllm_config, list(kv_caches))
        assert self.worker is not None
        scales = None
        if self.model.kv_scales is not None:
            scales = kv_scales_digest(self._layer_scales(list(kv_caches)))
        self.worker.register_kv_caches(kv_caches, backends[0].get_name() if backends else "",
                                       kv_scales=(scales, self.model.kv_scales))

    def _layer_scales(self, layer_names: list[str]) -> list[tuple[float, float]]:
        """The (k_scale, v_scale) each attention layer quantizes its fp8 KV with, in layer order."""
        from .worker import layer_index

        context = self._vllm_config.compilation_config.static_forward_context
        ordered = sorted(layer_names, key=layer_index)
        return [(float(getattr(context[n], "_k_scale_float", 1.0)), float(getattr(context[n], "_v_scale_float", 1.0)))
                for n in ordered]

    def _plan(self) -> StepPlan:
        if not self.has_connector_metadata():
            return StepPlan()
        meta = self._get_connector_metadata()
        return meta.plan if isinstance(meta, KVSPConnectorMetadata) else StepPlan()

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        assert self.worker is not None
        self.worker.start_load_kv(self._plan())

    def wait_for_layer_load(self, layer_name: str) -> None:
        assert self.worker is not None
        self.worker.wait_for_layer_load(layer_name)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: AttentionMetadata,
                      **kwargs: Any) -> None:
        assert self.worker is not None
        self.worker.save_kv_layer(layer_name, kv_layer, self._plan())

    def wait_for_save(self) -> None:
        assert self.worker is not None
        self.worker.wait_for_save(self._plan())

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        assert self.worker is not None
        return self.worker.get_finished(finished_req_ids)

    def get_block_ids_with_load_errors(self) -> set[int]:
        assert self.worker is not None
        return self.worker.get_block_ids_with_load_errors()

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        assert self.worker is not None
        counts, marks = self.worker.take_counts(), self.worker.take_marks()
        return KVSPWorkerMetadata(counts, marks) if counts or marks else None

    def flush_publications(self, timeout: float) -> bool:
        """Wait (bounded) for this worker's background publications (:meth:`WorkerSide.flush`)."""
        return self.worker.flush(timeout) if self.worker is not None else True

    def shutdown(self) -> None:
        if self.worker is not None:
            self.worker.close()
        if self.scheduler is not None:
            self.scheduler.close()

    # -- scheduler side -------------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        assert self.scheduler is not None
        return self.scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        assert self.scheduler is not None
        self.scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        assert self.scheduler is not None
        return KVSPConnectorMetadata(self.scheduler.build_connector_meta(scheduler_output))

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        meta = getattr(connector_output, "kv_connector_worker_meta", None)
        if self.scheduler is not None and isinstance(meta, KVSPWorkerMetadata):
            self.scheduler.update_connector_output(meta.counts, meta.marks)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        assert self.scheduler is not None
        return False, self.scheduler.request_finished(request)


class KVSPWorkerExtension:
    """Methods vLLM adds to its worker class (``LLM(worker_extension_cls=settings.WORKER_EXTENSION)``),
    called on every worker by ``llm.collective_rpc(name, args=...)``."""

    def kvsp_flush(self, timeout: float) -> bool:
        """Wait at most ``timeout`` s for this worker's background publications; True when none
        is left (True too where the engine runs no KVSP connector)."""
        from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group

        if not has_kv_transfer_group():
            return True
        connector = get_kv_transfer_group()
        return connector.flush_publications(timeout) if isinstance(connector, KVSPConnector) else True
