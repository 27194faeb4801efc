"""The Hugging Face configuration of a model trained with the moa fairseq plugin (``moa-export-hf``).

Imports transformers only (and travels with an exported model, ``trust_remote_code``). It records what
fairseq's arguments fixed about the network: its shape, the attention of each routed module (``family``:
``transformer`` for fairseq's own multi-head attention, ``moa``, ``moh`` or ``switchhead``, and that
family's settings) and the token ids of fairseq's dictionary.
"""

from transformers import PretrainedConfig


class MoaFairseqConfig(PretrainedConfig):
    """A decoder-only language model of fairseq's ``transformer_lm`` layout with routed self-attention.

    ``attention``: the routed attention's constructor arguments (e.g. MoA's ``num_experts``, ``top_k``,
    ``head_dim``), one dict per layer in ``attention_per_layer`` where the layers differ (per-layer top-k)."""

    model_type = "moa_fairseq"

    def __init__(self, vocab_size=8, embed_dim=16, ffn_dim=32, layers=1, attention_heads=1, family="transformer",
                 attention=None, attention_per_layer=None, activation_fn="relu", dropout=0.1, attention_dropout=0.0,
                 activation_dropout=0.0, normalize_before=False, final_layer_norm=False, layernorm_embedding=False,
                 scale_embedding=True, learned_positions=False, token_positions=True, max_positions=1024,
                 tie_word_embeddings=True, pad_token_id=1, bos_token_id=0, eos_token_id=2, **kwargs):
        self.vocab_size, self.embed_dim, self.ffn_dim, self.layers = vocab_size, embed_dim, ffn_dim, layers
        self.attention_heads, self.family = attention_heads, family
        self.attention, self.attention_per_layer = attention or {}, attention_per_layer
        self.activation_fn, self.dropout = activation_fn, dropout
        self.attention_dropout, self.activation_dropout = attention_dropout, activation_dropout
        self.normalize_before, self.final_layer_norm = normalize_before, final_layer_norm
        self.layernorm_embedding, self.scale_embedding = layernorm_embedding, scale_embedding
        self.learned_positions, self.token_positions, self.max_positions = learned_positions, token_positions, max_positions
        super().__init__(pad_token_id=pad_token_id, bos_token_id=bos_token_id, eos_token_id=eos_token_id,
                         tie_word_embeddings=tie_word_embeddings, **kwargs)

    def layer_attention(self, layer: int) -> dict:
        """The routed attention's constructor arguments of ``layer``."""
        return dict(self.attention_per_layer[layer] if self.attention_per_layer else self.attention)
