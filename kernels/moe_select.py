"""The router's selection over [BLOCK_T, E_P] tiles of logits (kernels/moe_route.py's module
docstring gives the rules): scoring, the correction bias, group-limited top-k by iterative
max over int64 keys that order like (choice, -index), renormalisation and scaling; then the
weights and ids stored. Device functions only (called inside the router kernel)."""
from __future__ import annotations

import triton.language as tl

from pdserve.kernels._triton import jit

_BIG = tl.constexpr(2147483647)  # "no index": above every expert id
_NO_KEY = tl.constexpr(-(2 ** 63))  # below every key of _order_keys (taken or padding)


@jit
def _group_keep(choice, e, E, group_size, n_group, topk_group, BLOCK_T: tl.constexpr,
                E_P: tl.constexpr, NG_P: tl.constexpr):
    """[BLOCK_T, E_P] bool: the experts of each row's topk_group best groups, a group scoring
    the sum of its best two choices (lowest index first on ties)."""
    grp = e // group_size
    gidx = tl.arange(0, NG_P)
    in_e = (e < E)[None, :]
    gscore = tl.full([BLOCK_T, NG_P], float("-inf"), tl.float32)
    for g in range(n_group):
        member = in_e & (grp == g)[None, :]
        m1 = tl.max(tl.where(member, choice, float("-inf")), axis=1)
        i1 = tl.min(tl.where(member & (choice == m1[:, None]), e[None, :], _BIG), axis=1)
        m2 = tl.max(tl.where(member & (e[None, :] != i1[:, None]), choice, float("-inf")), axis=1)
        gscore = tl.where(gidx[None, :] == g, (m1 + m2)[:, None], gscore)
    avail = tl.broadcast_to((gidx < n_group)[None, :], [BLOCK_T, NG_P])
    keep = tl.zeros([BLOCK_T, E_P], tl.int1)
    for _ in range(topk_group):
        gm = tl.max(tl.where(avail, gscore, float("-inf")), axis=1)
        gi = tl.min(tl.where(avail & (gscore == gm[:, None]), gidx[None, :], _BIG), axis=1)
        keep = keep | (grp[None, :] == gi[:, None])
        avail = avail & (gidx[None, :] != gi[:, None])
    return keep


@jit
def _order_keys(choice, e):
    """int64 keys that order like (choice, -index): one max reduction per selected expert
    finds the best choice and breaks its ties to the lowest index (a max, a min over equal
    choices and a sum per expert, as before, put 24 cross-warp reductions in a top-8).
    High word: the float's bits made to order as signed ints; low word: 2^31 - 1 - index."""
    bits = (choice + 0.0).to(tl.int32, bitcast=True)  # + 0.0: -0.0 and 0.0 share a key
    ordered = bits ^ ((bits >> 31) & 0x7FFFFFFF)
    return (ordered.to(tl.int64) << 32) | (0x7FFFFFFF - e).to(tl.int64)


@jit
def _key_choice(key):
    """The choice a key of _order_keys holds (its high word, the bit transform undone)."""
    ordered = (key >> 32).to(tl.int32)
    return (ordered ^ ((ordered >> 31) & 0x7FFFFFFF)).to(tl.float32, bitcast=True)


@jit
def _topk(choice, weight_src, e, E, BLOCK_T: tl.constexpr, E_P: tl.constexpr,
          TOP_K: tl.constexpr, K_P: tl.constexpr, WEIGHT_IS_CHOICE: tl.constexpr):
    """Iterative max over choice [BLOCK_T, E_P] (lowest index on ties): ids [BLOCK_T, K_P]
    int32 and the weight_src values at them, fp32; columns >= TOP_K are 0. With
    WEIGHT_IS_CHOICE (softmax) the weight comes out of the key: one reduction per expert."""
    keys = tl.where((e < E)[None, :], _order_keys(choice, e[None, :]), _NO_KEY)
    kk = tl.arange(0, K_P)[None, :]
    wts = tl.zeros([BLOCK_T, K_P], tl.float32)
    ids = tl.zeros([BLOCK_T, K_P], tl.int32)
    for i in tl.static_range(TOP_K):
        m = tl.max(keys, axis=1)
        idx = 0x7FFFFFFF - m.to(tl.int32)  # the low word
        hit = e[None, :] == idx[:, None]
        if WEIGHT_IS_CHOICE:  # -inf: a NaN choice (softmax weights are >= 0); NaN as before
            w = _key_choice(m)
            w = tl.where(w == float("-inf"), float("nan"), w)
        else:
            w = tl.sum(tl.where(hit, weight_src, 0.0), axis=1)
        wts = tl.where(kk == i, w[:, None], wts)
        ids = tl.where(kk == i, idx[:, None], ids)
        keys = tl.where(hit, _NO_KEY, keys)
    return wts, ids


@jit
def select_store(logits, rows, row_ok, bias_ptr, wts_ptr, ids_ptr, E, group_size, n_group,
                  topk_group, scaling, SIGMOID: tl.constexpr, HAS_BIAS: tl.constexpr,
                  GROUPED: tl.constexpr, RENORM: tl.constexpr, TOP_K: tl.constexpr,
                  K_P: tl.constexpr, NG_P: tl.constexpr, BLOCK_T: tl.constexpr,
                  E_P: tl.constexpr):
    """Score logits [BLOCK_T, E_P], select top-k, store weights fp32 / ids int32 [T, TOP_K]."""
    e = tl.arange(0, E_P)
    e_ok = (e < E)[None, :]
    if SIGMOID:
        weight_src = tl.where(e_ok, tl.sigmoid(tl.where(e_ok, logits, 0.0)), 0.0)
        choice = weight_src
        if HAS_BIAS:
            choice += tl.load(bias_ptr + e, mask=e < E, other=0.0).to(tl.float32)[None, :]
        choice = tl.where(choice != choice, float("-inf"), choice)  # NaN: never chosen first
        if GROUPED:
            choice = tl.where(_group_keep(choice, e, E, group_size, n_group, topk_group,
                                          BLOCK_T, E_P, NG_P), choice, float("-inf"))
    else:
        z = tl.where(e_ok, logits, float("-inf"))
        p = tl.exp(z - tl.max(z, axis=1)[:, None])
        weight_src = p / tl.sum(p, axis=1)[:, None]
        choice = tl.where(weight_src != weight_src, float("-inf"), weight_src)
    wts, ids = _topk(choice, weight_src, e, E, BLOCK_T, E_P, TOP_K, K_P, not SIGMOID)
    if RENORM:
        denom = tl.sum(wts, axis=1)[:, None]
        if SIGMOID:  # as the reference (and transformers' sigmoid routers)
            denom += 1e-20
        wts = wts / denom
    wts = wts * scaling
    kk = tl.arange(0, K_P)
    out = rows[:, None].to(tl.int64) * TOP_K + kk[None, :]
    mask = row_ok[:, None] & (kk < TOP_K)[None, :]
    tl.store(wts_ptr + out, wts, mask=mask)
    tl.store(ids_ptr + out, ids, mask=mask)
