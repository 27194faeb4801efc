"""The skeleton MoA's and MoH's attention modules share: fairseq's attention contract around a router.

Both follow fairseq's ``MultiheadAttention`` contract (time-first inputs, ``(output,
weights_or_None)``, incremental state, beam reordering), so fairseq's Transformer layers use them
unchanged. :meth:`RoutedAttention.forward` is written once, here:

1. shape checks; the keys and values, projected by the subclass (any layout whose time axis is
   ``time_dim``) and kept in the incremental-decoding cache, each step written into a preallocated
   store (:func:`append_to_cache`), static for encoder-decoder attention;
2. the queries flattened time-first (n = t * batch + b) and routed (in incremental decoding without
   the load and the auxiliary losses, which only training and validation read), skipping padded queries: for
   self-attention the padding is ``key_padding_mask``; for encoder-decoder attention the decoder sets
   ``query_padding_mask`` (batch, tgt_len) before running its layers, since fairseq passes only key
   padding;
3. the routing recorded for the criterion (:meth:`record`);
4. fairseq's two masks as one additive bias (:func:`attention_bias`);
5. the subclass's :meth:`~RoutedAttention.mix`: the selected experts' or heads' attention and output.

The attention core itself, softmax(q K^T / sqrt(D) + bias) V with dropout, is :meth:`attention_core`
(torch's fused ``scaled_dot_product_attention``; two matmuls when the weights are asked for). Subclasses supply
``_project_key_value``, ``route``, ``mix`` and ``head_outputs`` (every head's or expert's attention and
output contribution, for ``moa-analyze``). After each forward, ``self.routing`` holds the routing
decision of the queries (unless ``record_routing`` is off, as in the backward's recomputation under
activation checkpointing); the model hands it to the criterion (``pop_named_routings``).
"""

import math
from typing import Dict, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .incremental_state import AttentionDropout, IncrementalState, IncrementalStateModule
from .routing import Routing
ATTN_STATE = "attn_state"  # the incremental-state buffer of the key/value cache
PER_SENTENCE = "attn_state_per_sentence"  # ... and of a beam-folded source cache
STORE = "_store"  # the preallocated tensor a cached key/value is the front of (append_to_cache)
SPARE = "_spare"  # flat memory the next beam reorder writes the cache into (reorder_cache)
CACHE_GROWTH_MIN_STEPS = 8  # the fewest positions a new store makes room for beyond those it holds


