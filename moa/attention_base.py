"""What MoA's and MoH's attention modules share: fairseq's attention contract around a router.

Both follow fairseq's ``MultiheadAttention`` contract (time-first inputs, ``(output,
weights_or_None)``, incremental state, beam reordering), so fairseq's Transformer layers use them
unchanged. :class:`RoutedAttention` holds the parts that do not depend on how the heads are built:

* the padding of the queries, which the router must skip: for self-attention it is
  ``key_padding_mask``; for encoder-decoder attention the decoder sets ``query_padding_mask``
  (batch, tgt_len) before running its layers, since fairseq passes only key padding;
* the incremental-decoding cache of projected keys and values (any layout whose time axis is
  ``time_dim``), concatenated step by step, static for encoder-decoder attention;
* re-indexing that cache for beam search;
* fairseq's two masks as one additive bias (:func:`attention_bias`).

After each forward, ``self.routing`` holds the routing decision of the queries (unless
``record_routing`` is off, as in the backward's recomputation under activation checkpointing); the
model hands it to the criterion (``pop_routings``).
"""

from typing import Callable, Dict, Optional, Tuple

import torch
from torch import Tensor, nn

IncrementalState = Optional[Dict[str, Dict[str, Optional[Tensor]]]]


class RoutedAttention(nn.Module):
    """Base of the routed attention modules; subclasses are decorated ``@with_incremental_state``."""

    time_dim = 1  # the time axis of the cached keys/values: (batch, len, D) for MoA

    def __init__(self, self_attention: bool, encoder_decoder_attention: bool):
        super().__init__()
        self.self_attention = self_attention
        self.encoder_decoder_attention = encoder_decoder_attention
        self.query_padding_mask: Optional[Tensor] = None
        self.routing = None
        self.record_routing = True

    def record(self, routing) -> None:
        """Keep ``routing`` for the criterion (see :mod:`moa.activation_checkpointing`)."""
        if self.record_routing:
            self.routing = routing

    def cached_key_value(self, key: Optional[Tensor], value: Optional[Tensor], key_padding_mask: Optional[Tensor],
                         incremental_state: IncrementalState, static_kv: bool,
                         project: Callable[[Tensor, Tensor], Tuple[Tensor, Tensor]]):
        """``project(key, value)`` -> (keys, values), through the incremental cache.

        key/value: (src_len, batch, dim). Returns keys, values in ``project``'s layout (time on
        ``time_dim``) and the key padding mask (batch, len) that goes with them.
        """
        saved = self._get_input_buffer(incremental_state) if incremental_state is not None else None
        if static_kv and saved is not None and "prev_key" in saved:
            return saved["prev_key"], saved["prev_value"], key_padding_mask
        if key is None or value is None:
            raise ValueError(f"{type(self).__name__} needs key and value unless they are cached (static_kv)")
        keys, values = project(key, value)
        if saved is not None:
            if not static_kv and "prev_key" in saved:
                prev_len = saved["prev_key"].size(self.time_dim)
                keys = torch.cat([saved["prev_key"], keys], dim=self.time_dim)
                values = torch.cat([saved["prev_value"], values], dim=self.time_dim)
                key_padding_mask = cat_padding(saved.get("prev_key_padding_mask"), key_padding_mask,
                                               keys.size(0), prev_len, keys.size(self.time_dim) - prev_len)
            saved["prev_key"], saved["prev_value"] = keys, values
            if not static_kv:
                saved["prev_key_padding_mask"] = key_padding_mask
            self._set_input_buffer(incremental_state, saved)
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
        """Re-index every cached tensor along the batch dimension (beam search)."""
        buffer = self._get_input_buffer(incremental_state)
        if buffer:
            for name, cached in buffer.items():
                if cached is not None:
                    buffer[name] = cached.index_select(0, new_order)
            incremental_state = self._set_input_buffer(incremental_state, buffer)
        return incremental_state

    def _get_input_buffer(self, incremental_state: IncrementalState) -> Dict[str, Optional[Tensor]]:
        result = self.get_incremental_state(incremental_state, "attn_state")
        return result if result is not None else {}

    def _set_input_buffer(self, incremental_state, buffer: Dict[str, Optional[Tensor]]):
        return self.set_incremental_state(incremental_state, "attn_state", buffer)


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
