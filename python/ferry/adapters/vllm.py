"""ferry as a vLLM v1 KV connector (KVConnectorBase_V1).

vLLM loads it through its external connector setting:

    from vllm.config import KVTransferConfig
    KVTransferConfig(kv_connector="FerryConnector",
                     kv_connector_module_path="ferry.adapters.vllm",
                     kv_role="kv_both",
                     kv_connector_extra_config={"ferry.store": "main"})

and builds one instance per role: the scheduler's (lookups and per-step
plans) and each worker's (moving KV between vLLM's paged caches and the
store).

Where the store comes from (kv_connector_extra_config):
  "ferry.store": the name of a ferry.KVStore registered in this process
      with ferry.adapters.register_store() (default "vllm"). A worker that
      finds none and is given "ferry.l1" opens one itself when vLLM
      registers its caches (the layout is read from them; device="cuda:N"
      when they are CUDA tensors) with "ferry.l2", "ferry.model",
      "ferry.chunk_tokens", "ferry.persistent", and registers it under that
      name for a scheduler in the same process (vLLM's single-process
      executor).
  "ferry.server": a `ferry serve` address ("unix:/run/ferry/ferry.sock"),
      for a scheduler and workers in separate processes (or separate
      engines sharing one cache). When no store is registered under
      "ferry.store", each worker opens KVStore(server=...) when vLLM
      registers its caches (layout read from them; device="cuda:N" when
      they are CUDA tensors, so they move as device buffers), and the
      scheduler opens a lookup-only client (lookup, pin and unpin; it maps
      no pool) whose layout comes from "ferry.layout" ({"num_layers",
      "num_kv_heads", "head_dim", "dtype", "mla"}) or, without it, from
      vLLM's model_config (get_num_layers, get_num_kv_heads, get_head_size,
      dtype, use_mla). "ferry.chunk_tokens" must match the daemon's.

Two forms of the four worker methods that move KV, chosen with
"ferry.layerwise" in kv_connector_extra_config (default False):
  - whole: start_load_kv loads every layer of every planned request before
    the forward pass, wait_for_layer_load returns at once, save_kv_layer
    records nothing, and wait_for_save stores each planned request's new
    whole chunks from all layers after the forward;
  - layerwise (True): start_load_kv starts a layer-by-layer retrieve per
    planned load (KVStore.retrieve_layers: the chunks held in ferry, then
    copied layer 0 first) and returns; wait_for_layer_load(layer) waits
    until that layer of every load landed, so layer l's attention runs
    while later layers still load; the first save_kv_layer of a step
    starts a layer-by-layer store per planned save (its slots reserved)
    and every save_kv_layer(layer) hands that layer over as soon as the
    forward wrote it; wait_for_save waits until the last layer was copied
    and the chunks stored. A store that misses a layer (a layer vLLM did
    not call save_kv_layer for) is cancelled and stores nothing.
The plan (FerryConnectorMetadata) is the same for both.

What it promises vLLM. get_num_new_matched_tokens answers with the
whole chunks ferry holds beyond vLLM's own prefix cache (never the last
prompt token, which vLLM must compute). Once vLLM has allocated blocks
for them, the chunks are pinned until the request finishes, so eviction
cannot take them between the plan and the load. A load that still comes
up short (a chunk failed its checksum, an L2 read failed) reports the
blocks it did not fill through get_block_ids_with_load_errors, so vLLM
recomputes them instead of reading stale blocks. Blocks holding vLLM's
own prefix-cache hit are never written: when vLLM already computed part of
a prefix, the retrieve skips those tokens (the request's skip_tokens) and
writes only the rest into vLLM's blocks, zero-copy as every load is. vLLM's cache_salt is ferry's salt, with the identities of a request's
multimodal inputs added (their placeholder token ids do not tell images
apart). Only prompt tokens are
stored, in whole chunks; decode tokens are not.

One KV cache group (no hybrid allocator: the connector does not declare
SupportsHMA, so vLLM keeps one group for it); block ids are group 0's.

Engine versions: written against vLLM's KVConnectorBase_V1 of 2025-2026
(three-argument constructor with kv_cache_config, also the older two); its
caches are per layer [2, num_blocks, block_size, heads, head_dim]
(FlashAttention), [num_blocks, 2, ...] (FlashInfer, used through a
transposed view) or [num_blocks, block_size, head_dim] (MLA), on the CPU or
on a GPU. CUDA caches are libferry device buffers at their data_ptr(),
copied by the device's copy engines, never through Python: the store a
worker opens itself ("ferry.l1" or "ferry.server") is opened on the
caches' GPU (KVStore(device="cuda:N")); a registered store must have been
opened with that device, else register_kv_caches refuses the caches with
a ValueError naming the device they need.
"""
import errno
import inspect
import logging
import re
from dataclasses import dataclass, field