class RoutedAttention(IncrementalStateModule):
    """Base of the routed attention modules: torch alone (:mod:`moa.incremental_state`), no fairseq import."""

    time_dim = 1  # the time axis of the cached keys/values: (batch, len, D) for MoA

    def __init__(self, embed_dim: int, head_dim: int, dropout: float, self_attention: bool,
                 encoder_decoder_attention: bool):
        super().__init__()
        self.embed_dim, self.head_dim = embed_dim, head_dim
        self.scaling = head_dim ** -0.5
        self.dropout_module = AttentionDropout(dropout, module_name=self.__class__.__name__)
        self.self_attention = self_attention
        self.encoder_decoder_attention = encoder_decoder_attention
        self.query_padding_mask: Optional[Tensor] = None
        self.routing: Optional[Routing] = None
        self.record_routing = True
        self.beam_size = 1

    def forward(
        self,
        query: Tensor,
        key: Optional[Tensor],
        value: Optional[Tensor],
        key_padding_mask: Optional[Tensor] = None,
        incremental_state: IncrementalState = None,
        need_weights: bool = True,
        static_kv: bool = False,
        attn_mask: Optional[Tensor] = None,
        before_softmax: bool = False,
        need_head_weights: bool = False,
    ) -> Tuple[Tensor, Optional[Tensor]]:
        """query: (tgt_len, batch, embed_dim); key/value: (src_len, batch, kdim/vdim).

        key_padding_mask: (batch, src_len), True/1 at padding. attn_mask: (tgt_len, src_len),
        additive float (fairseq's -inf future mask) or bool (True = blocked). Returns the output
        (tgt_len, batch, embed_dim) and, when asked for, attention weights averaged over each token's
        active heads (batch, tgt_len, src_len), or per head with ``need_head_weights`` (see ``mix``).
        """
        if before_softmax:
            raise NotImplementedError(f"{type(self).__name__} does not return pre-softmax scores")
        if self.encoder_decoder_attention and incremental_state is not None and \
                self._folds_beams(query, key, incremental_state):
            return self._beamable_forward(query, key, value, key_padding_mask, incremental_state, need_weights,
                                          static_kv, attn_mask, need_head_weights)
        return self._forward(query, key, value, key_padding_mask, incremental_state, need_weights, static_kv,
                             attn_mask, need_head_weights)

    def _forward(self, query, key, value, key_padding_mask, incremental_state, need_weights, static_kv, attn_mask,
                 need_head_weights, buffer=ATTN_STATE):
        tgt_len, bsz, embed_dim = query.shape
        if embed_dim != self.embed_dim:
            raise ValueError(f"query has {embed_dim} features, the module expects {self.embed_dim}")
        keys, values, key_padding_mask = self.cached_key_value(key, value, key_padding_mask, incremental_state,
                                                               static_kv, buffer)
        padding = self.flat_query_padding(key_padding_mask, incremental_state, tgt_len, bsz)
        bias = attention_bias(attn_mask, key_padding_mask, query.dtype)
        core = RoutedAttention.routed_attention if self.compiled is None else compiled_core(self.compiled)
        y, weights, routing = core(self, query.reshape(tgt_len * bsz, embed_dim), padding, keys, values, bias, tgt_len,
                                   bsz, need_weights or need_head_weights, need_head_weights, incremental_state is not None)
        self.record(routing)
        return y.view(tgt_len, bsz, embed_dim), weights

    compiled: Optional[str] = None  # a torch.compile backend the routed computation runs through, or None (eager)

    def routed_attention(self, x: Tensor, padding: Optional[Tensor], keys: Tensor, values: Tensor,
                         bias: Optional[Tensor], tgt_len: int, bsz: int, need_weights: bool, need_head_weights: bool,
                         decoding: bool) -> Tuple[Tensor, Optional[Tensor], Routing]:
        """The routed computation proper, route then mix, on tensors only (the cache and masks are the
        caller's): what :func:`compile_routed_attention` compiles. x: (N, embed_dim) the queries, time-first;
        padding: (N,) or None. Returns the (N, embed_dim) output, the weights asked for and the routing."""
        routing, routed_queries = self.route(x, padding, aux=not decoding)
        y, weights = self.mix(x, routing, routed_queries, keys, values, bias, tgt_len, bsz, need_weights,
                              need_head_weights, decoding)
        return y, weights, routing

    def set_beam_size(self, beam_size: int) -> None:
        """Beam search's beam, as fairseq's ``MultiheadAttention.set_beam_size`` (called through the
        model's ``set_beam_size`` by fairseq's SequenceGenerator): encoder-decoder attention then keeps
        one copy of the source keys and values per sentence instead of one per hypothesis."""
        self.beam_size = beam_size

    def _folds_beams(self, query: Tensor, key: Optional[Tensor], incremental_state) -> bool:
        """Whether this decoding step folds the beam (:meth:`_beamable_forward`): a beam is set, the rows
        come in whole beams, and the source cache is per sentence already, or is about to be made from
        a source whose ``beam`` rows of each sentence are equal (as beam search expands them; a greedy
        or sampling run on the same model after beam search is not folded)."""
        beam = self.beam_size
        if beam <= 1 or query.size(1) % beam:
            return False
        if self.get_incremental_state(incremental_state, PER_SENTENCE):
            return True
        if self._get_input_buffer(incremental_state) or key is None:
            return False
        grouped = key.view(key.size(0), -1, beam, key.size(-1))
        return torch.equal(grouped, grouped[:, :, :1].expand_as(grouped))

    def _beamable_forward(self, query, key, value, key_padding_mask, incremental_state, need_weights, static_kv,
                          attn_mask, need_head_weights):
        """Encoder-decoder attention in beam search: the ``beam`` hypotheses of a sentence (rows
        b * beam + j, which share their source) are folded into the query length of the sentence, so
        the cached source keys and values, and their reordering, are per sentence (batch / beam rows).
        The output is the unfolded ``_forward``'s, for every query token."""
        beam = self.beam_size
        tgt_len, rows, dim = query.shape
        bsz = rows // beam  # whole beams: see _folds_beams
        folded = query.view(tgt_len, bsz, beam, dim).permute(2, 0, 1, 3).reshape(beam * tgt_len, bsz, dim)
        if key is not None and key.size(1) == rows:  # the first step: one copy of each sentence's source
            key = key.view(key.size(0), bsz, beam, -1)[:, :, 0]
            value = value.view(value.size(0), bsz, beam, -1)[:, :, 0]
        if key_padding_mask is not None and key_padding_mask.size(0) == rows:
            key_padding_mask = key_padding_mask.view(bsz, beam, -1)[:, 0]
        if attn_mask is not None:  # (tgt_len, src_len), the same for every hypothesis
            attn_mask = attn_mask.repeat(beam, 1)
        y, weights = self._forward(folded, key, value, key_padding_mask, incremental_state, need_weights,
                                   static_kv, attn_mask, need_head_weights, buffer=PER_SENTENCE)
        y = y.view(beam, tgt_len, bsz, dim).permute(1, 2, 0, 3).reshape(tgt_len, rows, dim)
        if weights is not None:  # (..., bsz, beam * tgt_len, src_len) -> (..., rows, tgt_len, src_len)
            weights = weights.reshape(*weights.shape[:-3], rows, tgt_len, weights.size(-1))
        return y, weights

    def route(self, x: Tensor, padding: Optional[Tensor], aux: bool = True) -> Tuple[Routing, Optional[Tensor]]:
        """x: (N, embed_dim) the queries; padding: (N,) bool or None; ``aux``: False in incremental
        decoding, where nothing reads the load or the auxiliary losses. Returns the routing and any
        queries the router computed on the way, for ``mix`` to reuse (or None)."""
        raise NotImplementedError

    def mix(self, x: Tensor, routing: Routing, routed_queries: Optional[Tensor], keys: Tensor, values: Tensor,
            bias: Optional[Tensor], tgt_len: int, bsz: int, need_weights: bool, need_head_weights: bool,
            decoding: bool) -> Tuple[Tensor, Optional[Tensor]]:
        """The routed attention proper: (N, embed_dim) output and the weights asked for."""
        raise NotImplementedError

    def active_heads(self) -> Tuple[str, int, int]:
        """(family, active, total): the experts (MoA) or heads (MoH) a token uses, of all of them."""
        raise NotImplementedError

    def head_outputs(self, query: Tensor, key: Tensor, key_padding_mask: Optional[Tensor] = None,
                     attn_mask: Optional[Tensor] = None) -> Tuple[Tensor, Tensor]:
        """(A, O): every head's (MoA: every expert's) attention probabilities (B, H, T, S) and its
        contribution ``A_i V_i W_O^i`` to the output (B, H, T, C), ungated, whether routed or not.
        query: (T, B, C); key: (S, B, C_k)."""
        raise NotImplementedError

    def attention_core(self, q: Tensor, keys: Tensor, values: Tensor, bias: Optional[Tensor],
                       need_weights: bool) -> Tuple[Tensor, Optional[Tensor]]:
        """softmax(q K^T * scaling + bias) V, with attention dropout in training: torch's fused
        ``scaled_dot_product_attention``, or two matmuls and a softmax when the weights are asked for.

        q: (B, H, L, D); keys, values: (B, H or 1, S, D); bias: additive, broadcastable to
        (B, H, L, S), or None. Returns o (B, H, L, D) and, with ``need_weights``, the probabilities
        (B, H, L, S) (before dropout)."""
        if need_weights:
            return self._matmul_attention(q, keys, values, bias, need_weights)
        dropout = self.dropout_module.p if self.training or self.dropout_module.apply_during_inference else 0.0
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=bias, dropout_p=dropout,
                                              scale=self.scaling), None

    def _matmul_attention(self, q, keys, values, bias, need_weights):
        probs = attention_probs(q, keys, bias, self.scaling)
        return torch.matmul(self.dropout_module(probs), values), probs if need_weights else None

    def record(self, routing) -> None:
        """Keep ``routing`` for the criterion (see :mod:`moa.activation_checkpointing`)."""
        if self.record_routing:
            self.routing = routing

    def cached_key_value(self, key: Optional[Tensor], value: Optional[Tensor], key_padding_mask: Optional[Tensor],
                         incremental_state: IncrementalState, static_kv: bool, buffer: str = ATTN_STATE):
        """The subclass's ``_project_key_value(key, value)`` -> (keys, values), through the incremental cache
        (its ``buffer``: ATTN_STATE, or PER_SENTENCE for a beam-folded source).

        key/value: (src_len, batch, dim). Returns keys, values in the subclass's layout (time on
        ``time_dim``) and the key padding mask (batch, len) that goes with them.
        """
        saved = None
        if incremental_state is not None:
            saved = self.get_incremental_state(incremental_state, buffer) or {}
        if static_kv and saved is not None and "prev_key" in saved:
            return saved["prev_key"], saved["prev_value"], key_padding_mask
        if key is None or value is None:
            raise ValueError(f"{type(self).__name__} needs key and value unless they are cached (static_kv)")
        keys, values = self._project_key_value(key, value)
        if saved is not None:
            if not static_kv and "prev_key" in saved:
                prev_len = saved["prev_key"].size(self.time_dim)
                keys = append_to_cache(saved, "prev_key", keys, self.time_dim)
                values = append_to_cache(saved, "prev_value", values, self.time_dim)
                key_padding_mask = cat_padding(saved.get("prev_key_padding_mask"), key_padding_mask,
                                               keys.size(0), prev_len, keys.size(self.time_dim) - prev_len)
            saved["prev_key"], saved["prev_value"] = keys, values
            if not static_kv:
                saved["prev_key_padding_mask"] = key_padding_mask
            self.set_incremental_state(incremental_state, buffer, saved)
        return keys, values, key_padding_mask

    def flat_query_padding(self, key_padding_mask, incremental_state, tgt_len, bsz) -> Optional[Tensor]:
        """(tgt_len * bsz,) bool padding of the queries, flattened time-first, or None when unknown/none."""
        mask = self.query_padding_mask
        if mask is None and self.self_attention and incremental_state is None:
            mask = key_padding_mask
        if mask is None:
            return None
        if mask.shape != (bsz, tgt_len):
            raise ValueError(f"query padding mask has shape {tuple(mask.shape)}, expected {(bsz, tgt_len)}")
        return mask.bool().transpose(0, 1).reshape(-1)

    def reorder_incremental_state(self, incremental_state: Dict[str, Dict[str, Optional[Tensor]]], new_order: Tensor):
        """Re-index every cached tensor along the batch dimension (beam search). The per-sentence source
        cache of beamable encoder-decoder attention (:meth:`set_beam_size`) moves only when sentences
        leave the batch, to the sentences of ``new_order``'s beams."""
        for name in (ATTN_STATE, PER_SENTENCE):
            buffer = self.get_incremental_state(incremental_state, name)
            if not buffer:
                continue
            beam = self.beam_size if name == PER_SENTENCE else 1
            for key, cached in list(buffer.items()):
                if cached is None or key.endswith((STORE, SPARE)) or \
                        cached.size(0) * beam == new_order.size(0) != cached.size(0):
                    continue  # a store (moved with its cache), or per sentence with every hypothesis staying
                order = new_order.view(-1, beam)[:, 0] // beam if beam > 1 else new_order
                if key in ("prev_key", "prev_value") and not self.encoder_decoder_attention:  # grows step by step
                    reorder_cache(buffer, key, order, self.time_dim)
                else:
                    buffer[key] = cached.index_select(0, order)
            incremental_state = self.set_incremental_state(incremental_state, name, buffer)
        return incremental_state

    def _get_input_buffer(self, incremental_state: IncrementalState) -> Dict[str, Optional[Tensor]]:
        result = self.get_incremental_state(incremental_state, ATTN_STATE)
        return result if result is not None else {}

    def _set_input_buffer(self, incremental_state, buffer: Dict[str, Optional[Tensor]]):
        return self.set_incremental_state(incremental_state, ATTN_STATE, buffer)


