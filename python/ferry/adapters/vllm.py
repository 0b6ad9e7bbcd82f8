"""ferry as a vLLM v1 KV connector (KVConnectorBase_V1).

vLLM loads it through its external connector setting:

    from vllm.config import KVTransferConfig
    KVTransferConfig(kv_connector="FerryConnector",
                     kv_connector_module_path="ferry.adapters.vllm",
                     kv_role="kv_both",
                     kv_connector_extra_config={"ferry.store": "main"})

and builds one instance per role: the scheduler's (lookups and per-step
plans) and each worker's (moving KV between vLLM's paged caches and the
store). The name "FerryConnector" is registered with vLLM's
KVConnectorFactory too, by the package's "vllm.general_plugins" entry point
in each vLLM process and by loading this module: inside a MultiConnector,
vLLM's API server rebuilds each child's stats by its class name. The name
never shadows a user's own "FerryConnector" given by
kv_connector_module_path: that class is what vLLM builds (_factory_choice).

Where the store comes from (kv_connector_extra_config):
  "ferry.store": the name of a ferry.KVStore registered in this process
      with ferry.adapters.register_store() (default "vllm"). A worker that
      finds none and is given "ferry.l1" opens one itself when vLLM
      registers its caches (the layout is read from them; device="cuda:N"
      when they are CUDA tensors) with "ferry.l2", "ferry.model",
      "ferry.chunk_tokens", "ferry.persistent", and registers it under that
      name for a scheduler in the same process (vLLM's single-process
      executor); a connector of another model in that process finding it
      there is refused, naming both models (it would load the first
      model's KV: give each model its own "ferry.store"), and so is one of
      another TP rank, TP size or pipeline size (another engine: its
      chunks are other heads and layers, under other keys). A scheduler
      that finds no store there runs apart from its
      workers (multiprocessing executor) and cannot see what they store:
      it is refused when vLLM builds it, with a ValueError naming
      "ferry.server". An L2 directory has one owner, so "ferry.l2": "DIR:SIZE"
      gives each worker DIR/vllm-pp<s>of<S>-dp<d>-tp<r>of<T> of SIZE
      (pipeline stage, data-parallel replica, tensor-parallel rank; with
      prefill context parallelism -pcp<c>of<C> before -tp, since vLLM runs
      C processes of each TP rank): the same worker of the same topology
      finds its persistent L2 again. A
      slab an earlier ferry left in DIR itself (one worker opened DIR) is
      not read: a warning names it once, and where to move it to keep it.
  "ferry.server": a `ferry serve` address ("unix:/run/ferry/ferry.sock"),
      for a scheduler and workers in separate processes (or separate
      engines sharing one cache). When no store is registered under
      "ferry.store", each worker opens KVStore(server=...) when vLLM
      registers its caches (layout read from them; device="cuda:N" when
      they are CUDA tensors, so they move as device buffers), and the
      scheduler opens a lookup-only client (lookup, pin and unpin; it maps
      no pool) per TP rank (each rank stores its own heads under its own
      keys, and a hit is what every rank holds, pinned on every rank) whose
      layout comes from "ferry.layout" ({"num_layers",
      "num_kv_heads", "head_dim", "dtype", "mla"}) or, without it, from
      vLLM's model_config (get_num_layers, get_num_kv_heads, get_head_size,
      dtype, use_mla), its layers counted from the scheduler's
      kv_cache_config when that names them at one pipeline stage (the
      workers' layout is the caches of a KV cache group: a speculative
      drafter's layers are among them) and its dtype that of the group's
      KV cache spec (an fp8 KV cache is uint8), or of cache_config.cache_dtype
      on a vLLM that passes no kv_cache_config ("ferry.layout"'s dtype may
      be vLLM's cache dtype name: "fp8", "fp8_e4m3", "fp8_e5m2" are u8, as
      the workers' caches). A quantized KV cache's format (cache_dtype but
      "auto" and plain float ones; "fp8" is fp8_e4m3) is in every key: one
      format's chunks are never another's, though their layouts are one. "ferry.chunk_tokens" must match the daemon's.
      With pipeline parallelism every stage's worker is the same TP rank of
      the same model, but holds only its stage's layers: each stage's chunks
      are keyed apart, and the scheduler counts a chunk as a hit only once
      every stage holds it. Its lookup asks those keys (TP ranks x KV cache
      groups x stages, one daemon round trip each: a lookup of the
      protocol is one key) one after the other, each for the chunks the
      least so far covers, and stops at the first that holds none. The
      PCP ranks of one TP rank each hold the whole sequence's KV of its
      heads (vLLM shards no KV across PCP), the same bytes under the same
      keys. Decode context parallelism (vLLM's decode_context_parallel_size
      above one: each rank's block holds every Nth token of N blocks'
      worth) is refused when vLLM builds the connector, naming the
      setting: ferry's chunks are blocks of consecutive tokens.
      Under distributed_executor_backend "external_launcher" (torchrun, as
      verl and OpenRLHF run vLLM) every rank is an engine of its own, its
      scheduler beside its one worker, and the ranks of an engine stay in
      step only while they schedule alike: at TP x PP x PCP above one
      "ferry.server" is required (a store in a rank's process, "ferry.l1" or
      registered, is refused when vLLM builds the connector, as are
      "ferry.async_load" and "ferry.async_save", whose transfers end at a
      step of each rank's own). Each rank's scheduler then asks the daemon
      for every rank's keys, and the ranks agree on the least of their
      answers (an all-reduce over a gloo group of the engine's ranks, made
      when vLLM builds the scheduler): a store that lands between two
      ranks' lookups makes no hit one rank has and another has not. Each
      rank's worker reports its load errors to its own rank's scheduler
      alone, so the workers agree each step's loads over the same group
      (the least tokens each load got on any rank) before they report:
      a load short on one rank is recomputed, or failed, on every rank.

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
writes only the rest into vLLM's blocks, zero-copy as every load is.
vLLM's cache_salt is ferry's salt, with what else vLLM keys its own prefix
cache by added: the LoRA adapter's name, the identities of the request's
multimodal inputs and a digest of its prompt embeddings (placeholder
token ids tell neither images nor embeddings apart). A request the
connector was never asked about (get_num_new_matched_tokens) is not
stored: the step's NewRequestData does not carry its cache_salt. Only
prompt tokens are stored, in whole chunks; decode tokens are not. A
streaming session (vLLM's resumable requests) is one request over its
rounds: each round's prompt holds what the rounds before it computed
(their prompts and kept output tokens) and the round's input, and the
round's chunks are stored keyed by those tokens and the round's salt (its
images included), as vLLM tells the round's start through
update_state_after_alloc alone.

KV cache groups (SupportsHMA): the connector reads vLLM's groups from
kv_cache_config. Full-attention and sliding-window groups are cached, each
group's chunks keyed apart (group 0 keeps the request's salt); a
sliding-window group is loaded only inside its window, and a save of it
reads no block below its window (vLLM has given those back): its chunks
there must be in ferry already, else the group's save is skipped. A group of any other
kind (Mamba state, ...) turns the connector off for that model, with a
warning: a hit must cover every group. Options: "ferry.async_load" (loads
vLLM does not wait for, reported through get_finished), "ferry.async_save"
(stores not waited for; the request's blocks are kept until they end; a
sliding-window group's are waited for, its blocks freed while it runs;
with "ferry.layerwise" it does nothing: layerwise stores end in their step),
"ferry.kv_events" (KV events without vLLM's kv_events_config),
"ferry.kv_cache_layout" (a layout to ask vLLM for). A boolean setting is a
JSON boolean or one of the strings true/false, 1/0, yes/no, on/off (as a
YAML file or an environment variable carries it); any other value is
refused with a ValueError when the connector is built. So is a "ferry.*"
key the connector does not read (a misspelling would switch nothing) and
a value its setting cannot take: "ferry.chunk_tokens" not a count (a
decimal string or a whole float such as 16.0 is one; so in
"ferry.layout"), "ferry.l1" not a size, "ferry.l2" not
"DIR:SIZE" or a list of them of one SIZE, "ferry.layout" short of a field
(its "mla" is a boolean setting; its "dtype" ferry's name or vLLM's:
"bf16" or "bfloat16"), an empty "ferry.store" or "ferry.model", a
"ferry.kv_cache_layout" other than NHD or HND; each error names its key.
A setting written as null (JSON null, an empty YAML value) is not set.
FerrySecondaryTier, at the end of this module, is ferry behind vLLM's own
OffloadingConnector.

Engine versions: written against vLLM's KVConnectorBase_V1 of 2025-2026
(three-argument constructor with kv_cache_config, also the older two), up
to vllm-project/vllm 00f4240ee6458263d76cf51ca7901ce1350bb4d1: there the
workers report through get_transfer_results (ferry's answers it), start
async-only loads after the forward, and the scheduler refuses block-level
load errors for a model of several KV cache groups, so on such an engine a
hybrid model's loads are async and a failed one is reported for its
request (failed_recving); has_pending_block_frees holds off preemption
while finished requests' blocks wait on ferry. The cross-layer pair
(prefer_cross_layer_blocks, register_cross_layers_kv_cache) is kept for
the engines that still call it, as is handle_preemptions in both forms:
the step's metadata (00f4240e) or, on engines as old as vllm-project/vllm
13f4ad0f55b08ca1d37d1459f50ce950feaeb547, the set of preempted request
ids (either way a preempted request's async stores end before vLLM reuses
its blocks). Its caches are per layer [2, num_blocks, block_size, heads, head_dim]
(FlashAttention), [num_blocks, 2, ...] (FlashInfer, used through a
transposed view) or [num_blocks, block_size, head_dim] (MLA), on the CPU or
on a GPU. CUDA caches are libferry device buffers at their data_ptr(),
copied by the device's copy engines, never through Python: the store a
worker opens itself ("ferry.l1" or "ferry.server") is opened on the
caches' GPU (KVStore(device="cuda:N")); a registered store must have been
opened with that device, else register_kv_caches refuses the caches with
a ValueError naming the device they need.
"""
import dataclasses
import errno
import hashlib
import inspect
import logging
import os
import re
import sys
from dataclasses import dataclass, field
from stat import S_ISREG

import numpy as np

from .. import errors
from .._buffers import Buffer
from ..errors import FerryError
from ..kv import KVStore, Layout, hash_chunks, parse_size
from . import (_check_opener, _mark_opener, register_store, register_vllm_connector,
               registered_store)
from . import _l2dir
from ._settings import count as _count, flag as _flag, truthy as _truthy
from ._vllm_base import (VLLM, AllBlocksCleared, BlockRemoved, BlockStored, KVConnectorBase_V1,
                         KVConnectorMetadata, KVConnectorPromMetrics, KVConnectorRole,
                         KVConnectorStats, KVConnectorTransferResults, SupportsHMA)
from ._vllm_base import (JobResult, LookupResult, Medium, OffloadingEvent,
                         RequestOffloadingContext, SecondaryTierManager)

try:
    import torch
except ImportError:  # pragma: no cover - vLLM always has torch
    torch = None

log = logging.getLogger("ferry.vllm")

# An engine whose workers report transfers through get_transfer_results
# (vLLM after 003df296) takes a failed load per request (failed_recving); with
# more than one KV cache group it refuses per-block reports outright
# (Scheduler._handle_invalid_blocks raises: block ids are unique only within
# a group).
_PER_REQUEST_FAILURES = hasattr(KVConnectorBase_V1, "get_transfer_results")

# a save that finds the store full is a future miss, not a failed step
_SKIPPABLE = {getattr(errors, "ENOSPACE", None), getattr(errors, "ELOCKED", None), -errno.ENOMEM}


@dataclass
class LoadSpec:
    """Load tokens[:len(tokens)] (whole chunks) into the request's blocks,
    writing only from token `skip` on; vLLM counts on tokens [skip, need).
    groups: every KV cache group's block ids when vLLM has more than one
    (block_ids is group 0's); is_async: a load vLLM does not wait for
    (its end is reported through get_finished)."""
    req_id: str
    tokens: list
    block_ids: list
    skip: int
    need: int
    salt: object = None
    groups: tuple = ()
    is_async: bool = False


@dataclass
class SaveSpec:
    """Store tokens (whole chunks) from the request's blocks. start: the
    tokens computed before this step; a sliding-window group's blocks below
    its window of them are vLLM's null block or already given back."""
    req_id: str
    tokens: list
    block_ids: list
    salt: object = None
    groups: tuple = ()
    start: int = 0


@dataclass
class FerryConnectorMetadata(KVConnectorMetadata):
    loads: list = field(default_factory=list)
    saves: list = field(default_factory=list)
    preempted: set = field(default_factory=set)   # requests preempted this step


@dataclass
class _Req:
    """The scheduler side's view of one request."""
    tokens: list
    salt: object = None
    prompt_len: int = 0
    local: int = 0          # tokens vLLM's own prefix cache had
    hit: int = 0            # tokens (whole chunks) ferry had at the lookup
    load: object = None     # (skip, need, end) once vLLM allocated blocks for a load
    pinned: list = field(default_factory=list)  # leading tokens pinned, per cached group
    saved: int = 0          # leading tokens known to be in ferry
    block_ids: list = field(default_factory=list)
    group_ids: list = field(default_factory=list)  # every group's block ids
    salted: bool = False      # salt taken from the request (get_num_new_matched_tokens)
    lora: tuple = (None, None)  # its LoRA adapter's (name, id), for KV events
    async_load: bool = False  # get_num_new_matched_tokens answered load-async
    deferred: bool = False    # an async load or save the worker reports at the end


@dataclass
class _Group:
    """One of vLLM's KV cache groups: "full" attention (every token's KV),
    "sliding" (a window of `window` tokens) or "skipped" (a kind ferry does not
    cache, such as Mamba state)."""
    idx: int
    kind: str
    window: int = 0
    layer_names: list = None
    spec: str = ""
    dtype: object = None    # the spec's dtype: the caches' (vLLM's AttentionSpec.dtype)


