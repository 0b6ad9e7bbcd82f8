"""vLLM's KV connector and offloading-tier base classes, or stand-ins with
the same surface.

With vLLM installed, these are vLLM's own: the connector's in
vllm/distributed/kv_transfer/kv_connector/v1/base.py and metrics.py, its KV
events in vllm/distributed/kv_events.py, the secondary offloading tier's in
vllm/v1/kv_offload/tiering/base.py and vllm/v1/kv_offload/base.py. Each
group is imported on its own, so a vLLM without the tiering layer still
gets its own connector classes. Without vLLM, minimal classes with the
methods, arguments and defaults those files declare: the connector's as of
vllm-project/vllm 00f4240ee6458263d76cf51ca7901ce1350bb4d1 (newer than
003df2961dd8830c317a61f9745ccd557da9fa06, which ferry followed before: it
adds get_transfer_results with KVConnectorTransferResults, finish_forward,
reset_capture_state, get_mem_pool_context, bind_kv_cache_manager,
has_pending_block_frees, register_finished_partial_tail, the prefix-replay
checkpoint pair and KVConnectorStats.to_dict, and drops the cross-layer
pair prefer_cross_layer_blocks / register_cross_layers_kv_cache, which
ferry's connector keeps for the engines that still call them), the tier's
as of cda0f3248538da3cc96b3760fe4cfaa7d3d652b9. So ferry's classes load and
can be driven through the engine's call sequence in tests. The stand-ins
are not vLLM: they carry no behaviour beyond what a subclass inherits.
"""
import enum
from abc import ABC, abstractmethod
from dataclasses import dataclass, field

try:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import (  # noqa: F401
        KVConnectorBase_V1, KVConnectorMetadata, KVConnectorRole)
    VLLM = True
except ImportError:
    VLLM = False

try:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import (  # noqa: F401
        KVConnectorTransferResults)
except ImportError:
    @dataclass
    class KVConnectorTransferResults:
        """Stand-in: one worker's snapshot of finished async transfers; a
        failed receive is in finished_recving as well as failed_recving."""
        finished_sending: set = field(default_factory=set)
        finished_recving: set = field(default_factory=set)
        failed_recving: set = field(default_factory=set)
        prefix_replay_checkpoints: dict = field(default_factory=dict)

try:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import SupportsHMA  # noqa: F401
except ImportError:
    class SupportsHMA(ABC):
        """Stand-in: a connector that supports vLLM's hybrid memory allocator."""

        @abstractmethod
        def request_finished_all_groups(self, request, block_ids):
            raise NotImplementedError

try:
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (  # noqa: F401
        KVConnectorPromMetrics, KVConnectorStats)
except ImportError:
    @dataclass
    class KVConnectorStats:
        """Stand-in: a connector's stats for one interval, as a dict."""
        data: dict = field(default_factory=dict)

        def to_dict(self):
            return self.data

        def reset(self):
            raise NotImplementedError

        def aggregate(self, other):
            raise NotImplementedError

        def reduce(self):
            raise NotImplementedError

        def is_empty(self):
            return not self.data

    class KVConnectorPromMetrics:
        """Stand-in: per-connector Prometheus metrics."""

        def __init__(self, vllm_config, metric_types, labelnames, per_engine_labelvalues):
            names = {t.__name__: c for t, c in metric_types.items()}
            self._kv_transfer_config = vllm_config.kv_transfer_config
            self._gauge_cls = names.get("Gauge")
            self._counter_cls = names.get("Counter")
            self._histogram_cls = names.get("Histogram")
            self._labelnames = labelnames
            self.per_engine_labelvalues = per_engine_labelvalues

        def make_per_engine(self, metric):
            return {idx: metric.labels(*vals) for idx, vals in self.per_engine_labelvalues.items()}

        def observe(self, transfer_stats_data, engine_idx=0):
            raise NotImplementedError

try:
    from vllm.distributed.kv_events import (  # noqa: F401
        AllBlocksCleared, BlockRemoved, BlockStored)
except ImportError:
    @dataclass
    class BlockStored:
        """Stand-in for vLLM's KV event: blocks became resident in `medium`."""
        block_hashes: list
        parent_block_hash: object
        token_ids: list
        block_size: int
        lora_id: object
        medium: object
        lora_name: object
        extra_keys: object = None
        group_idx: object = None
        kv_cache_spec_kind: object = None
        kv_cache_spec_sliding_window: object = None

    @dataclass
    class BlockRemoved:
        """Stand-in for vLLM's KV event: blocks left `medium`."""
        block_hashes: list
        medium: object
        group_idx: object = None

    @dataclass
    class AllBlocksCleared:
        """Stand-in for vLLM's KV event: every block was dropped."""