from .. import errors
from .._buffers import Buffer
from ..errors import FerryError
from ..kv import KVStore, Layout
from . import register_store, registered_store
from ._vllm_base import VLLM, KVConnectorBase_V1, KVConnectorMetadata, KVConnectorRole

try:
    import torch
except ImportError:  # pragma: no cover - vLLM always has torch
    torch = None

log = logging.getLogger("ferry.vllm")

# a save that finds the store full is a future miss, not a failed step
_SKIPPABLE = {getattr(errors, "ENOSPACE", None), getattr(errors, "ELOCKED", None), -errno.ENOMEM}


@dataclass
class LoadSpec:
    """Load tokens[:len(tokens)] (whole chunks) into the request's blocks,
    writing only from token `skip` on; vLLM counts on tokens [skip, need)."""
    req_id: str
    tokens: list
    block_ids: list
    skip: int
    need: int
    salt: object = None


@dataclass
class SaveSpec:
    """Store tokens (whole chunks) from the request's blocks."""
    req_id: str
    tokens: list
    block_ids: list
    salt: object = None


@dataclass
class FerryConnectorMetadata(KVConnectorMetadata):
    loads: list = field(default_factory=list)
    saves: list = field(default_factory=list)


@dataclass
class _Req:
    """The scheduler side's view of one request."""
    tokens: list
    salt: object = None
    prompt_len: int = 0
    local: int = 0          # tokens vLLM's own prefix cache had
    hit: int = 0            # tokens (whole chunks) ferry had at the lookup
    load: object = None     # (skip, need) once vLLM allocated blocks for a load
    pinned: int = 0         # leading tokens this request holds pinned
    saved: int = 0          # leading tokens known to be in ferry
    block_ids: list = field(default_factory=list)


def _extra(vllm_config):
    ktc = getattr(vllm_config, "kv_transfer_config", None)
    extra = getattr(ktc, "kv_connector_extra_config", None) or {}
    return dict(extra)


def _tp_rank_world(vllm_config, rank=True):
    """This worker's tensor-parallel rank and world size (0, 1 outside vLLM)."""
    pc = getattr(vllm_config, "parallel_config", None)
    world = int(getattr(pc, "tensor_parallel_size", 1) or 1)
    if world == 1 or not rank:
        return 0, world
    from vllm.distributed import get_tensor_model_parallel_rank
    return get_tensor_model_parallel_rank(), world


def _config_layout(vllm_config, extra):
    """The KV layout per TP rank for a scheduler that has no caches to read it
    from: "ferry.layout", else vLLM's ModelConfig."""
    spec = extra.get("ferry.layout")
    if spec:
        return Layout.from_model(int(spec["num_layers"]), int(spec["num_kv_heads"]),
                                 int(spec["head_dim"]), spec.get("dtype", "bf16"),
                                 mla=bool(spec.get("mla", False)))
    mc = getattr(vllm_config, "model_config", None)
    pc = getattr(vllm_config, "parallel_config", None)
    try:
        return Layout.from_model(mc.get_num_layers(pc), mc.get_num_kv_heads(pc),
                                 mc.get_head_size(), mc.dtype,
                                 mla=bool(getattr(mc, "use_mla", False)))
    except AttributeError as e:
        raise ValueError("ferry: vLLM connector: the scheduler's \"ferry.server\" client "
                         "needs the KV layout: give \"ferry.layout\" (num_layers, "
                         "num_kv_heads, head_dim, dtype) or a vLLM model_config") from e


