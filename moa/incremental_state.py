"""What an attention module needs to take part in incremental decoding and dropout, in torch alone.

fairseq's decoders hand every attention module one ``incremental_state`` dict per decoding run; a module keeps
its cache under keys of its own, ``"{module id}.{name}"``, as fairseq's ``FairseqIncrementalState`` does, so
that the routed modules and fairseq's own share one dict. :class:`AttentionDropout` is dropout with fairseq's
``make_generation_fast_(retain_dropout=...)`` hook, which ``fairseq-generate --retain-dropout`` calls. Neither
imports fairseq: the routed attention modules built on them run in any torch program.
"""

import uuid
from typing import Dict, List, Optional

import torch.nn.functional as F
from torch import Tensor, nn

IncrementalState = Optional[Dict[str, Dict[str, Optional[Tensor]]]]


class IncrementalStateModule(nn.Module):
    """An ``nn.Module`` whose cache lives in a decoding run's ``incremental_state`` under keys of its own."""

    def __init__(self):
        super().__init__()
        self._incremental_state_id = str(uuid.uuid4())

    def _full_key(self, key: str) -> str:
        return f"{self._incremental_state_id}.{key}"

    def get_incremental_state(self, incremental_state: IncrementalState, key: str) -> Optional[Dict[str, Optional[Tensor]]]:
        """This module's entry ``key`` of ``incremental_state``, or None."""
        if incremental_state is None:
            return None
        return incremental_state.get(self._full_key(key))

    def set_incremental_state(self, incremental_state: IncrementalState, key: str,
                              value: Dict[str, Optional[Tensor]]) -> IncrementalState:
        """Store ``value`` as this module's entry ``key``; returns ``incremental_state``."""
        if incremental_state is not None:
            incremental_state[self._full_key(key)] = value
        return incremental_state


class AttentionDropout(nn.Module):
    """Dropout with probability ``p`` in training; at inference only when ``fairseq-generate --retain-dropout``
    (``retain_dropout_modules`` naming ``module_name``, or none named) sets ``apply_during_inference``."""

    def __init__(self, p: float, module_name: Optional[str] = None):
        super().__init__()
        self.p, self.module_name, self.apply_during_inference = p, module_name, False

    def forward(self, x: Tensor) -> Tensor:
        if self.p > 0 and (self.training or self.apply_during_inference):
            return F.dropout(x, p=self.p, training=True)
        return x

    def make_generation_fast_(self, name: str, retain_dropout: bool = False,
                              retain_dropout_modules: Optional[List[str]] = None, **kwargs) -> None:
        if retain_dropout and (retain_dropout_modules is None or self.module_name in retain_dropout_modules):
            self.apply_during_inference = True

    def extra_repr(self) -> str:
        return f"p={self.p}"