_COMPILED_CORES: Dict[str, object] = {}


def compiled_core(backend: str):
    """:meth:`RoutedAttention.routed_attention` through ``torch.compile(dynamic=True)`` with ``backend``, made
    once: every routed module shares it, so modules of one configuration share their graphs, and any
    sequence length, batch and routing runs the same graph (MoH's packed layout has static shapes there)."""
    if backend not in _COMPILED_CORES:
        _COMPILED_CORES[backend] = torch.compile(RoutedAttention.routed_attention, dynamic=True, backend=backend)
    return _COMPILED_CORES[backend]


COMPILED_GRAPHS_LIMIT = 64  # graphs of the one compiled function, which every routed module of a process shares


def compile_routed_attention(model: nn.Module, backend: Optional[str] = "inductor") -> int:
    """Run every routed attention module of ``model`` through torch.compile (``backend``; None: eager
    again); the cache, masks and beam plumbing stay eager. Returns the number of modules.

    The modules share one compiled function, with one graph per kind of call: each attention type
    (with or without a mask), training or not, whole sequences or one decoding step, and dtype; about
    ten for a translation model that trains, validates and decodes, whatever the lengths and routing.
    torch's default of 8 graphs per function would run the rest eagerly, so dynamo's
    ``recompile_limit`` is raised to COMPILED_GRAPHS_LIMIT."""
    import torch._dynamo

    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, COMPILED_GRAPHS_LIMIT)
    modules = [m for m in model.modules() if isinstance(m, RoutedAttention)]
    for module in modules:
        module.compiled = backend
    return len(modules)