def _salt_of(request):
    """ferry's salt for a request: vLLM's cache_salt, and the identities of
    its multimodal inputs (their placeholder token ids are the same for any
    image, so a prefix with another image must not match)."""
    salt = getattr(request, "cache_salt", None)
    mm = [str(getattr(f, "identifier", f)) for f in getattr(request, "mm_features", None) or []]
    mm = mm or [str(h) for h in getattr(request, "mm_hashes", None) or []]
    if mm:
        salt = (salt or "") + "\0mm\0" + "\0".join(mm)
    return salt


def _layer_order(names):
    """vLLM's layer names in layer order ("model.layers.7.self_attn.attn")."""
    idx = {}
    for n in names:
        m = re.search(r"\d+", n)
        if m is None:
            return list(names)
        idx[n] = int(m.group())
    return sorted(names, key=lambda n: idx[n])


def paged_view(cache):
    """One layer's vLLM cache as ferry's paged form: [2, blocks, block_size,
    heads, head_dim] as it is, FlashInfer's [blocks, 2, ...] transposed (a
    view, no copy), MLA's [blocks, block_size, head_dim] as it is."""
    shape = tuple(cache.shape)
    if len(shape) == 5 and shape[0] == 2:
        return cache
    if len(shape) == 5 and shape[1] == 2:
        return cache.transpose(0, 1)
    if len(shape) == 3:
        return cache
    raise ValueError(f"ferry: vLLM cache of shape {list(shape)} is none of [2, blocks, "
                     "block_size, heads, head_dim], [blocks, 2, ...], [blocks, block_size, dim]")


