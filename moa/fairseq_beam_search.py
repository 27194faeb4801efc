"""fairseq-generate's beam search (fairseq's ``SequenceGenerator`` with ``search.BeamSearch``) in torch alone,
so that an exported translation model's ``generate`` gives fairseq-generate's hypotheses.

Every hypothesis starts with EOS (fairseq's BOS for decoding). Each step takes the log-probabilities of the next
token (float32): never padding, no EOS before ``min_len``, only EOS at ``max_len``. Over beam x vocabulary, the
2 * beam best of (hypothesis score + log-probability) are the candidates (at step 0 from the first beam only);
candidates ending in EOS among the first ``beam`` are finished with score / (tokens incl. EOS) ** ``len_penalty``;
the first ``beam`` candidates not ending in EOS continue. A sentence is done with ``beam`` finished hypotheses
(or at ``max_len``) and leaves the batch; its hypotheses are sorted by score.
"""

import math
from typing import Callable, Dict, List, Optional

import torch
from torch import Tensor


def beam_search(next_log_probs: Callable[[Tensor, Optional[Tensor]], Tensor], bsz: int, beam: int, max_len: int,
                eos: int, pad: int, device: torch.device, min_len: int = 1,
                len_penalty: float = 1.0) -> List[List[Dict[str, Tensor]]]:
    """``next_log_probs(tokens, reorder)``: tokens (n * beam, step + 1), the hypotheses so far; ``reorder``: None
    or (n * beam,) the rows of the previous call's hypotheses each row continues (the caller reorders its
    decoder cache and encoder output by it); returns (n * beam, V) float32 log-probabilities of the next token.
    Returns, per sentence, its hypotheses best first: ``tokens`` (ending in EOS, without the leading one),
    ``score`` (the length-normalised sum of log-probabilities) and ``positional_scores``."""
    tokens = torch.full((bsz * beam, max_len + 2), pad, dtype=torch.long, device=device)
    tokens[:, 0] = eos
    scores = torch.zeros(bsz * beam, max_len + 1, device=device)
    finalized: List[List[Dict[str, Tensor]]] = [[] for _ in range(bsz)]
    finished = [False] * bsz
    remaining = bsz
    ignore = torch.zeros(bsz, beam, dtype=torch.bool, device=device)  # candidates of sentences already done
    cand_size = 2 * beam
    cand_offsets = torch.arange(cand_size, device=device)
    offsets = (torch.arange(bsz, device=device) * beam).unsqueeze(1)
    reorder: Optional[Tensor] = None
    batch_idxs: Optional[Tensor] = None
    for step in range(max_len + 1):
        if reorder is not None and batch_idxs is not None:  # rows of sentences that left the batch
            corr = batch_idxs - torch.arange(batch_idxs.numel(), device=device)
            reorder.view(-1, beam).add_(corr.unsqueeze(-1) * beam)
        lprobs = next_log_probs(tokens[:, : step + 1], reorder)
        lprobs[lprobs != lprobs] = -math.inf
        lprobs[:, pad] = -math.inf
        if step >= max_len:
            lprobs[:, :eos] = -math.inf
            lprobs[:, eos + 1:] = -math.inf
        if step < min_len:
            lprobs[:, eos] = -math.inf
        vocab = lprobs.size(-1)
        candidates = lprobs.view(bsz, beam, vocab)
        if step == 0:
            candidates = candidates[:, ::beam, :].contiguous()
        else:
            candidates = candidates + scores.view(bsz, beam, -1)[:, :, step - 1].unsqueeze(-1)
        flat = candidates.view(bsz, -1)
        cand_scores, cand_indices = torch.topk(flat, k=min(cand_size, flat.size(1) - 1))
        cand_beams = torch.div(cand_indices, vocab, rounding_mode="trunc")
        cand_indices = cand_indices.fmod(vocab)
        cand_bbsz = cand_beams + offsets
        eos_mask = cand_indices.eq(eos) & cand_scores.ne(-math.inf)
        eos_mask[:, :beam][ignore] = False
        eos_bbsz = torch.masked_select(cand_bbsz[:, :beam], mask=eos_mask[:, :beam])
        done_now: List[int] = []
        if eos_bbsz.numel() > 0:
            eos_scores = torch.masked_select(cand_scores[:, :beam], mask=eos_mask[:, :beam])
            done_now = _finalize(step, eos_bbsz, eos_scores, tokens, scores, finalized, finished, beam, max_len,
                                 len_penalty, eos)
            remaining -= len(done_now)
        if remaining == 0:
            break
        if done_now:
            keep = torch.ones(bsz, dtype=torch.bool, device=device)
            keep[done_now] = False
            batch_idxs = torch.arange(bsz, device=device).masked_select(keep)
            new_bsz = bsz - len(done_now)
            eos_mask, cand_beams = eos_mask[batch_idxs], cand_beams[batch_idxs]
            offsets = offsets[:new_bsz]
            cand_bbsz = cand_beams + offsets
            cand_scores, cand_indices, ignore = cand_scores[batch_idxs], cand_indices[batch_idxs], ignore[batch_idxs]
            scores = scores.view(bsz, -1)[batch_idxs].view(new_bsz * beam, -1)
            tokens = tokens.view(bsz, -1)[batch_idxs].view(new_bsz * beam, -1)
            bsz = new_bsz
        else:
            batch_idxs = None
        # the first beam candidates that neither end in EOS nor belong to a finished beam row continue
        eos_mask[:, :beam] = ~((~ignore) & (~eos_mask[:, :beam]))
        active_mask = eos_mask.long() * cand_size + cand_offsets[: eos_mask.size(1)]
        new_ignore, active = torch.topk(active_mask, k=beam, dim=1, largest=False)
        ignore = new_ignore.ge(cand_size)[:, :beam]
        active_bbsz = torch.gather(cand_bbsz, dim=1, index=active).view(-1)
        tokens[:, : step + 1] = torch.index_select(tokens[:, : step + 1], dim=0, index=active_bbsz)
        tokens.view(bsz, beam, -1)[:, :, step + 1] = torch.gather(cand_indices, dim=1, index=active)
        if step > 0:
            scores[:, :step] = torch.index_select(scores[:, :step], dim=0, index=active_bbsz)
        scores.view(bsz, beam, -1)[:, :, step] = torch.gather(cand_scores, dim=1, index=active)
        reorder = active_bbsz
    for i, hypotheses in enumerate(finalized):
        order = torch.sort(torch.tensor([float(h["score"]) for h in hypotheses]), descending=True)[1]
        finalized[i] = [hypotheses[j] for j in order]
    return finalized