_FULL_SPECS = {"FullAttentionSpec", "MLAAttentionSpec"}
_SLIDING_SPECS = {"SlidingWindowSpec", "SlidingWindowMLASpec"}
def _groups_of(kv_cache_config):
    """vLLM's KV cache groups (KVCacheConfig.kv_cache_groups, each a
    KVCacheGroupSpec with layer_names and kv_cache_spec); one full-attention
    group of every layer without a config."""
    groups = getattr(kv_cache_config, "kv_cache_groups", None)
    if not groups:
        return [_Group(0, "full")]
    out = []
    for i, g in enumerate(groups):
        spec = getattr(g, "kv_cache_spec", None)
        name = type(spec).__name__
        names = list(getattr(g, "layer_names", None) or []) or None
        dtype = getattr(spec, "dtype", None)
        if name in _FULL_SPECS:
            out.append(_Group(i, "full", 0, names, name, dtype))
        elif name in _SLIDING_SPECS and getattr(spec, "sliding_window", None):
            out.append(_Group(i, "sliding", int(spec.sliding_window), names, name, dtype))
        else:
            out.append(_Group(i, "skipped", 0, names, name, dtype))
    return out


def _group_salt(salt, idx):
    """Group 0 keeps the request's salt (a one-group engine's keys are the
    same as before groups); group g's chunks are keyed apart."""
    if idx == 0:
        return salt
    return f"{salt or ''}\0ferry-group\0{idx}"


def _stage_salt(salt, stage, stages):
    """A pipeline stage's chunks hold only its own layers' KV, and every
    stage's worker is the same TP rank of the same model: with more than
    one stage each stage's chunks are keyed apart (one stage keeps the
    salt, the keys it always had)."""
    if stages <= 1:
        return salt
    return f"{salt or ''}\0ferry-pp\0{stage}/{stages}"


def _block_ids_of(blocks):
    """Every group's block ids from vLLM's KVCacheBlocks (get_block_ids())."""
    get = getattr(blocks, "get_block_ids", None)
    ids = get() if callable(get) else getattr(blocks, "block_ids", ())
    return [list(x) for x in ids]


class FerryConnectorStats(KVConnectorStats):
    """The connector's counters for one interval (vLLM's KVConnectorStats):
    loads, load_tokens, load_error_blocks, saves, save_tokens, saves_skipped,
    async_loads. Workers' stats are added up."""

    def reset(self):
        self.data = {}

    def aggregate(self, other):
        for k, v in (other.data or {}).items():
            self.data[k] = self.data.get(k, 0) + v
        return self

    def reduce(self):
        return dict(self.data)

    def to_dict(self):
        """What the scheduler puts in SchedulerStats (vLLM's make_stats)."""
        return self.data

    def is_empty(self):
        return not any(self.data.values())


_STAT_DOCS = {
    "loads": "KV loads from ferry into vLLM's blocks (one per request and group)",
    "load_tokens": "Tokens loaded from ferry",
    "load_error_blocks": "Blocks ferry could not fill, handed back to vLLM to recompute",
    "saves": "KV stores into ferry (one per request and group)",
    "save_tokens": "Tokens stored into ferry",
    "saves_skipped": "Stores skipped because ferry was full or a layer never came",
    "async_loads": "Loads vLLM did not wait for (load-async)",
}


class FerryPromMetrics(KVConnectorPromMetrics):
    """One Prometheus counter per FerryConnectorStats key, per engine."""

    def __init__(self, vllm_config, metric_types, labelnames, per_engine_labelvalues):
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self.counters = {}
        for key, doc in _STAT_DOCS.items():
            c = self._counter_cls(name=f"vllm:ferry_{key}", documentation=doc,
                                  labelnames=labelnames)
            self.counters[key] = self.make_per_engine(c)

    def observe(self, transfer_stats_data, engine_idx=0):
        for key, v in (transfer_stats_data or {}).items():
            per = self.counters.get(key)
            if per is not None and v:
                per[engine_idx].inc(v)


def _extra(vllm_config):
    """kv_connector_extra_config, less its "ferry.*" settings written as null
    (JSON null, an empty YAML value): such a setting is not set, as a null
    boolean is false."""
    ktc = getattr(vllm_config, "kv_transfer_config", None)
    extra = getattr(ktc, "kv_connector_extra_config", None) or {}
    return {k: v for k, v in dict(extra).items()
            if not (v is None and str(k).startswith("ferry."))}


# the settings of kv_connector_extra_config the connector reads (the module
# docstring's; "ferry.cross_layer_blocks": prefer_cross_layer_blocks)
_KEYS = ("ferry.store", "ferry.server", "ferry.l1", "ferry.l2", "ferry.model",
         "ferry.chunk_tokens", "ferry.persistent", "ferry.layout", "ferry.layerwise",
         "ferry.async_load", "ferry.async_save", "ferry.kv_events", "ferry.kv_cache_layout",
         "ferry.cross_layer_blocks")


_U32 = 2**32 - 1


def _chunk_tokens(extra):
    """"ferry.chunk_tokens" (0, the default: the store's own): a count
    (_settings.count, the rule of every engine's count settings)."""
    return _count(extra.get("ferry.chunk_tokens", 0),
                  "\"ferry.chunk_tokens\" (tokens a chunk; 0: the store's default)", 0, _U32)


# vLLM's names of the dtypes a "ferry.layout" may be written with (its
# --dtype, STR_DTYPE_TO_TORCH_DTYPE) and ferry's for them
_VLLM_DTYPES = {"bfloat16": "bf16", "half": "f16", "float16": "f16", "float": "f32",
                "float32": "f32"}


# vLLM's quantized KV cache dtypes (cache_config.cache_dtype) and the ferry
# dtype of the caches its workers register for them (STR_DTYPE_TO_TORCH_DTYPE,
# vllm/utils/torch_utils.py at vllm-project/vllm 0024350b5da3: torch.uint8 but
# for fp8_inc's float8_e4m3fn and int8_per_token_head's int8). "fp8" is
# vLLM's name here, its caches uint8: ferry's own "fp8" code would be a
# layout no worker has, which the daemon refuses
_QUANT_CACHE_DTYPES = {"fp8": "u8", "fp8_e4m3": "u8", "fp8_e5m2": "u8", "fp8_ds_mla": "u8",
                       "fp8_per_token_head": "u8", "int4_per_token_head": "u8",
                       "int8_per_token_head": "i8", "fp8_inc": "fp8", "nvfp4": "u8",
                       "nvfp4_4over6": "u8", "turboquant_k8v4": "u8",
                       "turboquant_4bit_nc": "u8", "turboquant_k3v4_nc": "u8",
                       "turboquant_3bit_nc": "u8"}
# vLLM's names of one cache format: "fp8" is fp8_e4m3 (CacheConfig.cache_dtype's
# documentation; modelopt's "fp8" maps to "fp8_e4m3",
# MODELOPT_TO_VLLM_KV_CACHE_DTYPE_MAP)
_KV_FORMAT_ALIASES = {"fp8": "fp8_e4m3"}


def _kv_format(vllm_config):
    """The format of a quantized KV cache (cache_config.cache_dtype), None for
    the model's dtype or a plain float one. vLLM holds fp8_e4m3, fp8_e5m2
    and its other byte formats alike as torch.uint8 caches: one layout, the
    same bytes per token, where the same byte is another value. So the
    format goes into every salt (scheduler's lookups, workers' loads and
    stores), and an fp8_e5m2 engine never finds an fp8_e4m3 engine's chunks
    in a shared daemon or a persistent L2 ("fp8" and "fp8_e4m3", one
    format, share them). A bf16 cache's layout is another (2 bytes a value):
    no store or daemon holds both."""
    name = getattr(getattr(vllm_config, "cache_config", None), "cache_dtype", None)
    if not isinstance(name, str) or name == "auto" or name in _CACHE_DTYPES:
        return None
    return _KV_FORMAT_ALIASES.get(name, name)


def _spec_layout(spec):
    """The Layout of "ferry.layout" ({"num_layers", "num_kv_heads", "head_dim",
    "dtype" (ferry's name or vLLM's), "mla"}); a ValueError naming the
    setting for anything else."""
    try:
        dtype = spec.get("dtype", "bf16")
        if isinstance(dtype, str):
            dtype = _VLLM_DTYPES.get(dtype) or _QUANT_CACHE_DTYPES.get(dtype, dtype)
        counts = []
        for field in ("num_layers", "num_kv_heads", "head_dim"):
            counts.append(_count(spec[field], field, 1, _U32))   # (int() takes 2.5, True)
        return Layout.from_model(*counts, dtype,
                                 mla=_truthy(spec.get("mla", False), "\"ferry.layout\"'s mla"))
    except (KeyError, TypeError, ValueError, AttributeError, FerryError) as e:
        raise ValueError("ferry: \"ferry.layout\" is {\"num_layers\", \"num_kv_heads\", "
                         "\"head_dim\", \"dtype\" (default bf16), \"mla\" (default false)}, "
                         f"got {spec!r}: {str(e).removeprefix('ferry: ')}") from None


def _check_extra(extra):
    """Refuse, when vLLM builds the connector (scheduler and workers alike), a
    "ferry.*" setting ferry does not know (a misspelling would switch nothing,
    in silence) and a value its setting cannot take (else a worker fails in
    register_kv_caches, or the scheduler in vLLM's loop): a ValueError naming
    the key. Keys outside "ferry." are other components' and left alone."""
    unknown = sorted(str(k) for k in extra if str(k).startswith("ferry.") and k not in _KEYS)
    if unknown:
        raise ValueError(f"ferry: vLLM connector: unknown setting {', '.join(map(repr, unknown))} "
                         f"in kv_connector_extra_config; ferry reads {', '.join(_KEYS)}")
    for key in ("ferry.store", "ferry.model"):
        v = extra.get(key)
        if key in extra and (not isinstance(v, str) or not v):
            raise ValueError(f"ferry: \"{key}\" is a non-empty string, got {v!r}")
    v = extra.get("ferry.server")
    if v is not None and not isinstance(v, str):
        raise ValueError(f"ferry: \"ferry.server\" is a `ferry serve` address such as "
                         f"\"unix:/run/ferry/ferry.sock\", got {v!r}")
    _chunk_tokens(extra)
    for key in ("ferry.l1", "ferry.l2"):
        v = extra.get(key)
        if v is None:
            continue
        try:
            if key == "ferry.l1":
                parse_size(v)
            else:   # (one SIZE on each directory: the slab is striped evenly)
                dirs = _l2dir.split(v, "ferry: \"ferry.l2\" is")
                sizes = {parse_size(size) for _, size in dirs}
                if len(sizes) != 1:
                    raise ValueError(f"one SIZE, the same on each directory, got "
                                     f"{len(sizes) or 'no'} sizes")
        except (TypeError, ValueError, FerryError) as e:
            raise ValueError(f"ferry: \"{key}\" {v!r} is not "
                             f"{'a size' if key == 'ferry.l1' else 'DIR:SIZE or a list of them'}"
                             f" (\"8G\", \"512M\", bytes): {e}") from None
    if extra.get("ferry.layout"):
        _spec_layout(extra["ferry.layout"])
    _kv_cache_layout(extra)


def _kv_cache_layout(extra):
    """"ferry.kv_cache_layout": "NHD", "HND" (any case) or None."""
    want = extra.get("ferry.kv_cache_layout")
    if not want:
        return None
    want = str(want).upper()
    if want not in ("NHD", "HND"):
        raise ValueError(f"ferry: \"ferry.kv_cache_layout\" is NHD or HND, got {want!r}")
    return want


def _tp_rank_world(vllm_config, rank=True):
    """This worker's tensor-parallel rank and world size (0, 1 outside vLLM)."""
    pc = getattr(vllm_config, "parallel_config", None)
    world = int(getattr(pc, "tensor_parallel_size", 1) or 1)
    if world == 1 or not rank:
        return 0, world
    from vllm.distributed import get_tensor_model_parallel_rank
    return get_tensor_model_parallel_rank(), world


def _external_launcher(vllm_config):
    """True under vLLM's external_launcher (torchrun: verl, OpenRLHF):
    parallel_config.distributed_executor_backend "external_launcher", or
    ExecutorWithExternalLauncher (or a subclass, or its qualified name) given
    as the backend (vllm-project/vllm 00193b82b0e2d4faea5d3b4ea4f6c4c2bd9d057a,
    vllm/config/parallel.py; 01e4fce07423dafcc832600ba05159fb28dc1126,
    vllm/v1/executor/uniproc_executor.py). Every rank then runs an engine
    of its own, its scheduler with its one worker in its process."""
    pc = getattr(vllm_config, "parallel_config", None)
    backend = getattr(pc, "distributed_executor_backend", None)
    if isinstance(backend, type):
        return any(c.__name__ == "ExecutorWithExternalLauncher" for c in backend.__mro__)
    return isinstance(backend, str) and (
        backend == "external_launcher"
        or backend.rsplit(".", 1)[-1] == "ExecutorWithExternalLauncher")


def _replica_span(vllm_config):
    """The processes of one engine replica that step together (TP x PP x
    PCP; vLLM's ranks are laid out ExternalDP x DP x PP x PCP x TP, so they
    are consecutive global ranks)."""
    pc = getattr(vllm_config, "parallel_config", None)
    return (int(getattr(pc, "tensor_parallel_size", 1) or 1)
            * int(getattr(pc, "pipeline_parallel_size", 1) or 1)
            * int(getattr(pc, "prefill_context_parallel_size", 1) or 1))


def _replica_group(span):
    """A CPU (gloo) group of this process's engine replica under
    external_launcher: global ranks [r - r % span, r - r % span + span).
    Every rank builds its scheduler at the same point of EngineCore's
    start, so every rank enters this collective."""
    import torch.distributed as dist
    if not dist.is_available() or not dist.is_initialized():
        raise ValueError("ferry: vLLM connector: under distributed_executor_backend="
                         "\"external_launcher\" the scheduler agrees its hits with the "
                         "other ranks of its engine, and torch.distributed is not "
                         "initialized in this process")
    world = dist.get_world_size()
    if world % span:
        raise ValueError(f"ferry: vLLM connector: torch.distributed's world of {world} is "
                         f"not a whole number of engine replicas of {span} ranks (TP x PP "
                         "x PCP) under distributed_executor_backend=\"external_launcher\"")
    me, mine = dist.get_rank(), None
    for first in range(0, world, span):   # (every rank creates every group, in order)
        group = dist.new_group(list(range(first, first + span)), backend="gloo")
        if first <= me < first + span:
            mine = group
    _REPLICA_GROUP[span] = mine
    return mine


# The group the scheduler last made (_replica_group), by span: the worker
# in its process (external_launcher) agrees its loads over it. It exists by
# the worker's first step: vLLM builds the worker, then the scheduler,
# then steps.
_REPLICA_GROUP = {}