class FerryConnector(KVConnectorBase_V1):
    """ferry's KV connector for vLLM v1 (see the module's documentation)."""

    def __init__(self, vllm_config, role, kv_cache_config=None):
        params = inspect.signature(KVConnectorBase_V1.__init__).parameters
        if "kv_cache_config" in params:
            super().__init__(vllm_config, role, kv_cache_config)
        else:  # vLLM before kv_cache_config was passed to connectors
            super().__init__(vllm_config, role)
        self._extra = _extra(vllm_config)
        self._server = self._extra.get("ferry.server") or None
        self._name = self._extra.get("ferry.store", "vllm")
        self._store = None
        self._opened = False
        # scheduler side
        self._reqs = {}
        # worker side
        self._caches = None
        self._layout = None
        self._block_size = 0
        self._load_errors = set()
        self.saves_skipped = 0
        self._layerwise = str(self._extra.get("ferry.layerwise", False)).lower() in (
            "1", "true", "yes")
        self._layer_index = {}
        self._loading = []      # (LoadSpec, LayerOp) of this step's layerwise loads
        self._saving = None     # (SaveSpec, LayerOp) of this step's layerwise saves

    # ---- the store ----
    @property
    def store(self):
        if self._store is None:
            self._store = registered_store(self._name)
            if self._store is None and self._server:
                self._store = self._open_lookup_client()
            if self._store is None:
                raise RuntimeError(
                    f"ferry: vLLM connector: no store registered as {self._name!r} in this "
                    "process (ferry.adapters.register_store, or \"ferry.l1\" for the worker "
                    "to open one); a scheduler in another process than the workers needs "
                    "\"ferry.server\"")
        return self._store

    def _open_lookup_client(self):
        """The scheduler's client of "ferry.server": lookups and pins only."""
        e = self._extra
        mc = getattr(self._vllm_config, "model_config", None)
        _, world = _tp_rank_world(self._vllm_config, rank=False)
        s = KVStore(model=str(e.get("ferry.model", getattr(mc, "model", "vllm"))),
                    layout=_config_layout(self._vllm_config, e), server=self._server,
                    lookup_only=True, chunk_tokens=int(e.get("ferry.chunk_tokens", 0)),
                    tp_rank=0, tp_world=world)
        self._opened = True
        return s

    def _open_store(self, layout, device=None):
        """The worker's store: the registered one, or one opened from the config."""
        found = registered_store(self._name)
        if found is None and self._server:
            e = self._extra
            mc = getattr(self._vllm_config, "model_config", None)
            rank, world = _tp_rank_world(self._vllm_config)
            found = KVStore(model=str(e.get("ferry.model", getattr(mc, "model", "vllm"))),
                            layout=layout, server=self._server,
                            chunk_tokens=int(e.get("ferry.chunk_tokens", 0)),
                            tp_rank=rank, tp_world=world, device=device)
            register_store(self._name, found)
            self._opened = True
        if found is None and "ferry.l1" in self._extra:
            e = self._extra
            mc = getattr(self._vllm_config, "model_config", None)
            rank, world = _tp_rank_world(self._vllm_config)
            found = KVStore(model=str(e.get("ferry.model", getattr(mc, "model", "vllm"))),
                            layout=layout, l1=e["ferry.l1"], l2=e.get("ferry.l2"),
                            chunk_tokens=int(e.get("ferry.chunk_tokens", 0)),
                            persistent=bool(e.get("ferry.persistent", False)),
                            tp_rank=rank, tp_world=world, device=device)
            register_store(self._name, found)
            self._opened = True
        self._store = found
        return self.store

    # ==== scheduler side ====
    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        """Tokens ferry can supply beyond vLLM's num_computed_tokens, and
        False: loads are synchronous (done before the step's forward)."""
        tokens = list(getattr(request, "all_token_ids", None) or request.prompt_token_ids or [])
        salt = _salt_of(request)
        prompt = getattr(request, "prompt_token_ids", None)
        st = self._reqs.get(request.request_id)
        if st is None:
            st = self._reqs[request.request_id] = _Req(tokens=tokens)
        st.tokens, st.salt = tokens, salt
        st.prompt_len = len(prompt) if prompt is not None else len(tokens)
        st.local = num_computed_tokens
        st.hit = self.store.lookup(tokens, salt=salt) if tokens else 0
        st.saved = max(st.saved, st.hit)
        usable = min(st.hit, len(tokens) - 1)   # vLLM computes at least the last token
        return max(0, usable - num_computed_tokens), False

    def update_state_after_alloc(self, request, blocks, num_external_tokens):
        """vLLM allocated blocks: a load is planned when num_external_tokens > 0;
        its chunks are pinned until the request finishes."""
        st = self._reqs.get(request.request_id)
        if st is None:
            return
        if num_external_tokens <= 0:
            st.load = None
            self._unpin(st)
            return
        skip, need = st.local, st.local + num_external_tokens
        self._unpin(st)
        chunk = self.store.chunk_tokens
        end = min(st.hit, -(-need // chunk) * chunk)
        st.pinned = self.store.pin(st.tokens[:end], salt=st.salt) if end else 0
        st.load = (skip, need, end)

    def build_connector_meta(self, scheduler_output):
        """This step's loads (planned by update_state_after_alloc) and saves
        (each scheduled request's prompt chunks completed by this step)."""
        meta = FerryConnectorMetadata()
        sched = scheduler_output.num_scheduled_tokens
        for new in scheduler_output.scheduled_new_reqs:
            st = self._reqs.get(new.req_id)
            if st is None and getattr(new, "mm_features", None):
                continue  # never looked up: its multimodal salt is unknown here
            if st is None:
                toks = list(new.prompt_token_ids or [])
                st = self._reqs[new.req_id] = _Req(tokens=toks, prompt_len=len(toks))
            st.block_ids = list(new.block_ids[0])
            self._plan(meta, new.req_id, st, new.num_computed_tokens + sched.get(new.req_id, 0))
        cached = scheduler_output.scheduled_cached_reqs
        resumed_ids = getattr(cached, "resumed_req_ids", None)
        for i, rid in enumerate(cached.req_ids):
            st = self._reqs.get(rid)
            if st is None:
                continue
            if resumed_ids is not None:
                resumed = rid in resumed_ids
            else:  # vLLM before resumed_req_ids: a per-request flag list
                resumed = bool(cached.resumed_from_preemption[i])
            new_ids = cached.new_block_ids[i]
            if new_ids is not None:
                st.block_ids = list(new_ids[0]) if resumed else st.block_ids + list(new_ids[0])
            self._plan(meta, rid, st, cached.num_computed_tokens[i] + sched.get(rid, 0))
        return meta

    def _plan(self, meta, rid, st, computed):
        if st.load is not None:
            skip, need, end = st.load
            meta.loads.append(LoadSpec(rid, st.tokens[:end], list(st.block_ids), skip, need,
                                       st.salt))
            st.load = None
        chunk = self.store.chunk_tokens
        end = min(computed, st.prompt_len) // chunk * chunk
        if end > st.saved:
            meta.saves.append(SaveSpec(rid, st.tokens[:end], list(st.block_ids), st.salt))
            st.saved = end

    def request_finished(self, request, block_ids):
        """The request is done (or aborted): drop its pins and state. Saves are
        synchronous, so vLLM may free its blocks at once."""
        st = self._reqs.pop(request.request_id, None)
        if st is not None:
            self._unpin(st)
        return False, None

    def _unpin(self, st):
        if st.pinned:
            self.store.unpin(st.tokens[:st.pinned], salt=st.salt)
            st.pinned = 0

    # ==== worker side ====
    def register_kv_caches(self, kv_caches):
        """vLLM's per-layer caches (layer name -> tensor), in layer order."""
        names = _layer_order(list(kv_caches))
        caches = [paged_view(kv_caches[n]) for n in names]
        layout = Layout.from_kv_caches(caches)
        dev = caches[0].device if torch is not None and isinstance(caches[0], torch.Tensor) \
            else None
        store = self._open_store(layout, f"cuda:{dev.index or 0}"
                                 if dev is not None and dev.type == "cuda" else None)
        if store.layout != layout:
            raise ValueError(f"ferry: vLLM's caches are {layout}, the store {self._name!r} "
                             f"holds {store.layout}")
        store._buffer(caches, [0], True)  # dtype, device, strides: refused now
        self._layer_names = names
        self._layer_index = {n: i for i, n in enumerate(names)}
        self._caches = caches
        self._layout = layout
        self._block_size = caches[0].shape[2] if layout.kv == 2 else caches[0].shape[1]

    def start_load_kv(self, forward_context, **kwargs):
        """Load every planned request's chunks into its blocks, all layers."""
        if not self.has_connector_metadata():
            return
        for spec in self._get_connector_metadata().loads:
            if self._layerwise:
                self._load_start(spec)
            else:
                self._load(spec)

    def _load(self, spec):
        if self._caches is None:
            raise RuntimeError("ferry: vLLM connector: a load before register_kv_caches")
        if not spec.tokens:
            got = 0
        else:  # tokens below spec.skip are vLLM's own blocks: never written
            got = self.store.retrieve(spec.tokens, self._caches, spec.block_ids, salt=spec.salt,
                                      skip=spec.skip)
        self._loaded(spec, got)

    def _load_start(self, spec):
        """Layerwise: start the load; its layers are waited for one by one."""
        if self._caches is None:
            raise RuntimeError("ferry: vLLM connector: a load before register_kv_caches")
        if not spec.tokens:
            self._loaded(spec, 0)
            return
        op = self.store.retrieve_layers(spec.tokens, self._caches, spec.block_ids,
                                        salt=spec.salt, skip=spec.skip)
        self._loading.append((spec, op))

    def _load_finish(self):
        """Layerwise: every load of the step is over; report what came short."""
        loading, self._loading = self._loading, []
        for spec, op in loading:
            try:
                got = op.wait()
            except FerryError as e:
                log.warning("ferry: request %s: layerwise load failed: %s", spec.req_id, e)
                got = 0
            self._loaded(spec, got)

    def _loaded(self, spec, got):
        if got < spec.need:
            bs = self._block_size
            first = max(got, spec.skip) // bs
            last = -(-spec.need // bs)
            self._load_errors.update(spec.block_ids[first:last])
            log.warning("ferry: request %s: loaded %d of %d tokens; blocks %s left to vLLM "
                        "to recompute", spec.req_id, got, spec.need, spec.block_ids[first:last])

    def wait_for_layer_load(self, layer_name):
        """Layerwise: until this layer of every planned load is in vLLM's
        blocks (whole form: start_load_kv loaded every layer already)."""
        if not self._loading:
            return
        idx = self._layer_index[layer_name]
        for spec, op in self._loading:
            try:
                op.wait_layer(idx)
            except FerryError as e:  # reported, with its blocks, when the loads end
                log.debug("ferry: request %s: layer %d: %s", spec.req_id, idx, e)
        if idx == len(self._layer_index) - 1:
            self._load_finish()

    def save_kv_layer(self, layer_name, kv_layer, attn_metadata, **kwargs):
        """Layerwise: hand this layer of every planned save over as soon as
        the forward wrote it (whole form: wait_for_save stores all layers)."""
        if not self._layerwise or not self.has_connector_metadata():
            return
        if self._saving is None:
            self._saving = []
            for spec in self._get_connector_metadata().saves:
                try:
                    op = self.store.store_layers(spec.tokens, self._caches, spec.block_ids,
                                                 salt=spec.salt)
                except FerryError as e:
                    if e.code not in _SKIPPABLE:
                        raise
                    self.saves_skipped += 1
                    log.warning("ferry: request %s: store skipped: %s", spec.req_id, e)
                    continue
                self._saving.append((spec, op))
        idx = self._layer_index[layer_name]
        for spec, op in self._saving:
            op.layer_done(idx)

    def _save_finish(self):
        saving, self._saving = self._saving or [], None
        for spec, op in saving:
            try:
                op.wait()
            except FerryError as e:
                if op.done() is False:  # a layer never came: store nothing
                    op.cancel()
                    self.saves_skipped += 1
                    log.warning("ferry: request %s: layerwise store missed layers; "
                                "cancelled: %s", spec.req_id, e)
                    continue
                if e.code not in _SKIPPABLE:
                    raise
                self.saves_skipped += 1
                log.warning("ferry: request %s: store skipped: %s", spec.req_id, e)

    def wait_for_save(self):
        """Store this step's planned chunks from all layers (after the forward
        wrote them); layerwise: wait until every layer was handed over and the
        chunks are stored. A store that finds ferry full is skipped and counted."""
        if self._loading:  # (a forward that skipped some layer's wait)
            self._load_finish()
        if not self.has_connector_metadata():
            return
        if self._layerwise:
            self._save_finish()
            return
        for spec in self._get_connector_metadata().saves:
            try:
                self.store.store(spec.tokens, self._caches, spec.block_ids, salt=spec.salt)
            except FerryError as e:
                if e.code not in _SKIPPABLE:
                    raise
                self.saves_skipped += 1
                log.warning("ferry: request %s: store skipped: %s", spec.req_id, e)

    def get_finished(self, finished_req_ids):
        return None, None  # nothing asynchronous

    def get_block_ids_with_load_errors(self):
        out, self._load_errors = self._load_errors, set()
        return out

    def shutdown(self):
        if self._opened and self._store is not None:
            unregister = registered_store(self._name) is self._store
            if unregister:
                from . import unregister_store
                unregister_store(self._name)
            self._store.close()
            self._opened = False
        self._store = None


__all__ = ["FerryConnector", "FerryConnectorMetadata", "LoadSpec", "SaveSpec", "KVConnectorRole",
           "VLLM", "paged_view"]
