"""Logit filters, vectorized over rows in fp32: temperature, min-p, top-k, top-p.

Shape key: B = rows (batch or steps), V = vocab.

Reproduces vLLM v1's sampler (vllm/v1/sample/sampler.py + logits_processor MinP +
ops/topk_topp_sampler.py apply_top_k_top_p), in this order:
  1. temperature: x = fp32(logits) / T   (fp32 division; rows with T == 0 are divided by 1)
  2. min-p:  p = softmax(x) (fp32); drop tokens with p < min_p * max(p)
  3. sort x (min-p drops set to -inf) ascending (stable: ties ordered by token id)
  4. top-k:  drop sorted values < the k-th largest value (ties with it are kept)
  5. top-p:  s = cumsum(softmax(top-k-filtered sorted x)) (fp32); drop where s <= 1 - top_p
             (1 - top_p in fp32), always keep the last (largest) entry
A filter is off when top_k <= 0 or top_k >= V, top_p >= 1, min_p <= 0. Tokens tied exactly at
the top-p cut are dropped lowest token id first (stable sort), so the kept set is always a top
set by logit value, ties aside.
Steps 3-5 sort the whole vocab only when some row has top-p without top-k; otherwise the sorted
row top-p sees ([-inf ... -inf, top-k survivors ascending]) is rebuilt from a top-k selection,
bit-identical and ~20x cheaper at V = 32k.
"""

from __future__ import annotations

import torch


def _rows(x, B: int, dtype: torch.dtype, device) -> torch.Tensor:
    t = torch.as_tensor(x, dtype=dtype, device=device)
    return t.expand(B) if t.dim() == 0 else t.to(dtype)


def _scale(logits_BV: torch.Tensor, temperature_B: torch.Tensor) -> torch.Tensor:
    t_B = torch.where(temperature_B == 0, torch.ones_like(temperature_B), temperature_B)
    return logits_BV.to(torch.float32) / t_B[:, None]


def _mask_and_scale(logits_BV, temperature_B, top_k_B, top_p_B, min_p_B):
    if logits_BV.dim() != 2:
        raise ValueError(f"logits_BV must be 2-D [rows, vocab], got shape {tuple(logits_BV.shape)}")
    B, V = logits_BV.shape
    dev = logits_BV.device
    temperature_B = _rows(temperature_B, B, torch.float32, dev)
    top_k_B = _rows(top_k_B, B, torch.int64, dev)
    top_p_B = _rows(top_p_B, B, torch.float32, dev)
    min_p_B = _rows(min_p_B, B, torch.float32, dev)

    x_BV = _scale(logits_BV, temperature_B)
    keep_BV = torch.ones(B, V, dtype=torch.bool, device=dev)

    minp_on_B = min_p_B > 0
    if bool(minp_on_B.any()):
        p_BV = torch.softmax(x_BV, dim=-1)
        thr_B1 = p_BV.amax(dim=-1, keepdim=True) * min_p_B[:, None]
        keep_BV &= ~((p_BV < thr_B1) & minp_on_B[:, None])

    topk_on_B = (top_k_B > 0) & (top_k_B < V)
    topp_on_B = top_p_B < 1
    if bool(topk_on_B.any()) or bool(topp_on_B.any()):
        xs_BV = x_BV.masked_fill(~keep_BV, float("-inf"))
        if bool((topp_on_B & ~topk_on_B).any()):
            drop_BV = _top_k_top_p_full_sort(xs_BV, top_k_B, topk_on_B, top_p_B, topp_on_B)
        else:
            drop_BV = _top_k_top_p_within_top_k(xs_BV, top_k_B, topk_on_B, top_p_B, topp_on_B)
        keep_BV &= ~drop_BV
    return keep_BV, x_BV


def _top_p_drop(sorted_BV: torch.Tensor, top_p_B: torch.Tensor, topp_on_B: torch.Tensor) -> torch.Tensor:
    """Top-p on an ascending row (dropped entries -inf): drop where cumsum(softmax) <= 1 - p."""
    cum_BV = torch.softmax(sorted_BV, dim=-1).cumsum(dim=-1)
    drop_BV = cum_BV <= (1 - top_p_B)[:, None]
    drop_BV[:, -1] = False
    return drop_BV & topp_on_B[:, None]


