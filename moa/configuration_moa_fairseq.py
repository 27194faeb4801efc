"""The Hugging Face configuration of a model trained with the moa fairseq plugin (``moa-export-hf``).

Imports transformers only (and travels with an exported model, ``trust_remote_code``). It records what
fairseq's arguments fixed about the network: each stack's shape, the attention of each attention module
(``family``: ``transformer`` for fairseq's own multi-head attention, ``moa``, ``moh`` or ``switchhead``; per
layer, the routed module's constructor arguments or None where the module is fairseq's dense attention) and
the token ids of fairseq's dictionary.
"""

from transformers import PretrainedConfig

# one stack (encoder or decoder) of fairseq's Transformer; "self_attention" and "cross_attention": one entry per
# layer, a routed module's constructor arguments (e.g. MoA's num_experts, top_k, head_dim) or None (dense)
STACK = dict(embed_dim=16, ffn_dim=32, layers=1, attention_heads=1, normalize_before=False, final_layer_norm=False,
             learned_positions=False, max_positions=1024, self_attention=None, cross_attention=None)


# the routers' loss weights of the plugin's criteria (--moa-alpha, --moa-beta, --moh-beta), their defaults
AUX_WEIGHTS = {"moa_alpha": 0.01, "moa_beta": 0.001, "moh_beta": 0.01}


class MoaFairseqConfig(PretrainedConfig):
    """fairseq's ``transformer_lm`` (``decoder_stack`` alone), ``transformer`` (``encoder_stack`` and
    ``decoder_stack``) or RoBERTa (``encoder_stack`` alone, ``lm_head``) layout with routed attention; each
    stack a dict of :data:`STACK`'s keys. ``aux_weights``: the weights of the routers' losses in the objective
    a forward with labels returns (the checkpoint's criterion's, exported)."""

    model_type = "moa_fairseq"

    def __init__(self, vocab_size=8, family="transformer", decoder_stack=None, encoder_stack=None, activation_fn="relu",
                 dropout=0.1, attention_dropout=0.0, activation_dropout=0.0, layernorm_embedding=False,
                 scale_embedding=True, token_positions=True, share_all_embeddings=False, lm_head=False,
                 aux_weights=None, tie_word_embeddings=True, pad_token_id=1, bos_token_id=0, eos_token_id=2,
                 decoder_start_token_id=2, **kwargs):
        self.vocab_size, self.family = vocab_size, family
        self.decoder_stack = None if decoder_stack is None and encoder_stack is not None else \
            {**STACK, **(decoder_stack or {})}
        self.encoder_stack = None if encoder_stack is None else {**STACK, **encoder_stack}
        self.activation_fn, self.dropout = activation_fn, dropout
        self.attention_dropout, self.activation_dropout = attention_dropout, activation_dropout
        self.layernorm_embedding, self.scale_embedding = layernorm_embedding, scale_embedding
        self.token_positions, self.share_all_embeddings, self.lm_head = token_positions, share_all_embeddings, lm_head
        self.aux_weights = {**AUX_WEIGHTS, **(aux_weights or {})}
        kwargs.setdefault("is_encoder_decoder", self.encoder_stack is not None and self.decoder_stack is not None)
        super().__init__(pad_token_id=pad_token_id, bos_token_id=bos_token_id, eos_token_id=eos_token_id,
                         decoder_start_token_id=decoder_start_token_id, tie_word_embeddings=tie_word_embeddings,
                         **kwargs)