def _rank_name(vllm_config):
    """This worker's place in vLLM's topology, every coordinate named:
    "pp<stage>of<stages>-dp<replica>-tp<rank>of<world>", and at PCP above
    one "-pcp<rank>of<size>" (get_pcp_group()) before "-tp". The stage from
    vLLM's pipeline group (get_pp_group().rank_in_group); the replica from
    parallel_config.data_parallel_index where vLLM has it, else
    data_parallel_rank: a dense model's replica runs as an independent
    DP=1 engine (reconfigure_for_independent_dp_rank sets its
    data_parallel_rank 0 and data_parallel_size 1, and keeps the index), so
    the rank would name every replica 0. The number of replicas is not
    named: a replica's KV is whole (its own requests, all heads of its TP
    ranks) whatever their number, and a dense replica does not know it."""
    pc = getattr(vllm_config, "parallel_config", None)
    pp_world = int(getattr(pc, "pipeline_parallel_size", 1) or 1)
    pp = 0
    if pp_world > 1:
        from vllm.distributed import get_pp_group
        pp = int(get_pp_group().rank_in_group)
    dp = getattr(pc, "data_parallel_index", None)
    if dp is None:
        dp = getattr(pc, "data_parallel_rank", 0)
    tp, tp_world = _tp_rank_world(vllm_config)
    pcp_world = int(getattr(pc, "prefill_context_parallel_size", 1) or 1)
    pcp = ""
    if pcp_world > 1:   # (the ranks of one TP rank; a PCP of one keeps the old names)
        from vllm.distributed import get_pcp_group
        pcp = f"-pcp{int(get_pcp_group().rank_in_group)}of{pcp_world}"
    return f"pp{pp}of{pp_world}-dp{int(dp or 0)}{pcp}-tp{tp}of{tp_world}"


def _rank_l2(spec, rank):
    """The L2 of one worker's in-process store: each "DIR:SIZE" of spec (one,
    or a list of them) as DIR/vllm-<rank>:SIZE, the directory made if absent.
    An L2 directory has one owner and every worker process opens its store
    from the same extra config; the rank names every coordinate, so the same
    worker of the same topology finds its persistent L2 again, and a worker
    of another topology opens another directory (a miss). Every worker's
    name is its own (the DP replica is data_parallel_index), so no two
    workers of one vLLM share a name: no series of directories here."""
    return _l2dir.rank_l2(spec, f"vllm-{rank}", "ferry: \"ferry.l2\" is", _name_old_l2)


# the slabs an L2 keeps in its directory (persistent: ferry_pslab.bin and its
# journal ferry_pslab.idx; else ferry_slab.bin), and the ones already named
_L2_SLABS = ("ferry_pslab.bin", "ferry_slab.bin")
_OLD_L2_NAMED = set()


def _name_old_l2(d, sub):
    """Before each worker had its own directory, the one worker (TP, PP and
    DP of one) opened DIR itself. A slab it left there is no longer read and
    still holds its size of the drive: said once per process, never lost
    in silence."""
    for slab in _L2_SLABS:
        path = os.path.join(d, slab)
        try:
            st = None if path in _OLD_L2_NAMED else os.stat(path)
        except OSError:     # (none there, or not ours to read)
            st = None
        size = st.st_size if st is not None and S_ISREG(st.st_mode) else None
        if size is None:
            continue
        _OLD_L2_NAMED.add(path)
        keep = ("its chunks are misses now; to keep them for a worker of TP, PP and DP "
                "of one, move ferry_pslab.bin and ferry_pslab.idx into "
                f"{os.path.join(d, 'vllm-pp0of1-dp0-tp0of1')} while no ferry has them open, "
                "else delete them" if slab == "ferry_pslab.bin" else "delete it")
        log.warning("ferry: vLLM connector: %s (%d bytes) is an L2 slab an earlier ferry "
                    "opened in \"ferry.l2\"'s directory itself; each worker now opens a "
                    "directory of its own under it (this one %s), so that slab is not read "
                    "and still holds its space on the drive: %s", path, size, sub, keep)


# vLLM's KV cache dtypes by name, where vLLM is not there to ask
# (STR_DTYPE_TO_TORCH_DTYPE, vllm/utils/torch_utils.py): the float ones
# (the quantized ones are _QUANT_CACHE_DTYPES)
_CACHE_DTYPES = {"float32": "float32", "float": "float32", "half": "float16",
                 "float16": "float16", "bfloat16": "bfloat16", "int8": "int8"}


def _cache_dtype(vllm_config, model_dtype):
    """The dtype of vLLM's KV caches from cache_config.cache_dtype ("auto":
    the model's): vLLM's own get_kv_cache_torch_dtype where it has one, else
    vLLM's table as ferry knows it (_CACHE_DTYPES, _QUANT_CACHE_DTYPES: not
    every quantized cache is uint8). A name neither knows is a ValueError
    naming it: a layout guessed for it would be refused by the daemon, or
    would read other bytes."""
    name = getattr(getattr(vllm_config, "cache_config", None), "cache_dtype", None)
    if not isinstance(name, str) or name == "auto" or torch is None:
        return model_dtype
    try:
        from vllm.utils.torch_utils import get_kv_cache_torch_dtype
    except ImportError:
        try:
            from vllm.utils import get_kv_cache_torch_dtype
        except ImportError:
            get_kv_cache_torch_dtype = None
    if get_kv_cache_torch_dtype is not None:
        try:
            return get_kv_cache_torch_dtype(name, model_dtype)
        except ValueError:
            pass
    if name in _CACHE_DTYPES:
        return getattr(torch, _CACHE_DTYPES[name])
    quant = {"u8": "uint8", "i8": "int8", "fp8": "float8_e4m3fn"}.get(
        _QUANT_CACHE_DTYPES.get(name))
    if quant is None or not hasattr(torch, quant):
        raise ValueError(f"ferry: vLLM connector: cache_config.cache_dtype {name!r} is no KV "
                         "cache dtype ferry knows (vLLM's: auto, "
                         f"{', '.join(sorted(set(_CACHE_DTYPES) | set(_QUANT_CACHE_DTYPES)))}); "
                         "give \"ferry.layout\" with the dtype of the caches the workers register")
    return getattr(torch, quant)


def _config_layout(vllm_config, extra, cached=()):
    """The KV layout per TP rank for a scheduler that has no caches to read it
    from: "ferry.layout", else vLLM's ModelConfig, with the layers of the
    first KV cache group ferry caches (`cached`, from the scheduler's
    kv_cache_config) when vLLM names them and runs one pipeline stage: a
    worker's layout is that group's caches, a speculative drafter's layers
    among them (and a hybrid model's group holds some of its layers only);
    and with the dtype of that group's spec, the caches' dtype."""
    spec = extra.get("ferry.layout")
    if spec:
        return _spec_layout(spec)
    mc = getattr(vllm_config, "model_config", None)
    pc = getattr(vllm_config, "parallel_config", None)
    try:
        layers, dtype = mc.get_num_layers(pc), mc.dtype
        stages = int(getattr(pc, "pipeline_parallel_size", 1) or 1)
        first = cached[0] if cached else None
        if first is not None and first.layer_names and stages == 1:
            layers = len(set(first.layer_names))
        if first is not None and torch is not None and isinstance(first.dtype, torch.dtype):
            dtype = first.dtype   # the caches' (an fp8 KV cache is uint8, not the model's)
        else:   # a vLLM that passes no kv_cache_config: cache_config says it
            dtype = _cache_dtype(vllm_config, dtype)
        return Layout.from_model(layers, mc.get_num_kv_heads(pc),
                                 mc.get_head_size(), dtype,
                                 mla=bool(getattr(mc, "use_mla", False)))
    except AttributeError as e:
        raise ValueError("ferry: vLLM connector: the scheduler's \"ferry.server\" client "
                         "needs the KV layout: give \"ferry.layout\" (num_layers, "
                         "num_kv_heads, head_dim, dtype) or a vLLM model_config") from e