def _finalize(step, bbsz, eos_scores, tokens, scores, finalized, finished, beam, max_len, len_penalty, eos) -> List[int]:
    """Record the hypotheses of rows ``bbsz`` ending in EOS at ``step``; returns the batch indices (in the current,
    reduced batch) of the sentences this finishes, ascending."""
    hypothesis_tokens = tokens.index_select(0, bbsz)[:, 1: step + 2]
    hypothesis_tokens[:, step] = eos
    positional = scores.index_select(0, bbsz)[:, : step + 1]
    positional[:, step] = eos_scores
    positional[:, 1:] = positional[:, 1:] - positional[:, :-1]
    eos_scores = eos_scores / (step + 1) ** len_penalty
    unfinished = [i for i, done in enumerate(finished) if not done]  # batch index -> sentence
    rows = torch.div(bbsz, beam, rounding_mode="trunc").tolist()
    for i, row in enumerate(rows):
        if len(finalized[unfinished[row]]) < beam:
            finalized[unfinished[row]].append({"tokens": hypothesis_tokens[i], "score": eos_scores[i],
                                               "positional_scores": positional[i]})
    newly_finished = []
    for row in sorted(set(rows)):
        sentence = unfinished[row]
        if not finished[sentence] and (len(finalized[sentence]) == beam or step == max_len):
            finished[sentence] = True
            newly_finished.append(row)
    return newly_finished
