"""vLLM's KV connector base classes, or stand-ins with the same surface.

With vLLM installed, these are vLLM's own (vllm/distributed/kv_transfer/
kv_connector/v1/base.py). Without it, minimal classes with the methods the
engine calls and ferry's connector uses, so the connector loads and can be
driven through the engine's call sequence in tests. The stand-ins are not
vLLM: they carry no behaviour beyond holding the step's metadata.
"""
import enum
from abc import ABC, abstractmethod

try:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import (  # noqa: F401
        KVConnectorBase_V1, KVConnectorMetadata, KVConnectorRole)
    VLLM = True
except ImportError:
    VLLM = False

    class KVConnectorRole(enum.Enum):
        SCHEDULER = 0
        WORKER = 1

    class KVConnectorMetadata(ABC):  # noqa: B024
        """What the scheduler-side connector hands the workers for one step."""

    class KVConnectorBase_V1(ABC):
        """Stand-in for vLLM's KVConnectorBase_V1 (same method names and
        arguments; the engine's own class replaces it when vLLM is installed)."""

        def __init__(self, vllm_config, role, kv_cache_config=None):
            self._connector_metadata = None
            self._vllm_config = vllm_config
            self._kv_transfer_config = getattr(vllm_config, "kv_transfer_config", None)
            if self._kv_transfer_config is None:
                raise ValueError("kv_transfer_config must be set for KVConnectorBase_V1")
            self._kv_cache_config = kv_cache_config
            self._role = role

        @property
        def role(self):
            return self._role

        # worker side
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

        def get_block_ids_with_load_errors(self):
            return set()

        def shutdown(self):
            return None

        # scheduler side
        @abstractmethod
        def get_num_new_matched_tokens(self, request, num_computed_tokens):
            ...

        @abstractmethod
        def update_state_after_alloc(self, request, blocks, num_external_tokens):
            ...

        @abstractmethod
        def build_connector_meta(self, scheduler_output):
            ...

        def update_connector_output(self, connector_output):
            return

        def request_finished(self, request, block_ids):
            return False, None

__all__ = ["KVConnectorBase_V1", "KVConnectorMetadata", "KVConnectorRole", "VLLM"]