def _embeds_digest(embeds):
    """A digest of a request's prompt embeddings: their dtype, shape and bytes."""
    t = embeds.detach().cpu().contiguous() if torch is not None and \
        isinstance(embeds, torch.Tensor) else None
    h = hashlib.blake2b(digest_size=16)
    if t is None:
        a = np.ascontiguousarray(embeds)
        h.update(f"{a.dtype}{a.shape}".encode())
        h.update(a.tobytes())
    else:
        h.update(f"{t.dtype}{tuple(t.shape)}".encode())
        h.update(t.view(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


# the tags _salt_of and _group_salt join a salt's parts with ("\0lora\0name")
_SALT_TAGS = frozenset(("lora", "mm", "embeds", "ferry-group", "ferry-pp", "kv-dtype"))


def _salt_part(s, tags=True):
    """One client-given part of a salt (cache_salt, a LoRA name, a multimodal
    identity) as a field no other salt's fields can spell: one holding a NUL
    (or, tags: equal to a tag) is replaced by a digest of it, so "\0lora\0a"
    as a cache_salt is not the salt of adapter "a". Any other part is kept as
    it is, bytes as bytes (the keys it always had)."""
    if isinstance(s, (bytes, bytearray)):
        if b"\0" not in s:
            return s
        raw = bytes(s)
    elif isinstance(s, str):
        if "\0" not in s and not (tags and s in _SALT_TAGS):
            return s
        raw = s.encode("utf-8", "surrogatepass")
    else:
        return s
    return "\x01" + hashlib.blake2b(raw, digest_size=16).hexdigest()


def _salt_of(request):
    """ferry's salt for a request: what vLLM keys its own prefix cache by
    beyond the tokens. vLLM's cache_salt; the LoRA adapter's name (its KV is
    not the base model's); the identities of its multimodal inputs (their
    placeholder token ids are the same for any image, so a prefix with
    another image must not match); and a digest of its prompt embeddings
    (a prompt given as embeddings has placeholder token ids)."""
    salt = getattr(request, "cache_salt", None)
    if salt is not None:   # (the first field: a tag's name is a salt like any other)
        salt = _salt_part(salt, tags=False)
    lora = getattr(request, "lora_request", None)
    if lora is not None:
        name = getattr(lora, "lora_name", None)
        name = name if name is not None else getattr(lora, "lora_int_id", lora)
        salt = (salt or "") + "\0lora\0" + _salt_part(str(name))
    mm = [_salt_part(str(getattr(f, "identifier", f)))
          for f in getattr(request, "mm_features", None) or []]
    mm = mm or [_salt_part(str(h)) for h in getattr(request, "mm_hashes", None) or []]
    if mm:
        salt = (salt or "") + "\0mm\0" + "\0".join(mm)
    embeds = getattr(request, "prompt_embeds", None)
    if embeds is not None:
        salt = (salt or "") + "\0embeds\0" + _embeds_digest(embeds)
    return salt


def _lora_of(request):
    """(name, id) of the request's LoRA adapter for its KV events, as vLLM's
    own BlockStored carries them (lora_name, and lora_id, which vLLM keeps
    for old consumers); (None, None) for the base model."""
    lora = getattr(request, "lora_request", None)
    if lora is None:
        return None, None
    name = getattr(lora, "lora_name", None)
    lid = getattr(lora, "lora_int_id", None)
    return (str(name) if name is not None else None), lid


def _kv_event(cls, **fields):
    """vLLM's KV event `cls` with those of `fields` its kv_events.py declares:
    a vLLM as old as connectors' take_events has BlockStored without medium
    and lora_name, and BlockRemoved without medium (msgspec refuses a keyword
    a Struct does not declare); newer fields have defaults."""
    names = getattr(cls, "__struct_fields__", None)
    if names is None and dataclasses.is_dataclass(cls):
        names = [f.name for f in dataclasses.fields(cls)]
    if names is not None:
        fields = {k: v for k, v in fields.items() if k in names}
    return cls(**fields)


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
    heads, head_dim] as it is (NHD, or HND's permuted view: ferry reads its
    strides), FlashInfer's [blocks, 2, ...] transposed (a view, no copy),
    packed K|V [blocks, heads, block_size, 2*head_dim] and MLA's [blocks,
    block_size, head_dim] as they are."""
    shape = tuple(cache.shape)
    if len(shape) == 5 and shape[0] == 2:
        return cache
    if len(shape) == 5 and shape[1] == 2:
        return cache.transpose(0, 1)
    if len(shape) in (3, 4):
        return cache
    raise ValueError(f"ferry: vLLM cache of shape {list(shape)} is none of [2, blocks, "
                     "block_size, heads, head_dim], [blocks, 2, ...], [blocks, heads, "
                     "block_size, 2*head_dim], [blocks, block_size, dim]")


def _layers_first(kv_cache, attn_backend):
    """A cross-layer cache in vLLM's physical order, viewed [num_layers,
    *get_kv_cache_shape] (the inverse of the backend's stride order)."""
    get = getattr(attn_backend, "get_kv_cache_stride_order", None)
    try:
        order = tuple(get(include_num_layers_dimension=True)) if get else None
    except (TypeError, NotImplementedError):  # (an older backend: no layers dimension)
        order = None
    if order is None:
        return kv_cache
    if sorted(order) != list(range(kv_cache.dim())):
        raise ValueError(f"ferry: vLLM connector: a cross-layer cache of shape "
                         f"{list(kv_cache.shape)} with the stride order {list(order)} of "
                         f"{getattr(attn_backend, '__name__', attn_backend)}")
    return kv_cache.permute(*[order.index(i) for i in range(len(order))])


class FerryConnector(KVConnectorBase_V1, SupportsHMA):
    """ferry's KV connector for vLLM v1 (see the module's documentation)."""

    def __new__(cls, *args, **kwargs):
        # The last guard of a user's own "FerryConnector" (_chosen_class):
        # should vLLM's factory have reached ferry's class by the registered
        # name although the config names another module's class, that class
        # is what is built. Python runs a subclass's __init__ itself; another
        # class is built whole, and ferry's __init__ is then not run. Only
        # vLLM's own code is redirected: a user's class that builds ferry's
        # by name (a wrapper that delegates to it, with the config it was
        # given) gets ferry's, not itself again without end; so does one
        # kept in a tree of vLLM's own (a fork's), from its own module.
        caller = sys._getframe(1)
        if cls is FerryConnector and _called_by_vllm(caller):
            cfg = args[0] if args else kwargs.get("vllm_config")
            chosen = _chosen_class(getattr(cfg, "kv_transfer_config", None))
            if chosen is not FerryConnector and \
                    caller.f_globals.get("__name__") != chosen.__module__:
                if issubclass(chosen, FerryConnector):
                    return super().__new__(chosen)
                return chosen(*args, **kwargs)
        return super().__new__(cls)

    def __init__(self, vllm_config, role, kv_cache_config=None):
        params = inspect.signature(KVConnectorBase_V1.__init__).parameters
        if "kv_cache_config" in params:
            super().__init__(vllm_config, role, kv_cache_config)
        else:  # vLLM before kv_cache_config was passed to connectors
            super().__init__(vllm_config, role)
        self._extra = _extra(vllm_config)
        _check_extra(self._extra)
        self._server = self._extra.get("ferry.server") or None
        self._name = self._extra.get("ferry.store", "vllm")
        self._store = None
        self._opened = False
        self._ranks = None      # the scheduler's stores, one per TP rank (_rank_stores)
        ktc = getattr(vllm_config, "kv_transfer_config", None)
        self._failure_policy = str(getattr(ktc, "kv_load_failure_policy", None) or "fail")
        self._async_load = _flag(self._extra, "ferry.async_load")
        self._async_save = _flag(self._extra, "ferry.async_save")
        self._groups = _groups_of(kv_cache_config)
        pc = getattr(vllm_config, "parallel_config", None)
        self._stages = int(getattr(pc, "pipeline_parallel_size", 1) or 1)
        self._stage = 0     # the worker's pipeline stage (register_kv_caches)
        self._kv_format = _kv_format(vllm_config)   # a quantized cache's, in every salt
        self._cached = [g for g in self._groups if g.kind != "skipped"]
        skipped = [g for g in self._groups if g.kind == "skipped"]
        dcp = int(getattr(pc, "decode_context_parallel_size", 1) or 1)
        if dcp > 1 and self._cached:
            # vLLM's _compute_slot_mapping_kernel (vllm/v1/worker/block_table.py)
            raise ValueError(
                f"ferry: vLLM connector: decode_context_parallel_size {dcp} shards each "
                "request's KV across the ranks by position (a block holds every "
                f"{dcp}th token of a virtual block of {dcp} blocks' tokens), and ferry's "
                "chunks are blocks of consecutive tokens: ferry cannot store or load for "
                "it yet; run with decode_context_parallel_size 1, or without ferry's "
                "connector")
        if role == KVConnectorRole.SCHEDULER and not self._server and self._cached \
                and "ferry.l1" in self._extra and registered_store(self._name) is None:
            # vLLM's engine core registers its workers' caches before it builds
            # the scheduler: no store here means the workers run elsewhere (a
            # model of no group ferry caches opens none: it is off, not apart)
            raise ValueError(
                f"ferry: vLLM connector: \"ferry.l1\" opens a store in each worker's "
                f"process, and none is registered as {self._name!r} in the scheduler's: "
                "the workers run in other processes (the multiprocessing executor, TP or "
                "PP above one) and the scheduler cannot see what they store; give "
                "\"ferry.server\" (a `ferry serve` daemon the scheduler and every worker "
                "share) instead")
        # a hit must cover every group: one ferry cannot fill makes every hit useless
        self._disabled = (f"KV cache group(s) {[g.idx for g in skipped]} "
                          f"({', '.join(sorted({g.spec for g in skipped}))}) hold state ferry "
                          "does not cache" if skipped else None)
        self._checked = False
        # A load of a model with several KV cache groups that comes short is
        # reported for its request (failed_recving), which only an async load
        # can be: such models load asynchronously on engines that take it.
        self._fail_requests = len(self._groups) > 1 and _PER_REQUEST_FAILURES
        if self._fail_requests:
            self._async_load = True
        # Under external_launcher each rank schedules for itself, and the ranks
        # of one engine replica must take the same steps (their forward's
        # collectives are matched): a hit ranks disagree on hangs them.
        self._spmd = _external_launcher(vllm_config) and _replica_span(vllm_config) > 1
        self._agree_group = None
        if self._spmd and self._cached:
            self._check_spmd()
        # scheduler side
        self._reqs = {}
        self._held = set()      # finished requests whose blocks ferry still holds
        self._async_ready = []  # requests whose load-async blocks were just allocated
        kec = getattr(vllm_config, "kv_events_config", None)
        own = _flag(self._extra, "ferry.kv_events")   # (read, so a misspelling is refused)
        self._events_on = bool(getattr(kec, "enable_kv_cache_events", False)) or own
        self._events = []
        self._published = set()
        # worker side
        self._caches = None
        self._gcaches = {}      # group index -> that group's layers' caches
        self._gbs = {}          # group index -> block size
        self._layout = None
        self._block_size = 0
        self._load_errors = set()
        self._agreeing = []     # this step's loads, to agree with the other ranks (_agree_loads)
        self._failed_recving = set()  # async loads that came short (several groups)
        self.saves_skipped = 0
        self._stats = dict.fromkeys(_STAT_DOCS, 0)
        self._layerwise = _flag(self._extra, "ferry.layerwise")
        if self._layerwise and self._async_save:
            # layerwise stores end in wait_for_save (their layers are handed
            # over during the forward): none is left for get_finished to
            # report, so request_finished must not keep the blocks for one
            log.warning("ferry: vLLM connector: \"ferry.async_save\" does nothing with "
                        "\"ferry.layerwise\": layerwise stores end in their step")
            self._async_save = False
        self._cross_layer = _flag(self._extra, "ferry.cross_layer_blocks")
        _flag(self._extra, "ferry.persistent")   # refused here, not when the store opens
        self._layer_index = {}
        self._layer_pos = {}    # layer name -> (group index, index in its group)
        self._loading = []      # [spec, group, ids, skip, LayerOp] of this step's layerwise loads
        self._saving = None     # [spec, group, LayerOp, pin, error] of this step's layerwise saves
        self._async_loads = {}  # req id -> [[spec, group, ids, skip, Op]]
        self._saves_inflight = {}  # req id -> [(spec, Op, pin)]
        self._deferred = set()  # req ids reported through get_finished's first set
        self._finishing = set()  # of those, the ones vLLM said finished
        if self._spmd and self._cached and role == KVConnectorRole.SCHEDULER:
            self._agree_group = _replica_group(_replica_span(vllm_config))

    def _check_spmd(self):
        """Under external_launcher at TP x PP x PCP above one, each rank's
        scheduler sees only its own process: a store there holds its rank's
        chunks alone, and a load or store that ends at a step of its rank's
        own lets the ranks' schedules part. Refused when vLLM builds the
        connector, naming the setting."""
        where = ("under distributed_executor_backend=\"external_launcher\" (torchrun) with "
                 "TP x PP x PCP above one, each rank runs its own scheduler, and the ranks "
                 "of an engine must schedule alike or their collectives hang")
        if not self._server:
            raise ValueError(
                f"ferry: vLLM connector: {where}; a store in a rank's process holds that "
                "rank's chunks alone, so its hits would be its own: give \"ferry.server\" "
                "(a `ferry serve` daemon every rank shares; each rank's scheduler then "
                "counts a chunk once every rank holds it, and the ranks agree on it)")
        for opt in ("ferry.async_load", "ferry.async_save"):
            if _flag(self._extra, opt):
                raise ValueError(
                    f"ferry: vLLM connector: {where}; {opt!r} ends a transfer at a step "
                    "of each rank's own: leave it off")
        if self._fail_requests and not self._disabled:
            self._disabled = ("under distributed_executor_backend=\"external_launcher\" a "
                              "model of several KV cache groups loads asynchronously on this "
                              "vLLM, and each rank would see its loads end at a step of its "
                              "own")

    def _agree(self, hit, error):
        """The hit every rank of this engine replica holds (the least of the
        ranks' hits); a rank whose lookup failed fails every rank's."""
        if self._agree_group is None:
            if error is not None:
                raise error
            return hit
        import torch.distributed as dist
        t = torch.tensor([-1 if error is not None else hit], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self._agree_group)
        if error is not None:
            raise error
        if int(t.item()) < 0:
            raise RuntimeError("ferry: vLLM connector: another rank of this engine failed "
                               "its lookup (under distributed_executor_backend="
                               "\"external_launcher\" the ranks agree on every hit)")
        return int(t.item())

    # ---- the contract's class-level answers ----
    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config):
        """True in the layerwise form: a full CUDA graph's replay would skip
        wait_for_layer_load and save_kv_layer, and attention could read KV that
        has not landed. The whole form moves KV outside the forward pass."""
        return _flag(extra_config, "ferry.layerwise")

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config):
        """None: ferry reads the layouts vLLM's backends hand it. A deployment
        that must pin one (to match another connector's) names it in
        "ferry.kv_cache_layout" ("NHD" or "HND")."""
        return _kv_cache_layout(_extra(vllm_config))

    @property
    def requires_kv_delivery(self):
        """False: ferry is a best-effort cache; a save lost to a preemption is
        a future miss, not a lost hand-off."""
        return False

    @classmethod
    def build_kv_connector_stats(cls, data=None):
        return FerryConnectorStats(data=dict(data) if data else {})

    @classmethod
    def build_prom_metrics(cls, vllm_config, metric_types, labelnames, per_engine_labelvalues):
        return FerryPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    # ---- the store ----
    @property
    def store(self):
        if self._store is None:
            # under external_launcher the store registered here is this rank's
            # worker's: the scheduler asks the daemon for every rank's keys
            self._store = None if self._agree_group is not None else self._registered()
            if self._store is None and self._server:
                self._store = self._open_lookup_client()
            if self._store is None:
                raise RuntimeError(
                    f"ferry: vLLM connector: no store registered as {self._name!r} in this "
                    "process (ferry.adapters.register_store, or \"ferry.l1\" for the worker "
                    "to open one); a scheduler in another process than the workers needs "
                    "\"ferry.server\"")
        return self._store

    def _open_lookup_client(self, rank=0):
        """The scheduler's client of "ferry.server" for TP rank `rank`'s keys:
        lookups and pins only."""
        e = self._extra
        _, world = _tp_rank_world(self._vllm_config, rank=False)
        s = KVStore(model=self._model_name(),
                    layout=_config_layout(self._vllm_config, e, self._cached),
                    server=self._server,
                    lookup_only=True, chunk_tokens=_chunk_tokens(e),
                    tp_rank=rank, tp_world=world)
        self._opened = True
        return s

    def _rank_stores(self):
        """The stores a hit must be in: the scheduler's store and, when it is
        its own client of "ferry.server" at TP above one, a client for each
        other TP rank's keys (every rank stores its own heads, and every
        rank loads a hit: one rank's chunks alone are no hit)."""
        if self._ranks is None:
            store = self.store
            _, world = _tp_rank_world(self._vllm_config, rank=False)
            ranks = [store]
            if self._opened and store is not registered_store(self._name):
                try:
                    for r in range(1, world):
                        ranks.append(self._open_lookup_client(r))
                except BaseException:
                    # (rank 0's alone would count hits the others cannot load)
                    for other in ranks[1:]:
                        other.close()
                    raise
            self._ranks = ranks
        return self._ranks

    def _model_name(self):
        """The model the keys are of: "ferry.model", else vLLM's model."""
        mc = getattr(self._vllm_config, "model_config", None)
        return str(self._extra.get("ferry.model", getattr(mc, "model", "vllm")))

    def _owner(self, rank=True):
        """Whose store a connector opens: (model, TP rank, TP world, pipeline
        stages); the scheduler's TP rank is None (it asks for every rank)."""
        r, world = _tp_rank_world(self._vllm_config, rank=rank)
        return self._model_name(), r if rank else None, world, self._stages

    def _registered(self):
        """The store registered as "ferry.store", or None. One a connector of
        this process opened for another model is refused: its chunks are that
        model's, under the keys this connector would ask (the store's model
        names them), so a hit would load that model's KV. So is one opened by
        a worker of another TP rank or size, or of another pipeline (another
        engine of the process, VLLM_ENABLE_V1_MULTIPROCESSING=0): its keys
        are that rank's, its chunks only its heads and stage's layers, and a
        scheduler whose workers run elsewhere would count them as hits its
        workers never find."""
        found = registered_store(self._name)
        opener = None if found is None else _check_opener(
            self._name, found, "vLLM connector", self._model_name(), "\"ferry.store\"")
        if opener is None or opener[0] != "vLLM":
            return found
        owner = opener[2]
        mine = self._owner(rank=self._role != KVConnectorRole.SCHEDULER)
        if owner[2:] != mine[2:] or (mine[1] is not None and owner[1] != mine[1]):
            def who(o):
                rank = "" if o[1] is None else f"TP rank {o[1]} of "
                return f"{rank}TP size {o[2]} and {o[3]} pipeline stage(s)"
            raise ValueError(
                f"ferry: vLLM connector: the store registered as {self._name!r} was opened "
                f"by a worker of {who(owner)}, and this connector serves {who(mine)}: its "
                "chunks are that worker's heads and layers under its keys, not this "
                "engine's; give each engine its own \"ferry.store\"")
        return found

    def _open_store(self, layout, device=None):
        """The worker's store: the registered one, or one opened from the config."""
        found = registered_store(self._name)
        if found is not None and self._spmd:
            raise ValueError(
                f"ferry: vLLM connector: a store is registered as {self._name!r} in this "
                "rank's process; under distributed_executor_backend=\"external_launcher\" "
                "it holds this rank's chunks alone while the scheduler counts what the "
                "\"ferry.server\" daemon holds for every rank: register none, each worker "
                "opens its client of \"ferry.server\" itself")
        found = self._registered()     # (another model's or engine's: refused)
        e = self._extra
        if found is None and (self._server or "ferry.l1" in e):
            rank, world = _tp_rank_world(self._vllm_config)
            where = (dict(server=self._server) if self._server else
                     dict(l1=e["ferry.l1"],
                          l2=_rank_l2(e.get("ferry.l2"), _rank_name(self._vllm_config)),
                          persistent=_flag(e, "ferry.persistent")))
            found = KVStore(model=self._model_name(), layout=layout,
                            chunk_tokens=_chunk_tokens(e), tp_rank=rank, tp_world=world,
                            device=device, **where)
            _mark_opener(found, "vLLM", self._model_name(), self._owner())
            try:
                register_store(self._name, found)
            except ValueError:   # (another thread's registered meanwhile)
                found.close()
                raise
            self._opened = True
        self._store = found
        return self.store

    # ==== scheduler side ====
    def _check_groups(self):
        """Once the store is known: a sliding window shorter than a chunk
        cannot be stored (its older blocks are gone before the chunk is whole)."""
        if self._checked:
            return
        self._checked = True
        sliding = [g for g in self._cached if g.kind == "sliding"]
        chunk = self.store.chunk_tokens if sliding and not self._disabled else 0
        short = [g.idx for g in sliding if g.window < chunk]
        if short:
            self._disabled = (f"sliding-window group(s) {short} have a window shorter than "
                              f"ferry's {chunk}-token chunk")
        if self._disabled:
            log.warning("ferry: vLLM connector: %s; ferry neither loads nor stores for "
                        "this model", self._disabled)

    def _bound_meta(self):
        """The bound FerryConnectorMetadata, or a TypeError naming what was bound
        (another connector's metadata would fail deep inside otherwise)."""
        meta = self._get_connector_metadata()
        if not isinstance(meta, FerryConnectorMetadata):
            raise TypeError(f"ferry: the bound connector metadata is {type(meta).__name__}, "
                            "not the FerryConnectorMetadata build_connector_meta returns")
        return meta

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        """Tokens ferry can supply beyond vLLM's num_computed_tokens: the whole
        chunks every cached group holds (never the last prompt token). Second:
        True with "ferry.async_load" (vLLM allocates the blocks and goes on
        scheduling while the load runs; get_finished reports its end)."""
        if isinstance(num_computed_tokens, bool) or not isinstance(num_computed_tokens, int) \
                or num_computed_tokens < 0:
            # a negative count would be answered with tokens ferry does not hold
            raise ValueError(f"ferry: num_computed_tokens is an integer >= 0, got "
                             f"{num_computed_tokens!r} (request {request.request_id!r})")
        tokens = list(getattr(request, "all_token_ids", None) or request.prompt_token_ids or [])
        prompt = getattr(request, "prompt_token_ids", None)
        st = self._reqs.get(request.request_id)
        if st is None:
            st = self._reqs[request.request_id] = _Req(tokens=tokens)
        prompt_len = len(prompt) if prompt is not None else len(tokens)
        self._salt_round(st, request, prompt_len)
        st.tokens, salt = tokens, st.salt
        st.prompt_len = prompt_len
        st.local = num_computed_tokens
        self._check_groups()
        if self._disabled or not tokens:
            st.hit = 0
            return 0, False
        hit, error = 0, None
        try:
            hit = self._least_hit(tokens, salt)
        except Exception as e:  # (every rank of an external_launcher engine must hear it)
            error = e
        st.hit = self._agree(hit, error)
        if self._events_on:
            self._note_removed(st)
        st.saved = max(st.saved, st.hit)
        usable = min(st.hit, len(tokens) - 1)   # vLLM computes at least the last token
        n = max(0, usable - num_computed_tokens)
        st.async_load = self._async_load and n > 0
        return n, st.async_load

    def _least_hit(self, tokens, salt):
        """The least of every key's hit (_key_salts: TP ranks x groups x
        stages, a daemon round trip each), asked one after the other: each
        asks only for the whole chunks the least so far covers (the keys
        are chained, so a prefix's hit is the hit capped at it), and the
        first that holds none ends the lookup: the least is 0 whatever the
        others hold. The same answer as asking every key for every token."""
        least = len(tokens)
        for s, k in self._key_salts(salt):
            least = s.lookup(tokens[:least], salt=k)
            if least <= 0:
                return 0
        return least

    def _salt_round(self, st, request, prompt_len):
        """Salt the request: once (prompt embeddings are hashed), and again
        at each later round of a streaming session, whose prompt grew (vLLM's
        resumable requests: Scheduler._update_request_as_session extends the
        same request's prompt with the last round's computed tokens and the
        round's input, and its multimodal inputs with the round's). A round's
        chunks are keyed by what its tokens were computed with: a salt that
        changed (a new image) leaves none of the request's chunks known
        stored under it, and drops the pins taken under the old one."""
        if st.salted and prompt_len <= st.prompt_len:
            return
        salt = _salt_of(request)
        if self._kv_format is not None:     # (see _kv_format)
            salt = f"{salt or ''}\0kv-dtype\0{self._kv_format}"
        if st.salted and salt != st.salt:
            self._unpin(st)
            st.saved = 0
        st.salt, st.salted, st.lora = salt, True, _lora_of(request)

    def _next_round(self, st, request):
        """A streaming session's next round, which vLLM schedules with the
        tokens it computed before (num_computed_tokens above 0: no lookup)
        and tells the connector of only here: its tokens (the grown prompt)
        and salt, so that build_connector_meta stores the round's chunks.
        vLLM keeps a session's blocks between its rounds, and the KV at
        each position below num_computed_tokens is that of the token now
        there (vLLM's own prefix cache counts on it too)."""
        prompt = getattr(request, "prompt_token_ids", None)
        if prompt is None or len(prompt) <= st.prompt_len:
            return
        tokens = list(getattr(request, "all_token_ids", None) or prompt)
        self._salt_round(st, request, len(prompt))
        if tokens[:st.saved] != st.tokens[:st.saved]:   # (not a continuation: store anew)
            st.saved = 0
        st.tokens, st.prompt_len = tokens, len(prompt)

    def update_state_after_alloc(self, request, blocks, num_external_tokens):
        """vLLM allocated blocks: a load is planned when num_external_tokens > 0;
        its chunks are pinned until the request finishes (or, load-async, until
        vLLM allocates again once the load is over: num_external_tokens 0)."""
        st = self._reqs.get(request.request_id)
        if st is None:
            return
        if num_external_tokens <= 0:
            st.load = None
            self._unpin(st)
            self._next_round(st, request)
            return
        skip, need = st.local, st.local + num_external_tokens
        self._unpin(st)
        chunk = self.store.chunk_tokens
        end = min(st.hit, -(-need // chunk) * chunk)
        st.pinned = [s.pin(st.tokens[:end], salt=k) if end else 0
                     for s, k in self._key_salts(st.salt)]
        st.load = (skip, need, end)
        if st.async_load:  # the request is not scheduled until the load is over
            st.group_ids = _block_ids_of(blocks)
            st.block_ids = list(st.group_ids[0]) if st.group_ids else []
            self._async_ready.append(request.request_id)

    def build_connector_meta(self, scheduler_output):
        """This step's loads (planned by update_state_after_alloc; load-async
        ones as soon as their blocks exist) and saves (each scheduled request's
        prompt chunks completed by this step)."""
        meta = FerryConnectorMetadata()
        meta.preempted = set(getattr(scheduler_output, "preempted_req_ids", None) or ())
        ready, self._async_ready = self._async_ready, []
        for rid in ready:
            st = self._reqs.get(rid)
            if st is not None and st.load is not None:
                self._plan_load(meta, rid, st, True)
        sched = scheduler_output.num_scheduled_tokens
        for new in scheduler_output.scheduled_new_reqs:
            st = self._reqs.get(new.req_id)
            if st is None:
                # never looked up (a MultiConnector that stops at the first
                # connector with a hit): its cache_salt is not in NewRequestData,
                # so it is not stored (a miss later, never another tenant's key)
                continue
            st.group_ids = [list(x) for x in new.block_ids]
            st.block_ids = list(st.group_ids[0])
            self._plan(meta, new.req_id, st, new.num_computed_tokens,
                       new.num_computed_tokens + sched.get(new.req_id, 0))
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
                if resumed or not st.group_ids:
                    st.group_ids = [list(x) for x in new_ids]
                else:
                    st.group_ids = [old + list(x) for old, x in zip(st.group_ids, new_ids)]
                st.block_ids = list(st.group_ids[0])
            self._plan(meta, rid, st, cached.num_computed_tokens[i],
                       cached.num_computed_tokens[i] + sched.get(rid, 0))
        return meta

    def _groups_ids(self, st):
        return tuple(list(x) for x in st.group_ids) if len(self._groups) > 1 else ()

    def _plan_load(self, meta, rid, st, is_async):
        skip, need, end = st.load
        meta.loads.append(LoadSpec(rid, st.tokens[:end], list(st.block_ids), skip, need,
                                   st.salt, self._groups_ids(st), is_async))
        st.load = None
        st.deferred = st.deferred or is_async

    def _plan(self, meta, rid, st, before, computed):
        if st.load is not None:
            self._plan_load(meta, rid, st, False)
        if self._disabled:
            return
        chunk = self.store.chunk_tokens
        end = min(computed, st.prompt_len) // chunk * chunk
        if end > st.saved:
            meta.saves.append(SaveSpec(rid, st.tokens[:end], list(st.block_ids), st.salt,
                                       self._groups_ids(st), before))
            if self._events_on:
                self._note_stored(st, st.saved, end)
            st.saved = end
            st.deferred = st.deferred or self._async_save

    def request_finished(self, request, block_ids):
        """The request is done (or aborted): drop its pins and state. True
        (vLLM keeps its blocks until get_finished names it) when a load-async
        or a "ferry.async_save" store of it may still touch its blocks;
        synchronous saves end with their step, so vLLM may free at once."""
        st = self._reqs.pop(request.request_id, None)
        if st is None:
            return False, None
        self._unpin(st)
        if st.deferred:
            self._held.add(request.request_id)
        return st.deferred, None

    def request_finished_all_groups(self, request, block_ids):
        """SupportsHMA: request_finished with every group's block ids."""
        return self.request_finished(request, block_ids)

    def update_connector_output(self, connector_output):
        """The workers' report of a step: the finished requests whose blocks
        ferry held (request_finished returned True) are released."""
        for rid in (getattr(connector_output, "finished_sending", None) or ()):
            self._held.discard(rid)
        for rid in (getattr(connector_output, "finished_recving", None) or ()):
            self._held.discard(rid)

    def has_pending_block_frees(self):
        """True while finished requests' blocks wait on ferry's async stores
        or loads: vLLM then waits for them instead of preempting a running
        request when it runs out of blocks (Scheduler.schedule)."""
        return bool(self._held)

    def _key_salts(self, salt):
        """(store, salt) of every key a hit needs: each cached group's, of
        every pipeline stage, of every TP rank (a chunk is a hit once every
        worker holds it)."""
        return [(store, _stage_salt(_group_salt(salt, g.idx), s, self._stages))
                for store in self._rank_stores()
                for g in self._cached for s in range(self._stages)]

    def _unpin(self, st):
        if not st.pinned:   # (nothing to reach a store for: a model ferry is off for has none)
            return
        for (s, k), n in zip(self._key_salts(st.salt), st.pinned):
            if n:
                s.unpin(st.tokens[:n], salt=k)
        st.pinned = []

    # ---- KV events (for KV-aware routers) ----
    def _chunk_hashes(self, st, end):
        """Event ids of the request's chunks up to `end`: ferry's chained chunk
        hashes, with the request's salt folded in."""
        chunk = self.store.chunk_tokens
        salt = (st.salt or "").encode() if isinstance(st.salt or "", str) else bytes(st.salt)
        return [int.from_bytes(hashlib.blake2b(salt + h, digest_size=8).digest(), "little")
                for h in hash_chunks(st.tokens[:end], chunk)]

    def _note_stored(self, st, start, end):
        chunk = self.store.chunk_tokens
        hashes = self._chunk_hashes(st, end)
        first = start // chunk
        new = [h for h in hashes[first:] if h not in self._published]
        if not new:
            return
        self._published.update(new)
        self._events.append(_kv_event(
            BlockStored, block_hashes=new,
            parent_block_hash=hashes[first - 1] if first else None,
            token_ids=list(st.tokens[start:end]), block_size=chunk, lora_id=st.lora[1],
            medium="CPU", lora_name=st.lora[0]))

    def _note_removed(self, st):
        """Chunks published as stored that this lookup no longer finds."""
        chunk = self.store.chunk_tokens
        end = len(st.tokens) // chunk * chunk
        if end <= st.hit:
            return
        gone = [h for h in self._chunk_hashes(st, end)[st.hit // chunk:] if h in self._published]
        if gone:
            self._published.difference_update(gone)
            self._events.append(_kv_event(BlockRemoved, block_hashes=gone, medium="CPU"))
            st.saved = min(st.saved, st.hit)

    def take_events(self):
        """KV events since the last call: BlockStored when a save of new chunks
        is planned, BlockRemoved when a lookup no longer finds chunks published
        as stored (evicted, or a save that found ferry full), AllBlocksCleared
        after reset_cache. Collected when vLLM's kv_events_config enables KV
        cache events (or "ferry.kv_events"). A LoRA request's BlockStored
        names its adapter (lora_name, and lora_id), as vLLM's own do."""
        out, self._events = self._events, []
        return out

    def reset_cache(self):
        """vLLM's reset of the prefix cache reaching the connector: clear
        ferry's store. False when it cannot be (a lookup-only client)."""
        try:
            self.store.clear()
        except FerryError as e:
            log.warning("ferry: vLLM connector: reset_cache: %s", e)
            return False
        for st in self._reqs.values():
            st.saved = 0
        self._published.clear()
        if self._events_on:
            self._events.append(AllBlocksCleared())
        return True

    # ==== worker side ====
    @property
    def prefer_cross_layer_blocks(self):
        """True with "ferry.cross_layer_blocks": vLLM then allocates one tensor
        for every layer (register_cross_layers_kv_cache). ferry reads either
        form by strides; the per-layer form is the default."""
        return self._cross_layer

    def register_cross_layers_kv_cache(self, kv_cache, attn_backend=None):
        """vLLM's one KV cache tensor for every layer. vLLM hands it over in
        its physical order (KVConnectorModelRunnerMixin.allocate_uniform_kv_caches
        views the buffer as [num_layers, *get_kv_cache_shape] permuted by
        attn_backend.get_kv_cache_stride_order(include_num_layers_dimension=True):
        FlashAttention's NHD is [num_blocks, num_layers, 2, block_size, heads,
        head_dim]); the inverse permutation gives num_layers first again, as
        vLLM's own per-layer views are taken. A backend without that stride
        order (or none) means the tensor is num_layers first already. Each
        layer's slice is a paged cache read by its strides; the layers are
        named as vLLM's KV cache groups name them, in layer order."""
        kv_cache = _layers_first(kv_cache, attn_backend)
        names = []
        for g in self._groups:
            names.extend(g.layer_names or [])
        names = _layer_order(list(dict.fromkeys(names)))
        n = kv_cache.shape[0]
        if not names:
            names = [f"model.layers.{i}.attn" for i in range(n)]
        if len(names) != n:
            raise ValueError(f"ferry: vLLM connector: a cross-layer cache of {n} layers for "
                             f"{len(names)} layers in the KV cache groups")
        self.register_kv_caches({name: kv_cache[i] for i, name in enumerate(names)})

    def register_kv_caches(self, kv_caches):
        """vLLM's per-layer caches (layer name -> tensor), grouped as vLLM's KV
        cache groups and in layer order within each."""
        names = _layer_order(list(kv_caches))
        # only the cached groups' layers are paged KV: a Mamba layer's cache
        # is a list of state tensors, read by no one here
        wanted = set()
        for g in self._cached:
            wanted.update(g.layer_names if g.layer_names else names)
        byname = {n: paged_view(kv_caches[n]) for n in names if n in wanted}
        if self._stages > 1:   # vLLM's pipeline group is up by the time caches exist
            from vllm.distributed import get_pp_group
            self._stage = int(get_pp_group().rank_in_group)
        groups = {}
        for g in self._cached:
            layer_names = g.layer_names if g.layer_names else names
            missing = [n for n in layer_names if n not in byname]
            if missing:
                raise ValueError(f"ferry: vLLM connector: KV cache group {g.idx} names layers "
                                 f"{missing} that vLLM registered no cache for")
            groups[g.idx] = [byname[n] for n in _layer_order(layer_names)]
        if not groups:  # every group skipped: nothing to move, nothing to open
            self._layer_names = names
            return
        first = groups[self._cached[0].idx]
        layout = Layout.from_kv_caches(first)
        for idx, caches in groups.items():
            other = Layout.from_kv_caches(caches)
            if other != layout:
                raise ValueError(f"ferry: vLLM connector: KV cache group {idx} is {other}, "
                                 f"group {self._cached[0].idx} is {layout}; one store holds "
                                 "one layout")
        dev = first[0].device if torch is not None and isinstance(first[0], torch.Tensor) \
            else None
        store = self._open_store(layout, f"cuda:{dev.index or 0}"
                                 if dev is not None and dev.type == "cuda" else None)
        if store.layout != layout:
            raise ValueError(f"ferry: vLLM's caches are {layout}, the store {self._name!r} "
                             f"holds {store.layout}")
        for caches in groups.values():
            store._buffer(caches, [0], True)  # dtype, device, strides: refused now
        self._layer_names = names
        self._layer_pos = {}
        for g in self._cached:
            for i, n in enumerate(_layer_order(g.layer_names if g.layer_names else names)):
                self._layer_pos[n] = (g.idx, i)
        self._layer_index = {n: i for i, n in enumerate(names)}
        self._gcaches = groups
        self._gbs = {idx: (c[0].shape[2] if layout.kv == 2 else c[0].shape[1])
                     for idx, c in groups.items()}
        self._caches = first
        self._layout = layout
        self._block_size = self._gbs[self._cached[0].idx]

    def _targets(self, spec):
        """(group, caches, block ids, skip, salt) for each cached group of a load
        or save. A sliding-window group is written only inside its window: the
        blocks below it are vLLM's null blocks. A save's skip is the tokens
        its chunks must already be in ferry up to (see _hold)."""
        chunk = self.store.chunk_tokens
        for g in self._cached:
            ids = list(spec.groups[g.idx]) if spec.groups else list(spec.block_ids)
            skip = getattr(spec, "skip", 0)
            if g.kind == "sliding" and isinstance(spec, LoadSpec):
                skip = max(skip, spec.need - g.window + 1)
            elif g.kind == "sliding":
                gone = max(0, spec.start - g.window + 1)
                skip = min(len(spec.tokens), -(-gone // chunk) * chunk)
            yield (g, self._gcaches[g.idx], ids, skip,
                   _stage_salt(_group_salt(spec.salt, g.idx), self._stage, self._stages))

    def _hold(self, spec, g, salt, below):
        """A save of a sliding-window group reads nothing below its window:
        vLLM gave those blocks back when it computed them (the null block in
        their place, or a block since reused, which the worker's block table
        still names). Its chunks below `below` must be in ferry already, so
        they are pinned for the store, which then skips them as present.
        Returns the tokens pinned (0: none needed), or None when ferry lacks
        one: the group's save is skipped (a later chunk with an earlier one
        missing could never be found)."""
        if below <= 0:
            return 0
        n = self.store.pin(spec.tokens[:below], salt=salt)
        if n >= below:
            return n
        if n:
            self.store.unpin(spec.tokens[:n], salt=salt)
        self.saves_skipped += 1
        self._stats["saves_skipped"] += 1
        log.info("ferry: request %s: group %d: store skipped: its chunks below token %d "
                 "are not in ferry and vLLM no longer holds their blocks", spec.req_id,
                 g.idx, below)
        return None

    def _release(self, spec, salt, held):
        if held:
            try:
                self.store.unpin(spec.tokens[:held], salt=salt)
            except FerryError as e:
                log.warning("ferry: request %s: unpin after store: %s", spec.req_id, e)

    def start_load_kv(self, forward_context, **kwargs):
        """Load every planned request's chunks into its blocks, all layers (the
        layerwise form: start them; load-async: start them and return)."""
        if not self.has_connector_metadata():
            return
        for spec in self._bound_meta().loads:
            if self._caches is None:
                raise RuntimeError("ferry: vLLM connector: a load before register_kv_caches")
            if spec.is_async:
                self._load_async(spec)
            elif self._layerwise:
                self._load_start(spec)
            else:
                self._load(spec)

    def _load(self, spec):
        for g, caches, ids, skip, salt in self._targets(spec):
            got = 0
            if spec.tokens:  # tokens below skip are vLLM's own blocks: never written
                try:
                    got = self.store.retrieve(spec.tokens, caches, ids, salt=salt, skip=skip)
                except FerryError as e:   # (its blocks reported: vLLM recomputes or fails)
                    log.warning("ferry: request %s: load failed: %s", spec.req_id, e)
            self._loaded(spec, g, ids, skip, got)

    def _load_async(self, spec):
        ops = self._async_loads.setdefault(spec.req_id, [])
        self._deferred.add(spec.req_id)
        self._stats["async_loads"] += 1
        for g, caches, ids, skip, salt in self._targets(spec):
            op = None
            if spec.tokens:
                try:
                    op = self.store.retrieve_async(spec.tokens, caches, ids, salt=salt, skip=skip)
                except FerryError as e:
                    log.warning("ferry: request %s: load not started: %s", spec.req_id, e)
            ops.append([spec, g, ids, skip, op])

    def _load_start(self, spec):
        """Layerwise: start the load; its layers are waited for one by one."""
        for g, caches, ids, skip, salt in self._targets(spec):
            if not spec.tokens:
                self._loaded(spec, g, ids, skip, 0)
                continue
            try:
                op = self.store.retrieve_layers(spec.tokens, caches, ids, salt=salt, skip=skip)
            except FerryError as e:
                log.warning("ferry: request %s: load not started: %s", spec.req_id, e)
                self._loaded(spec, g, ids, skip, 0)
                continue
            self._loading.append([spec, g, ids, skip, op])

    @staticmethod
    def _result(spec, op):
        """Tokens an operation loaded; 0 when it failed (its blocks recomputed)."""
        if op is None:
            return 0
        try:
            return op.wait()
        except FerryError as e:
            log.warning("ferry: request %s: load failed: %s", spec.req_id, e)
            return 0

    def _load_finish(self, entries=None):
        """Layerwise: these loads (default: all of the step's) are over; report
        what came short."""
        if entries is None:
            entries, self._loading = self._loading, []
        for spec, g, ids, skip, op in entries:
            self._loaded(spec, g, ids, skip, self._result(spec, op))

    def _loaded(self, spec, g, ids, skip, got):
        if self._spmd and not spec.is_async:
            self._agreeing.append((spec, g, ids, skip, got))   # (reported once agreed)
            return
        self._report_load(spec, g, ids, skip, got)

    def _agree_loads(self):
        """Under external_launcher at TP x PP x PCP above one, each rank's
        worker reports its load errors to its own rank's scheduler alone:
        a load short on one rank (a chunk failed its checksum there) had
        that rank's scheduler recompute or fail the request while the
        others went on, and their schedules parted (their collectives
        hang). The ranks load the same plan (their schedulers agree every
        hit), so each step's loads are the same on every rank: the ranks
        take the least each load got, over the group of the engine's
        ranks, and every rank reports the same blocks. Called where the
        step's loads are over (wait_for_save, and
        get_block_ids_with_load_errors for an engine that skips it)."""
        entries, self._agreeing = self._agreeing, []
        if not entries:
            return
        group = _REPLICA_GROUP.get(_replica_span(self._vllm_config))
        if group is None:
            log.warning("ferry: vLLM connector: under external_launcher no scheduler of "
                        "this process made the group the ranks agree over; this rank "
                        "reports its own loads")
        else:
            import torch.distributed as dist
            entries.sort(key=lambda e: (str(e[0].req_id), e[1].idx))
            t = torch.tensor([max(0, int(e[4])) for e in entries], dtype=torch.int64)
            dist.all_reduce(t, op=dist.ReduceOp.MIN, group=group)
            entries = [e[:4] + (v,) for e, v in zip(entries, t.tolist())]
        for e in entries:
            self._report_load(*e)

    def _report_load(self, spec, g, ids, skip, got):
        self._stats["loads"] += 1
        self._stats["load_tokens"] += max(0, min(got, spec.need) - skip)
        if got < spec.need:
            bs = self._gbs[g.idx]
            first = max(got, skip) // bs
            last = -(-spec.need // bs)
            bad = ids[first:last]
            if self._fail_requests and spec.is_async:
                # the whole request is recomputed (or failed): vLLM cannot map a
                # block id of one of several groups back to its request
                self._failed_recving.add(spec.req_id)
                self._stats["load_error_blocks"] += len(bad)
                log.warning("ferry: request %s: group %d: loaded %d of %d tokens; the "
                            "request reported failed to vLLM (kv_load_failure_policy %r)",
                            spec.req_id, g.idx, got, spec.need, self._failure_policy)
                return
            self._load_errors.update(bad)
            self._stats["load_error_blocks"] += len(bad)
            log.warning("ferry: request %s: group %d: loaded %d of %d tokens; blocks %s "
                        "reported to vLLM (kv_load_failure_policy %r: %s)", spec.req_id, g.idx,
                        got, spec.need, bad, self._failure_policy,
                        "it recomputes them" if self._failure_policy == "recompute"
                        else "it fails the request")

    def wait_for_layer_load(self, layer_name):
        """Layerwise: until this layer of every planned load is in vLLM's
        blocks (whole form: start_load_kv loaded every layer already)."""
        if not self._loading:
            return
        pos = self._layer_pos.get(layer_name)
        if pos is None:     # a layer without a cache ferry loads (as save_kv_layer)
            return
        gidx, idx = pos
        done = []
        for e in self._loading:
            spec, g, _, _, op = e
            if g.idx != gidx:
                continue
            try:
                op.wait_layer(idx)
            except FerryError as err:  # reported, with its blocks, when the load ends
                log.debug("ferry: request %s: layer %d: %s", spec.req_id, idx, err)
            if idx == len(self._gcaches[gidx]) - 1:
                done.append(e)
        if done:
            self._loading = [e for e in self._loading if all(e is not d for d in done)]
            self._load_finish(done)

    def save_kv_layer(self, layer_name, kv_layer, attn_metadata, **kwargs):
        """Layerwise: hand this layer of every planned save over as soon as
        the forward wrote it (whole form: wait_for_save stores all layers).
        A store that refuses the layer (handed over twice, its tensor moved)
        is cancelled and counted skipped: nothing raises into the forward."""
        if not self._layerwise or not self.has_connector_metadata():
            return
        if self._saving is None:
            self._saving = []
            for spec in self._bound_meta().saves:
                for g, caches, ids, below, salt in self._targets(spec):
                    held = self._hold(spec, g, salt, below)
                    if held is None:
                        continue
                    try:
                        op = self.store.store_layers(spec.tokens, caches, ids, salt=salt)
                    except FerryError as e:
                        self._release(spec, salt, held)
                        if e.code not in _SKIPPABLE:
                            raise
                        self._skipped(spec, e)
                        continue
                    self._saving.append([spec, g, op, (salt, held), None])
        pos = self._layer_pos.get(layer_name)
        if pos is None:
            return
        for entry in self._saving:
            spec, g, op, _, failed = entry
            if g.idx != pos[0] or failed is not None:
                continue
            try:
                op.layer_done(pos[1])
            except FerryError as e:
                # (inside the forward: never raised there) the store ends,
                # nothing of it stored; counted when the step's saves end
                op.cancel()
                entry[4] = e

    def _skipped(self, spec, e):
        self.saves_skipped += 1
        self._stats["saves_skipped"] += 1
        log.warning("ferry: request %s: store skipped: %s", spec.req_id, e)

    def _saved(self, spec, op, pin=None):
        """A store is over: count it, or skip it when ferry was full; drop
        the pins _hold took for it."""
        try:
            self._saved_op(spec, op)
        finally:
            if pin is not None:
                self._release(spec, *pin)

    def _saved_op(self, spec, op):
        try:
            op.wait()
        except FerryError as e:
            if op.done() is False:  # a layer never came: store nothing
                op.cancel()
                self._skipped(spec, e)
                return
            if e.code not in _SKIPPABLE:
                raise
            self._skipped(spec, e)
            return
        self._stats["saves"] += 1
        self._stats["save_tokens"] += len(spec.tokens)

    def _save_finish(self):
        """The step's layerwise stores end, every one of them (its pins
        dropped) before the first that failed is raised."""
        saving, self._saving = self._saving or [], None
        error = None
        for spec, _, op, pin, failed in saving:
            if failed is not None:
                self._release(spec, *pin)
                self._skipped(spec, failed)
                continue
            try:
                self._saved(spec, op, pin)
            except FerryError as e:
                error = error or e
        if error is not None:
            raise error

    def wait_for_save(self):
        """Store this step's planned chunks from all layers (after the forward
        wrote them); layerwise: wait until every layer was handed over and the
        chunks are stored. With "ferry.async_save" the stores are started and
        not waited for: request_finished keeps the request's blocks until
        get_finished reports its stores over (a sliding-window group's
        stores excepted: vLLM frees its blocks below the window while the
        request still runs, so they end here). A store that finds ferry full
        is skipped and counted."""
        if self._loading:  # (a forward that skipped some layer's wait)
            self._load_finish()
        self._agree_loads()
        if not self.has_connector_metadata():
            return
        if self._layerwise:
            self._save_finish()
            return
        for spec in self._bound_meta().saves:
            for g, caches, ids, below, salt in self._targets(spec):
                held = self._hold(spec, g, salt, below)
                if held is None:
                    continue
                try:
                    # a sliding group's blocks below its window are freed while
                    # the request runs (no preemption reported): stored now
                    if self._async_save and g.kind != "sliding":
                        op = self.store.store_async(spec.tokens, caches, ids, salt=salt)
                        self._saves_inflight.setdefault(spec.req_id, []).append(
                            (spec, op, (salt, held)))
                        held = 0   # released when the store is reaped
                        continue
                    self.store.store(spec.tokens, caches, ids, salt=salt)
                    self._stats["saves"] += 1
                    self._stats["save_tokens"] += len(spec.tokens)
                except FerryError as e:
                    if e.code not in _SKIPPABLE:
                        raise
                    self._skipped(spec, e)
                finally:
                    self._release(spec, salt, held)
            if self._async_save:
                self._deferred.add(spec.req_id)

    def _reap_saves(self, rid, block):
        ops = self._saves_inflight.get(rid)
        if ops is None:
            return True
        if not block and not all(op.done() for _, op, _ in ops):
            return False
        for spec, op, pin in self._saves_inflight.pop(rid):
            self._saved(spec, op, pin)
        return True

    def _reap_loads(self, rid):
        entries = self._async_loads.get(rid)
        if entries is None:
            return True
        if not all(op is None or op.done() for *_, op in entries):
            return False
        for spec, g, ids, skip, op in self._async_loads.pop(rid):
            self._loaded(spec, g, ids, skip, self._result(spec, op))
        return True

    def _transfers(self, finished_req_ids):
        """(sending, recving, failed) since the last call; see get_finished."""
        for rid in finished_req_ids or ():
            if rid in self._deferred:
                self._finishing.add(rid)
                for *_, op in self._async_loads.get(rid, ()):  # aborted while loading
                    if op is not None:
                        op.cancel()
        recving = {rid for rid in list(self._async_loads) if self._reap_loads(rid)}
        for rid in list(self._saves_inflight):
            self._reap_saves(rid, False)
        sending = {rid for rid in self._finishing
                   if rid not in self._saves_inflight and rid not in self._async_loads}
        # A request aborted while loading is named once: vLLM frees a finished
        # request's blocks on either report and asserts it still knows the
        # request on the second (Scheduler._update_from_kv_xfer_finished).
        sending -= recving
        done = sending | (recving & self._finishing)
        self._finishing -= done
        self._deferred -= done
        failed, self._failed_recving = self._failed_recving & recving, set()
        return sending, recving, failed

    def get_finished(self, finished_req_ids):
        """(requests whose blocks vLLM may free now, requests whose load-async
        is over). The first set names only requests vLLM said finished and
        whose request_finished returned True: their async stores (and an
        aborted request's async load) are over. A load's failed blocks are in
        get_block_ids_with_load_errors no later than the call that names it."""
        sending, recving, _ = self._transfers(finished_req_ids)
        return (sending or None), (recving or None)

    def get_transfer_results(self, finished_req_ids):
        """get_finished as vLLM after 003df296 asks for it (one
        KVConnectorTransferResults): with several KV cache groups, an async
        load that came short is in failed_recving (and finished_recving)
        instead of get_block_ids_with_load_errors."""
        sending, recving, failed = self._transfers(finished_req_ids)
        return KVConnectorTransferResults(finished_sending=sending, finished_recving=recving,
                                          failed_recving=failed)

    def handle_preemptions(self, kv_connector_metadata, connector_metadata=None):
        """Before a preempted request's blocks are reused: its async stores
        finish reading them. vLLM after 003df296 passes the step's connector
        metadata (build_connector_meta put scheduler_output.preempted_req_ids
        in it); vLLM before it passes scheduler_output.preempted_req_ids
        itself, a set of request ids (base.py at 13f4ad0f:
        handle_preemptions(self, preempted_req_ids: set[str])), and some
        engines pass both, ids first."""
        ids = set()
        for arg in (kv_connector_metadata, connector_metadata):
            if arg is None:
                continue
            if isinstance(arg, (set, frozenset, list, tuple)):
                ids.update(arg)
            else:
                ids.update(getattr(arg, "preempted", None) or ())
        for rid in ids:
            self._reap_saves(rid, True)

    def get_block_ids_with_load_errors(self):
        """Blocks the step's loads did not fill. vLLM asks after the target's
        forward, and with a drafter whose KV is saved before the drafter's
        forward (KVConnectorModelRunnerMixin, defer_finalize): a layerwise
        load still waiting for a drafter layer's wait ends here, so that
        what it did not fill is reported in the step that loaded it."""
        if self._loading:
            self._load_finish()
        self._agree_loads()
        out, self._load_errors = self._load_errors, set()
        return out

    def get_kv_connector_stats(self):
        """This worker's FerryConnectorStats since the last call (None: nothing
        happened)."""
        if not any(self._stats.values()):
            return None
        out = FerryConnectorStats(data=dict(self._stats))
        self._stats = dict.fromkeys(_STAT_DOCS, 0)
        return out

    def shutdown(self):
        # a step cut short (the forward failed): its layerwise stores would
        # keep their chunks' slots write-locked, its loads their chunks pinned
        saving, self._saving = self._saving or [], None
        for spec, _, op, pin, _ in saving:
            op.cancel()
            self._release(spec, *pin)
        loading, self._loading = self._loading, []
        for *_, op in loading:
            op.cancel()
        for rid in list(self._async_loads):
            for *_, op in self._async_loads[rid]:
                if op is not None:
                    op.cancel()
            self._reap_loads(rid)
        for rid in list(self._saves_inflight):
            try:
                self._reap_saves(rid, True)
            except FerryError as e:
                log.warning("ferry: request %s: store at shutdown: %s", rid, e)
        for other in (self._ranks or [])[1:]:
            other.close()
        self._ranks = None
        if self._opened and self._store is not None:
            unregister = registered_store(self._name) is self._store
            if unregister:
                from . import unregister_store
                unregister_store(self._name)
            self._store.close()
            self._opened = False
        self._store = None


def _chosen_class(ktc):
    """The class a kv_transfer_config names "FerryConnector" in a module of
    its own (kv_connector_module_path), where that is not ferry's: a user's
    subclass (or class) vLLM's factory imports from that module when the
    name is not in its registry. ferry's class otherwise: no module path,
    ferry's own, or one with no "FerryConnector" (a name vLLM could then
    only have found registered). The user's module is imported as vLLM
    imports it: its failure is the user's to see, raised, as vLLM raises
    it. A class whose constructor takes no kv_cache_config is given one
    that drops it, since vLLM passes it to every registered class."""
    if ktc is None or getattr(ktc, "kv_connector", None) != "FerryConnector":
        return FerryConnector
    path = getattr(ktc, "kv_connector_module_path", None)
    if not isinstance(path, str) or not path or path == __name__:
        return FerryConnector
    import importlib
    cls = getattr(importlib.import_module(path), "FerryConnector", None)
    if not isinstance(cls, type) or cls is FerryConnector:
        return FerryConnector
    try:
        params = inspect.signature(cls.__init__).parameters
    except (TypeError, ValueError):
        return cls
    if "kv_cache_config" in params or any(
            p.kind == p.VAR_KEYWORD for p in params.values()):
        return cls
    if cls not in _compat:
        def __init__(self, vllm_config, role, kv_cache_config=None):
            cls.__init__(self, vllm_config, role)
        _compat[cls] = type(cls.__name__, (cls,), {
            "__init__": __init__, "__module__": cls.__module__,
            "__qualname__": cls.__qualname__, "__doc__": cls.__doc__})
    return _compat[cls]


_compat = {}    # a user's class -> its form that takes kv_cache_config


def _called_by_vllm(frame):
    """Whether frame (the one that called a class to build it) runs vLLM's
    code: its factory or a MultiConnector, not a user's module."""
    name = frame.f_globals.get("__name__", "") if frame is not None else ""
    return isinstance(name, str) and (name == "vllm" or name.startswith("vllm."))


def _factory_choice():
    """The class vLLM's KVConnectorFactory gets for the name "FerryConnector"
    that ferry registered (register_vllm_connector names this). That
    factory looks a name up in its registry before it reads
    kv_connector_module_path (vllm-project/vllm
    a4cd9d0d28bdb41db8dfe0acdafac2bf2f608630,
    vllm/distributed/kv_transfer/kv_connector/factory.py,
    _get_connector_class_with_compat), so ferry's registration would
    replace a user's own "FerryConnector" given by module path. Its
    registry's loader takes no argument: the config being resolved is the
    kv_transfer_config argument of the factory's frame that called it (a
    MultiConnector child's own, inside its create_connector; found by value
    should vLLM rename that argument), and _chosen_class answers for it. Without one (get_connector_class_by_name,
    for a MultiConnector's stats) ferry's class: the stats are a dict either
    way."""
    f = sys._getframe(1)
    for _ in range(16):
        if f is None:
            break
        ktc = _ferry_config_in(f.f_locals)
        if ktc is not None:
            return _chosen_class(ktc)
        f = f.f_back
    return FerryConnector


def _static(obj, name):
    """obj's attribute name as stored (inspect.getattr_static: no property,
    __getattr__ or descriptor of a stranger's object runs), or None."""
    try:
        return inspect.getattr_static(obj, name, None)
    except Exception:
        return None


def _ferry_config_in(local_vars):
    """The kv_transfer_config naming "FerryConnector" that a frame holds: its
    local of that name; in a frame of vLLM's KVConnectorFactory itself (a
    class method's cls), should vLLM rename that argument, any local that is
    such a config or a config holding one (looked at without running any of
    their code); else None."""
    def names_ferry(v):
        return v is not None and _static(v, "kv_connector") == "FerryConnector"
    ktc = local_vars.get("kv_transfer_config")
    if names_ferry(ktc):
        return ktc
    owner = local_vars.get("cls")
    if not (isinstance(owner, type) and owner.__name__ == "KVConnectorFactory"):
        return None
    for v in list(local_vars.values()):
        if names_ferry(v):
            return v
        inner = _static(v, "kv_transfer_config")
        if names_ferry(inner):
            return inner
    return None


def __getattr__(name):
    if name == "FerryConnectorByName":     # (PEP 562: asked each time)
        return _factory_choice()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


if VLLM:
    # vLLM loaded this module by kv_connector_module_path: from here on
    # "FerryConnector" is a name its KVConnectorFactory knows in this process
    # (a MultiConnector rebuilds its children's stats by name)
    try:
        register_vllm_connector()
    except Exception as _e:  # pragma: no cover - a vLLM whose factory will not load
        log.warning("ferry: vLLM connector: not registered with vLLM's "
                    "KVConnectorFactory: %s", _e)


# ==== ferry behind vLLM's own OffloadingConnector ====
def _tier_ranks(vllm_config, sizes=None):
    """The tier's place in vLLM's topology: "tp<rank>of<world>-pp..-pcp..",
    and DCP's size. A rank comes from vLLM's groups where this process is
    one (external_launcher, one process); vLLM's scheduler process, whose
    primary slot holds every worker's part, is "all" at a world above one.
    sizes: the parallel config's sizes by vLLM's ParallelConfig names, where
    they come from elsewhere (an OffloadingConfig's parallel)."""
    pc = getattr(vllm_config, "parallel_config", None) if sizes is None else None
    sizes = sizes or {}
    parts = []
    for name, attr, rank_of in (
            ("tp", "tensor_parallel_size", lambda d: d.get_tensor_model_parallel_rank()),
            ("pp", "pipeline_parallel_size", lambda d: d.get_pp_group().rank_in_group),
            ("pcp", "prefill_context_parallel_size", lambda d: d.get_pcp_group().rank_in_group)):
        world = int(sizes.get(attr, getattr(pc, attr, 1)) or 1)
        rank = 0
        if world > 1:
            try:
                import vllm.distributed as dist
                rank = int(rank_of(dist))
            except (ImportError, AssertionError, AttributeError, RuntimeError, TypeError):
                rank = "all"    # (groups not initialized here: vLLM's scheduler)
        parts.append(f"{name}{rank}of{world}")
    dcp = int(sizes.get("decode_context_parallel_size",
                        getattr(pc, "decode_context_parallel_size", 1)) or 1)
    return "-".join(parts) + f"-dcp{dcp}"


def _offload_identity(config, model, slot_bytes):
    """_tier_identity from the OffloadingConfig a vLLM whose OffloadingSpec
    holds no vllm_config gives its tiers (offloading_spec.config:
    OffloadingSpec.__init__(config) in vllm/v1/kv_offload/base.py, the
    fields of vllm/v1/kv_offload/config.py at vllm-project/vllm 0105e232b7fa
    / 006f89ace7ca): its model's name, the cache dtype (cache_config's
    name: "auto" is the model's), tokens a hash, blocks a chunk, the KV
    cache groups (tokens a block, layer names), a worker's bytes a block,
    the parallel sizes and the replicated layout. It tells no revision,
    model dtype or quantization: "model" names them where engines differ."""
    mc = getattr(config, "model", None)
    cc = getattr(config, "cache", None)
    pc = getattr(config, "parallel", None)
    if model is None:
        model = str(getattr(mc, "name", None))
    cache = getattr(mc, "dtype", None)
    cache = _KV_FORMAT_ALIASES.get(cache, cache) if isinstance(cache, str) else cache
    groups = "|".join(f"{getattr(g, 'tokens_per_block', None)}:"
                      f"{','.join(map(str, getattr(g, 'layer_names', None) or ()))}"
                      for g in (getattr(config, "groups", None) or ()))
    sizes = {attr: getattr(pc, name, 1) for attr, name in (
        ("tensor_parallel_size", "tp_size"), ("pipeline_parallel_size", "pp_size"),
        ("prefill_context_parallel_size", "pcp_size"),
        ("decode_context_parallel_size", "dcp_size"))}
    fields = (
        ("model", model), ("kv", cache),
        ("hash_block", getattr(cc, "tokens_per_hash", None)),
        ("chunk_blocks", getattr(cc, "blocks_per_chunk", None)), ("groups", groups),
        ("worker_bytes", getattr(config, "worker_kv_bytes_per_block", None)),
        ("slot", slot_bytes), ("ranks", _tier_ranks(None, sizes)),
        ("replicated", bool(getattr(config, "replicated_layout", False))),
        ("backend", os.environ.get("VLLM_ATTENTION_BACKEND")),
        ("layout", os.environ.get("VLLM_KV_CACHE_LAYOUT")))
    return "ferry-tier/1;offload;" + ";".join(f"{k}={v}" for k, v in fields)


def _tier_identity(vllm_config, model, slot_bytes, offload_config=None):
    """What the bytes of one of vLLM's primary slots are, the offload key
    aside: vLLM's offload keys hash the tokens alone (chained from a seed
    that PYTHONHASHSEED fixes across restarts), so the same prompt gives the
    same key under another model, cache dtype, geometry, rank or KV layout.
    The tier salts every key with this, and another engine never finds,
    let alone loads, this one's chunks in a persistent L2, a remote or a
    registered store. model: the tier's "model" setting, else vLLM's
    model and revision. offload_config: where vLLM gives no vllm_config,
    its OffloadingSpec's OffloadingConfig (_offload_identity). A
    ValueError with neither and no model."""
    if vllm_config is None and offload_config is not None:
        return _offload_identity(offload_config, model, slot_bytes)
    if vllm_config is None:
        if model is None:
            raise ValueError(
                "ferry: secondary tier: no vllm_config to tell the model, cache dtype and "
                "ranks its chunks are of (vLLM's offload keys hash the tokens alone, so "
                "another model's chunks would load as this one's): give \"model\", a name "
                "that changes with the model, its dtype, the cache dtype and the rank")
        return f"ferry-tier/1;model={model};slot={slot_bytes}"
    mc = getattr(vllm_config, "model_config", None)
    cc = getattr(vllm_config, "cache_config", None)
    ac = getattr(vllm_config, "attention_config", None)
    ktc = getattr(vllm_config, "kv_transfer_config", None)
    extra = getattr(ktc, "kv_connector_extra_config", None) or {}
    if model is None:
        model = f"{getattr(mc, 'model', None)}@{getattr(mc, 'revision', None)}"
    cache = getattr(cc, "cache_dtype", None)
    cache = _KV_FORMAT_ALIASES.get(cache, cache) if isinstance(cache, str) else cache
    fields = (
        ("model", model), ("dtype", getattr(mc, "dtype", None)),
        ("quant", getattr(mc, "quantization", None)), ("kv", cache),
        ("block", getattr(cc, "block_size", None)),
        ("offload_block", extra.get("block_size") if isinstance(extra, dict) else None),
        ("slot", slot_bytes), ("ranks", _tier_ranks(vllm_config)),
        ("backend", getattr(ac, "backend", None) or os.environ.get("VLLM_ATTENTION_BACKEND")),
        ("layout", os.environ.get("VLLM_KV_CACHE_LAYOUT")))
    return "ferry-tier/1;" + ";".join(f"{k}={v}" for k, v in fields)


class FerrySecondaryTier(SecondaryTierManager):
    """ferry as a secondary tier of vLLM's TieringOffloadingSpec: vLLM's CPU
    tier stays the primary (the one that moves KV to and from the GPU); ferry's
    L1, L2 (persistent or not) and remote hold the chunks it cascades down and
    promote them back. In kv_connector_extra_config:

        {"spec_name": "TieringOffloadingSpec", "cpu_bytes_to_use": ...,
         "secondary_tiers": [{"type": "FerrySecondaryTier",
                              "module_path": "ferry.adapters.vllm",
                              "l1": "8G", "l2": "/nvme/ferry:512G",
                              "persistent": True}]}

    ("ferry.store": NAME uses a store registered with
    ferry.adapters.register_store instead; it must have been opened with
    FerrySecondaryTier.layout_for(chunk_bytes) and chunk_tokens=TOKENS.)
    Its settings are l1, l2, persistent (a boolean setting, as the
    connector's), model, remote and "ferry.store"; any other key of its
    entry but vLLM's own ("type", "module_path", "backpressure",
    "tier_name") is refused with a ValueError naming it when vLLM builds
    the tier, as is l1, l2, ... beside "ferry.store"; a null one is not set.

    Each of vLLM's offload keys is one ferry chunk: the primary slot's bytes,
    kept as they are, under the key (ferry's salt; the chunk's tokens are a
    fixed filler) after the tier's identity (_tier_identity: vLLM's model,
    revision and dtype, the cache dtype, block and slot sizes, TP, PP and
    PCP ranks and sizes, attention backend and KV layout; the "model"
    setting, where given, stands for the model and revision). vLLM's keys
    hash the tokens alone, so without it a persistent L2, a remote or a
    registered store kept across a change of any of these would load
    another engine's bytes for the same prompt. Without vllm_config
    (vLLM's, or its OffloadingSpec's) the identity comes from the
    OffloadingSpec's OffloadingConfig (_offload_identity: no revision,
    model dtype or quantization there); without either the tier needs
    "model", and is a ValueError saying so; "model" may be given beside
    "ferry.store".
    Every method runs in vLLM's scheduler process and returns at once:
    submit_store and submit_load start ferry's asynchronous store or
    retrieve straight from or into the primary slots (their buffers stay
    pinned by vLLM until the job is reported), get_finished_jobs polls them.
    A promotion whose chunk failed its checksum or was evicted is reported
    failed (with the keys that did load), never as loaded."""

    medium = Medium.STORAGE
    TOKENS = 16   # tokens per chunk; each key's slot is one chunk

    def __init__(self, offloading_spec=None, primary_kv_view=None, tier_type="FerrySecondaryTier",
                 backpressure_detector=None, vllm_config=None, **config):
        args = {"offloading_spec": offloading_spec, "primary_kv_view": primary_kv_view,
                "tier_type": tier_type, "backpressure_detector": backpressure_detector,
                "vllm_config": vllm_config}
        params = inspect.signature(SecondaryTierManager.__init__).parameters
        super().__init__(**{k: v for k, v in args.items() if k in params})
        view = memoryview(primary_kv_view)
        self._chunk_bytes = int(view.strides[0])
        slots = np.frombuffer(view.cast("B") if view.ndim != 1 or view.format != "B" else view,
                              dtype=np.uint8)
        if slots.size % self._chunk_bytes:
            raise ValueError(f"ferry: primary view of {slots.size} bytes is not whole "
                             f"{self._chunk_bytes}-byte slots")
        self._slots = slots.reshape(-1, self._chunk_bytes)
        self._tokens = [0] * self.TOKENS
        layout = self.layout_for(self._chunk_bytes)
        config = self._settings(config)
        offload_config = None
        if vllm_config is None:   # (a vLLM that passes its OffloadingSpec: its vllm_config,
            vllm_config = getattr(offloading_spec, "vllm_config", None)   # or, newer, its
            if vllm_config is None:                                        # OffloadingConfig)
                offload_config = getattr(offloading_spec, "config", None)
        model = config.pop("model", None)
        if model is not None and (not isinstance(model, str) or not model):
            raise ValueError(f"ferry: secondary tier: \"model\" is a non-empty string, "
                             f"got {model!r}")
        self.identity = _tier_identity(vllm_config, None if model is None else str(model),
                                       self._chunk_bytes, offload_config)
        self._prefix = hashlib.blake2b(self.identity.encode(), digest_size=32).digest()
        log.info("ferry: secondary tier: chunks keyed under %s", self.identity)
        name = config.pop("ferry.store", None)
        self._own = False
        if name is not None:
            self.store = registered_store(name)
            if self.store is None:
                raise RuntimeError(f"ferry: secondary tier: no store registered as {name!r}")
        else:
            if "l1" not in config:
                raise ValueError("ferry: secondary tier needs \"l1\" (its host pool size) or "
                                 "\"ferry.store\"")
            self.store = KVStore(model="vllm-offload" if model is None else str(model),
                                 layout=layout,
                                 l1=config.pop("l1"), l2=config.pop("l2", None),
                                 persistent=_truthy(config.pop("persistent", False),
                                                    "'persistent'"),
                                 remote=config.pop("remote", None), chunk_tokens=self.TOKENS)
            self._own = True
        if self.store.layout != layout or self.store.chunk_tokens != self.TOKENS:
            raise ValueError(f"ferry: secondary tier: the store holds {self.store.layout} in "
                             f"{self.store.chunk_tokens}-token chunks; {self._chunk_bytes}-byte "
                             f"slots need {layout} in {self.TOKENS}-token chunks")
        self._jobs = {}       # job id -> (TransferJob, [(key, Op or None)])
        self._storing = {}    # key -> jobs storing it now
        self._events = []

    # the tier's settings (its entry of "secondary_tiers"), and the keys of
    # that entry vLLM's SecondaryTierFactory reads itself, which some of its
    # versions pass on to the tier ("module_path" where only "type" is popped)
    _SETTINGS = ("l1", "l2", "persistent", "model", "remote", "ferry.store")
    _VLLM_KEYS = ("type", "module_path", "backpressure", "tier_name")

    @classmethod
    def _settings(cls, config):
        """The tier's settings of config, as the connector takes its own:
        null is not set; a key the tier does not read (a misspelling would
        switch nothing: "persistant" keeps no L2) is a ValueError naming
        it, as is a store setting beside "ferry.store" (that store's are
        its own), when vLLM builds the tier."""
        config = {k: v for k, v in config.items()
                  if v is not None and k not in cls._VLLM_KEYS}
        unknown = sorted(str(k) for k in config if k not in cls._SETTINGS)
        if unknown:
            raise ValueError(f"ferry: secondary tier: unknown setting "
                             f"{', '.join(map(repr, unknown))}; it reads "
                             f"{', '.join(cls._SETTINGS)}")
        mine = sorted(k for k in config if k not in ("ferry.store", "model"))
        if "ferry.store" in config and mine:
            raise ValueError(f"ferry: secondary tier: with \"ferry.store\" the registered "
                             f"store's settings are its own: give no {', '.join(mine)}")
        return config

    @classmethod
    def layout_for(cls, chunk_bytes):
        """ferry's layout for opaque slots of chunk_bytes: one layer of bytes,
        TOKENS tokens a chunk."""
        if chunk_bytes <= 0 or chunk_bytes % cls.TOKENS:
            raise ValueError(f"ferry: a {chunk_bytes}-byte slot is not {cls.TOKENS} equal "
                             "token runs")
        per = chunk_bytes // cls.TOKENS
        heads = 1
        while per // heads > 4096 and per % (heads * 2) == 0:
            heads *= 2
        return Layout(1, heads, per // heads, "u8", kv=1)

    def salt(self, key):
        """The salt (bytes) the chunk of one of vLLM's offload keys is under
        in self.store: a fixed-length digest of the tier's identity
        (self.identity), then the key."""
        return self._prefix + key

    def _slot(self, chunk_id):
        return self._slots[int(chunk_id)].reshape(1, 1, self.TOKENS, -1)

    def lookup(self, key, req_context):
        if key in self._storing:
            return LookupResult.RETRY
        try:
            hit = self.store.lookup(self._tokens, salt=self.salt(bytes(key)))
        except FerryError as e:
            log.warning("ferry: secondary tier: lookup: %s", e)
            return LookupResult.MISS
        return LookupResult.HIT if hit >= self.TOKENS else LookupResult.MISS

    def submit_store(self, job_metadata):
        ops = []
        for key, cid in zip(job_metadata.keys, job_metadata.chunk_ids):
            key = bytes(key)
            op = None
            try:
                if self.store.lookup(self._tokens, salt=self.salt(key)) < self.TOKENS:
                    op = self.store.store_async(self._tokens, self._slot(cid),
                                                salt=self.salt(key))
                    self._storing[key] = self._storing.get(key, 0) + 1
                else:
                    op = True   # present already
            except FerryError as e:
                log.warning("ferry: secondary tier: store of job %d: %s", job_metadata.job_id, e)
            ops.append((key, op))
        self._jobs[job_metadata.job_id] = (job_metadata, ops)

    def submit_load(self, job_metadata):
        ops = []
        for key, cid in zip(job_metadata.keys, job_metadata.chunk_ids):
            key = bytes(key)
            try:
                op = self.store.retrieve_async(self._tokens, self._slot(cid),
                                               salt=self.salt(key))
            except FerryError as e:
                log.warning("ferry: secondary tier: load of job %d: %s", job_metadata.job_id, e)
                op = None
            ops.append((key, op))
        self._jobs[job_metadata.job_id] = (job_metadata, ops)

    @staticmethod
    def _done(op):
        return op is None or op is True or op.done()

    def _ok(self, op):
        if op is None:
            return False
        if op is True:
            return True
        try:
            return op.wait() >= self.TOKENS
        except FerryError as e:
            log.warning("ferry: secondary tier: %s", e)
            return False

    def get_finished_jobs(self):
        out = []
        for job_id in [j for j, (_, ops) in self._jobs.items()
                       if all(self._done(op) for _, op in ops)]:
            job, ops = self._jobs.pop(job_id)
            good = [key for key, op in ops if self._ok(op)]
            for key, op in ops:
                if op is not None and op is not True and not job.is_promotion:
                    n = self._storing.get(key, 0) - 1
                    if n > 0:
                        self._storing[key] = n
                    else:
                        self._storing.pop(key, None)
            ok = len(good) == len(ops)
            if not job.is_promotion and good:
                self._events.append(OffloadingEvent(keys=list(good), medium=Medium.STORAGE,
                                                    removed=False))
            out.append(JobResult(job_id=job_id, success=ok,
                                 successful_keys=None if ok or not job.is_promotion else good))
        return out

    def has_pending_work(self):
        return bool(self._jobs)

    def take_events(self):
        out, self._events = self._events, []
        return out

    def on_new_request(self, req_context):
        return RequestOffloadingContext()

    def drain_jobs(self):
        """Wait until every submitted job's copies are over (their results are
        then in get_finished_jobs)."""
        for _, ops in self._jobs.values():
            for _, op in ops:
                if op is not None and op is not True:
                    try:
                        op.wait()
                    except FerryError:
                        pass

    def shutdown(self):
        self.drain_jobs()
        if self._own:
            self.store.close()
            self._own = False


__all__ = ["FerryConnector", "FerryConnectorMetadata", "FerryConnectorStats", "FerryPromMetrics",
           "FerrySecondaryTier", "LoadSpec", "SaveSpec", "KVConnectorRole", "VLLM",
           "paged_view"]