def _top_k_top_p_full_sort(xs_BV, top_k_B, topk_on_B, top_p_B, topp_on_B) -> torch.Tensor:
    """vLLM's apply_top_k_top_p as written: sort the whole row (needed when a row has top-p
    without top-k). Returns drop_BV in token-id order."""
    B, V = xs_BV.shape
    sorted_BV, idx_BV = xs_BV.sort(dim=-1, descending=False, stable=True)
    drop_sorted_BV = torch.zeros(B, V, dtype=torch.bool, device=xs_BV.device)
    if bool(topk_on_B.any()):
        k_B = torch.where(topk_on_B, top_k_B, torch.full_like(top_k_B, V))
        kth_B1 = sorted_BV.gather(1, (V - k_B)[:, None])
        drop_sorted_BV |= (sorted_BV < kth_B1) & topk_on_B[:, None]
        sorted_BV = sorted_BV.masked_fill(drop_sorted_BV, float("-inf"))
    if bool(topp_on_B.any()):
        drop_sorted_BV |= _top_p_drop(sorted_BV, top_p_B, topp_on_B)
    return torch.zeros_like(drop_sorted_BV).scatter_(1, idx_BV, drop_sorted_BV)


def _top_k_top_p_within_top_k(xs_BV, top_k_B, topk_on_B, top_p_B, topp_on_B) -> torch.Tensor:
    """The same result when every top-p row also has top-k, without sorting the vocab: after
    top-k, vLLM's ascending row is [-inf ... -inf, the m survivors ascending], so it is rebuilt
    from the top-M candidates (M = max survivors) and top-p runs on that identical V-long row
    (same softmax / cumsum inputs, hence the same bits)."""
    B, V = xs_BV.shape
    k_B = torch.where(topk_on_B, top_k_B, torch.ones_like(top_k_B))
    k_max = int(k_B.max())
    kth_B1 = xs_BV.topk(k_max, dim=-1).values.gather(1, (k_B - 1)[:, None])
    drop_BV = (xs_BV < kth_B1) & topk_on_B[:, None]
    if not bool(topp_on_B.any()):
        return drop_BV
    surv_BV = ~drop_BV & (xs_BV > float("-inf"))
    M = int(surv_BV.sum(-1)[topp_on_B].max())
    ids_BM = xs_BV.topk(M, dim=-1).indices.sort(dim=-1).values           # candidates by token id
    vals_BM = xs_BV.gather(1, ids_BM).masked_fill(~surv_BV.gather(1, ids_BM), float("-inf"))
    vals_BM, order_BM = vals_BM.sort(dim=-1, descending=False, stable=True)  # ascending, ties by id
    ids_BM = ids_BM.gather(1, order_BM)
    row_BV = torch.full((B, V), float("-inf"), dtype=xs_BV.dtype, device=xs_BV.device)
    row_BV[:, V - M :] = vals_BM
    pdrop_BM = _top_p_drop(row_BV, top_p_B, topp_on_B)[:, V - M :]
    return drop_BV.scatter(1, ids_BM, drop_BV.gather(1, ids_BM) | pdrop_BM)


def filter_mask(logits_BV: torch.Tensor, temperature_B, top_k_B, top_p_B, min_p_B) -> torch.Tensor:
    """keep_BV (bool): the tokens each row may sample. Parameters are [B] tensors (or scalars)."""
    return _mask_and_scale(logits_BV, temperature_B, top_k_B, top_p_B, min_p_B)[0]


def filter_logits(logits_BV: torch.Tensor, temperature_B, top_k_B, top_p_B, min_p_B) -> torch.Tensor:
    """scaled_BV (fp32): logits / T on the kept set, -inf elsewhere (rows with T == 0 scaled by 1)."""
    keep_BV, x_BV = _mask_and_scale(logits_BV, temperature_B, top_k_B, top_p_B, min_p_B)
    return x_BV.masked_fill(~keep_BV, float("-inf"))


def filter_mask_and_logits(logits_BV: torch.Tensor, temperature_B, top_k_B, top_p_B, min_p_B):
    """(keep_BV, scaled_BV) in one pass."""
    keep_BV, x_BV = _mask_and_scale(logits_BV, temperature_B, top_k_B, top_p_B, min_p_B)
    return keep_BV, x_BV.masked_fill(~keep_BV, float("-inf"))