if not VLLM:
    class KVConnectorRole(enum.Enum):
        SCHEDULER = 0
        WORKER = 1

    class KVConnectorHandshakeMetadata(ABC):  # noqa: B024
        """Out-of-band handshake data between P/D workers."""

    class KVConnectorMetadata(ABC):  # noqa: B024
        """What the scheduler-side connector hands the workers for one step."""

    class KVConnectorWorkerMetadata(ABC):
        """What a worker-side connector hands back to the scheduler's."""

        @abstractmethod
        def aggregate(self, other):
            ...

    class KVConnectorBase_V1(ABC):
        """Stand-in for vLLM's KVConnectorBase_V1 (same method names, arguments
        and defaults; the engine's own class replaces it when vLLM is installed)."""

        @property
        def supports_divergent_local_hybrid_hits(self):
            return False

        @property
        def requires_kv_delivery(self):
            return bool(getattr(self._kv_transfer_config, "is_kv_producer", False))

        def __init__(self, vllm_config, role, kv_cache_config):
            self._connector_metadata = None
            self._vllm_config = vllm_config
            if getattr(vllm_config, "kv_transfer_config", None) is not None:
                self._kv_transfer_config = vllm_config.kv_transfer_config
            else:
                raise ValueError("kv_transfer_config must be set for KVConnectorBase_V1")
            self._kv_cache_config = kv_cache_config
            self._kv_cache_manager = None
            self._role = role

        @property
        def role(self):
            return self._role

        # worker side
        def get_mem_pool_context(self):
            return None

        def bind_connector_metadata(self, connector_metadata):
            self._connector_metadata = connector_metadata

        def clear_connector_metadata(self):
            self._connector_metadata = None

        def _get_connector_metadata(self):
            assert self._connector_metadata is not None
            return self._connector_metadata

        def has_connector_metadata(self):
            return self._connector_metadata is not None

        def register_kv_caches(self, kv_caches):
            return

        def set_host_xfer_buffer_ops(self, copy_operation):
            return

        def finish_forward(self):
            return

        def reset_capture_state(self):
            return

        def handle_preemptions(self, kv_connector_metadata):
            return

        @abstractmethod
        def start_load_kv(self, forward_context, **kwargs):
            ...

        @abstractmethod
        def wait_for_layer_load(self, layer_name):
            ...

        @abstractmethod
        def save_kv_layer(self, layer_name, kv_layer, attn_metadata, **kwargs):
            ...

        @abstractmethod
        def wait_for_save(self):
            ...

        def get_finished(self, finished_req_ids):
            return None, None

        def get_transfer_results(self, finished_req_ids):
            finished_sending, finished_recving = self.get_finished(finished_req_ids)
            return KVConnectorTransferResults(finished_sending=set(finished_sending or ()),
                                              finished_recving=set(finished_recving or ()))

        def get_block_ids_with_load_errors(self):
            return set()

        def shutdown(self):
            return None

        def get_kv_connector_stats(self):
            return None

        def get_kv_connector_kv_cache_events(self):
            return None

        def get_handshake_metadata(self):
            return None

        def build_connector_worker_meta(self):
            return None

        # scheduler side
        def bind_kv_cache_manager(self, kv_cache_manager):
            self._kv_cache_manager = kv_cache_manager
            self.bind_gpu_block_pool(kv_cache_manager.block_pool)

        def bind_gpu_block_pool(self, gpu_block_pool):
            return

        @abstractmethod
        def get_num_new_matched_tokens(self, request, num_computed_tokens):
            ...

        @abstractmethod
        def update_state_after_alloc(self, request, blocks, num_external_tokens):
            ...

        @abstractmethod
        def build_connector_meta(self, scheduler_output):
            ...

        def on_new_request(self, request):
            return

        def update_connector_output(self, connector_output):
            return

        def can_load_prefix_replay_checkpoint(self, request, num_local_tokens,
                                              num_external_tokens):
            return False

        def consume_prefix_replay_checkpoint(self, request, num_hit_tokens):
            return False

        def request_finished(self, request, block_ids):
            return False, None

        def register_finished_partial_tail(self, request, block_ids, partial_tail_offloads):
            return False

        def take_events(self):
            return ()

        def has_pending_block_frees(self):
            return False

        def has_pending_push_work(self):
            return False

        @classmethod
        def get_required_kvcache_layout(cls, vllm_config):
            if cls is KVConnectorBase_V1:
                raise TypeError("get_required_kvcache_layout should not be called "
                                "on the abstract base class")
            return None

        @classmethod
        def requires_piecewise_for_cudagraph(cls, extra_config):
            return False

        def get_finished_count(self):
            return None

        @classmethod
        def build_kv_connector_stats(cls, data=None):
            return None

        def set_xfer_handshake_metadata(self, metadata):
            return None

        def set_xfer_handshake_metadata_pp_aware(self, metadata):
            if any(pp_rank != 0 for pp_rank, _ in metadata):
                raise ValueError(f"{type(self).__name__} received pp_rank > 0 handshake "
                                 "metadata but does not support PP-disaggregated KV transfer.")
            self.set_xfer_handshake_metadata(
                {tp_rank: meta for (_, tp_rank), meta in metadata.items()})

        @classmethod
        def build_prom_metrics(cls, vllm_config, metric_types, labelnames,
                               per_engine_labelvalues):
            return None

        def reset_cache(self):
            return None