def append_to_cache(saved: Dict[str, Optional[Tensor]], name: str, new: Tensor, time_dim: int) -> Tensor:
    """``saved[name]`` with ``new`` appended on ``time_dim``, stored as the front of a preallocated
    tensor (``saved[name + STORE]``): a decoding step writes only its own keys and values, where
    concatenating would copy the whole cache every step. A full store is replaced by one with
    :func:`store_capacity`. Under autograd (which in-place writes would break) it concatenates, as
    fairseq's attention does."""
    prev = saved[name]
    store = saved.pop(name + STORE, None)
    if torch.is_grad_enabled() and (prev.requires_grad or new.requires_grad):
        saved[name] = torch.cat([prev, new], dim=time_dim)
        return saved[name]
    length, steps = prev.size(time_dim), new.size(time_dim)
    if store is None or store.size(time_dim) < length + steps or store.dtype != new.dtype:
        store = _new_store(prev, time_dim, store_capacity(length + steps))
        store.narrow(time_dim, 0, length).copy_(prev)
    store.narrow(time_dim, length, steps).copy_(new)
    saved[name + STORE] = store
    saved[name] = store.narrow(time_dim, 0, length + steps)
    return saved[name]


def store_capacity(length: int) -> int:
    """The positions a new store for ``length`` cached ones holds: an eighth more, and at least
    ``CACHE_GROWTH_MIN_STEPS`` more, so that a long cache leaves at most a ninth of its store unused
    and, amortised, a step copies at most eight positions of an old store into a new one."""
    return length + max(CACHE_GROWTH_MIN_STEPS, length // 8)


def reorder_cache(buffer: Dict[str, Optional[Tensor]], name: str, order: Tensor, time_dim: int) -> None:
    """Beam search's reorder of the cache ``buffer[name]``, the front of its store (:func:`append_to_cache`).

    A reorder reads and writes the whole cache whatever the layout, so it writes the reordered cache
    into a contiguous store of exactly one more position, which the step that follows (beam search
    appends one) fills: attention then reads a contiguous cache, where a store with headroom gives
    strided matrices that torch's batched matmul on a CPU reads more slowly. The new store is made in the memory the store before last used
    (``buffer[name + SPARE]``, flat), so that steps alternate between two buffers and allocate nothing
    once warm. Each step copies the cache once, where fairseq's attention copies it twice (its reorder,
    then its concatenation)."""
    front = buffer[name]
    if torch.is_grad_enabled() and front.requires_grad:  # autograd: no in-place writes (as append_to_cache)
        buffer[name] = front.index_select(0, order)
        return
    shape = list(front.shape)
    shape[0], shape[time_dim] = order.size(0), shape[time_dim] + 1
    size = math.prod(shape)
    spare = buffer.pop(name + SPARE, None)
    if spare is None or spare.numel() < size or spare.dtype != front.dtype or spare.device != front.device:
        spare = front.new_empty(size // shape[time_dim] * store_capacity(shape[time_dim]))
    store = spare[:size].view(shape)
    target = store.narrow(time_dim, 0, front.size(time_dim))
    torch.index_select(front, 0, order, out=target)  # in place: the target has the result's shape
    old = buffer.get(name + STORE)
    if old is not None:  # all the memory it was made in
        buffer[name + SPARE] = (old if old._base is None else old._base).view(-1)
    buffer[name + STORE], buffer[name] = store, target


def _new_store(like: Tensor, time_dim: int, capacity: int, batch: Optional[int] = None) -> Tensor:
    shape = list(like.shape)
    shape[time_dim] = capacity
    if batch is not None:
        shape[0] = batch
    return like.new_empty(shape)


def cat_padding(prev: Optional[Tensor], new: Optional[Tensor], bsz: int, prev_len: int, new_len: int):
    """Concatenate cached and new key padding masks (batch, len); None when neither has padding."""
    if prev is None and new is None:
        return None
    device = (prev if prev is not None else new).device
    if prev is None:
        prev = torch.zeros(bsz, prev_len, dtype=torch.bool, device=device)
    if new is None:
        new = torch.zeros(bsz, new_len, dtype=torch.bool, device=device)
    return torch.cat([prev.bool(), new.bool()], dim=1)


def attention_probs(q: Tensor, keys: Tensor, bias: Optional[Tensor], scaling: float) -> Tensor:
    """softmax(q K^T * scaling + bias) in q's dtype, the softmax in float32 or wider (as fairseq's for
    half precision): q (..., L, D), keys (..., S, D) -> (..., L, S)."""
    scores = torch.matmul(q, keys.transpose(-1, -2)) * scaling
    if bias is not None:
        scores = scores + bias
    return torch.softmax(scores, dim=-1, dtype=torch.promote_types(scores.dtype, torch.float32)).type_as(scores)


def attention_bias(attn_mask: Optional[Tensor], key_padding_mask: Optional[Tensor], dtype) -> Optional[Tensor]:
    """fairseq's masks as one additive bias: attn_mask (T, S) float (-inf blocks) or bool
    (True blocks), key_padding_mask (B, S) (True/1 at padding) -> (1 or B, 1, T or 1, S)."""
    bias = None
    if attn_mask is not None:
        if attn_mask.dtype == torch.bool:
            bias = torch.zeros(attn_mask.shape, dtype=dtype, device=attn_mask.device).masked_fill(
                attn_mask, float("-inf"))
        else:
            bias = attn_mask.to(dtype)
        bias = bias[None, None]
    if key_padding_mask is not None:
        padding = key_padding_mask.bool()[:, None, None, :]
        if bias is None:
            bias = torch.zeros(padding.shape, dtype=dtype, device=padding.device)
        bias = bias.masked_fill(padding, float("-inf"))
    return bias