else:
    try:
        from vllm.distributed.kv_transfer.kv_connector.v1.base import (  # noqa: F401
            KVConnectorHandshakeMetadata)
    except ImportError:
        KVConnectorHandshakeMetadata = None
    try:
        from vllm.distributed.kv_transfer.kv_connector.v1.base import (  # noqa: F401
            KVConnectorWorkerMetadata)
    except ImportError:
        KVConnectorWorkerMetadata = None

# ---- the offloading connector's secondary tiers (vllm/v1/kv_offload) ----
try:
    from vllm.v1.kv_offload.base import (  # noqa: F401
        LookupResult, Medium, OffloadingEvent, ReqContext, RequestOffloadingContext)
    from vllm.v1.kv_offload.tiering.base import (  # noqa: F401
        JobResult, SecondaryTierManager, TransferJob)
    VLLM_TIERING = True
except ImportError:
    VLLM_TIERING = False

    class Medium(enum.Enum):
        CPU = "CPU"
        STORAGE = "STORAGE"

    class LookupResult(enum.Enum):
        MISS = enum.auto()
        HIT = enum.auto()
        HIT_PENDING = enum.auto()
        RETRY = enum.auto()

    @dataclass
    class ReqContext:
        req_id: str
        kv_transfer_params: object = None

    @dataclass
    class RequestOffloadingContext:
        policy: object = None

    @dataclass
    class OffloadingEvent:
        keys: list
        medium: Medium
        removed: bool
        locality: object = None
        ownership: object = None
        removal_expected: bool = False

    @dataclass
    class TransferJob:
        job_id: int
        keys: object
        chunk_ids: object
        is_promotion: bool
        req_context: ReqContext

    @dataclass
    class JobResult:
        job_id: int
        success: bool
        successful_keys: object = None
        transfer_time: object = None
        transfer_bytes: object = None

    class SecondaryTierManager(ABC):
        """Stand-in for vLLM's SecondaryTierManager: one tier behind the CPU
        primary, driven from the scheduler process without blocking."""

        medium = None

        def __init__(self, offloading_spec, primary_kv_view, tier_type,
                     backpressure_detector=None):
            self._offloading_spec = offloading_spec
            self._primary_kv_view = primary_kv_view
            assert primary_kv_view.strides is not None, "primary_kv_view.strides cannot be None"
            self._block_size_bytes = primary_kv_view.strides[0]
            self.tier_type = tier_type
            self.locality = None
            self._bp_detector = backpressure_detector

        @property
        def block_size_bytes(self):
            return self._block_size_bytes

        @property
        def bp_detector(self):
            return self._bp_detector

        @abstractmethod
        def lookup(self, key, req_context):
            ...

        @abstractmethod
        def submit_store(self, job_metadata):
            ...

        @abstractmethod
        def submit_load(self, job_metadata):
            ...

        @abstractmethod
        def get_finished_jobs(self):
            ...

        def has_pending_work(self):
            return False

        def take_events(self):
            return ()

        def touch(self, keys, req_context):
            return

        @abstractmethod
        def on_new_request(self, req_context):
            ...

        def on_request_finished(self, req_context):
            return

        def serve_external_requests(self, parent):
            return

        def on_schedule_end(self, context):
            return

        @abstractmethod
        def drain_jobs(self):
            ...

        def shutdown(self):
            return

        @classmethod
        def build_metric_definitions(cls, extra_config):
            return {}

        def get_stats(self):
            return None


__all__ = ["KVConnectorBase_V1", "KVConnectorMetadata", "KVConnectorRole", "SupportsHMA",
           "KVConnectorTransferResults", "KVConnectorWorkerMetadata",
           "KVConnectorHandshakeMetadata",
           "KVConnectorStats", "KVConnectorPromMetrics", "BlockStored", "BlockRemoved",
           "AllBlocksCleared", "VLLM", "VLLM_TIERING", "SecondaryTierManager", "TransferJob",
           "JobResult", "LookupResult", "Medium", "OffloadingEvent", "ReqContext",
           "RequestOffloadingContext"]
