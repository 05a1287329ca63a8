"""Cascade attention (decodes sharing leading pages attend to the shared prefix once) equals the plain paged path.

Attention level: a random pool, decodes sharing many / one / no leading pages (16-token and 1-token pages), mixed
with prefill chunks in the same step. Runner level: the fp32 default model gives the same greedy tokens with
cascade forced on and off (cascade is off by default in fp32, on in bf16/fp16).
"""
from __future__ import annotations

import pytest
import torch

from prefixkv.model import attention
from prefixkv.model.attention import AttentionMetadata, paged_attention
from prefixkv.model.runner import ModelRunner
from prefixkv.sampling_params import SamplingParams
from tests.model.helpers import PagePool, Sequence, run_batch

KVH, GROUP, D = 3, 3, 64
SHARED = 160  # tokens of family A's shared prefix
B_SHARED = 112  # family B: first 16 tokens of A, then its own 96


def _step(page_size: int, seed: int = 0):
    """(token_counts, start_positions, page_tables, num_slots) of one step, ordered as the runner orders it."""
    pool = PagePool(4096 // page_size, shuffle_seed=seed)
    pages = lambda tokens: -(-tokens // page_size)
    a = pool.take(SHARED // page_size)
    b = a[: pages(16)] + pool.take((B_SHARED - 16) // page_size)

    def table(prefix: list[int], end: int) -> list[int]:
        return prefix + pool.take(pages(end) - len(prefix))

    decodes = [  # (start_pos, page table): the step computes position start_pos
        (47, table(a[: pages(48)], 48)),  # shares A's start but too short to be a cascade member
        (50, table([], 51)),  # shares nothing
        (100, table(a[: pages(16)], 101)),  # shares only 16 tokens with A and B (splits the first-page group)
        (130, table(b, 131)),
        (150, table(b, 151)),
        (SHARED, table(a, SHARED + 1)),  # its whole context but the current token is shared
        (175, table(a, 176)),
        (200, table(a, 201)),
        (230, table(a, 231)),
        (300, table([], 301)),  # shares nothing, long
    ]
    prefills = [
        (5, SHARED, table(a, SHARED + 5)),  # chunk after A's cached prefix
        (7, 0, table([], 7)),  # fresh chunk
        (9, 60, table(b[: pages(48)], 69)),
    ]
    counts = [1] * len(decodes) + [n for n, _, _ in prefills]
    starts = [s for s, _ in decodes] + [s for _, s, _ in prefills]
    tables = [t for _, t in decodes] + [t for _, _, t in prefills]
    return counts, starts, tables, 4096


@pytest.mark.parametrize("page_size", [16, 1])
@pytest.mark.parametrize("dtype, atol", [(torch.float32, 1e-5), (torch.bfloat16, 3e-2), (torch.float16, 5e-3)])
@pytest.mark.parametrize("kernel", ["flash", "reference"])
def test_cascade_equals_plain(page_size, dtype, atol, kernel, monkeypatch):
    if kernel == "reference":  # the plain float32 ops used where the CPU flash kernel is unavailable
        monkeypatch.setattr(attention, "_flash_with_lse", None)
    counts, starts, tables, num_slots = _step(page_size)
    gen = torch.Generator().manual_seed(0)
    pool = torch.randn(2, KVH, num_slots, D, generator=gen).to(dtype)
    t = sum(counts)
    q = torch.randn(t, KVH * GROUP, D, generator=gen).to(dtype)
    kv = torch.randn(t, 2, KVH, D, generator=gen).to(dtype)
    outs, metas = [], []
    for cascade in (False, True):
        meta = AttentionMetadata.build(counts, starts, tables, page_size, "cpu", dtype, 2 * KVH * D, cascade=cascade)
        layer = pool.clone()
        outs.append(paged_attention(q, kv, layer, meta, D**-0.5))
        metas.append((meta, layer))
    assert not metas[0][0].cascades
    assert torch.equal(metas[0][1], metas[1][1])  # both wrote the new K/V to the same slots

    meta = metas[1][0]
    got = [(meta.decode_perm[c.row_start : c.row_end].tolist(), c.prefix_len, c.suffix_len) for c in meta.cascades]
    assert sorted(got) == [([3, 4], B_SHARED, 150 + 1 - B_SHARED), ([5, 6, 7, 8], SHARED, 230 + 1 - SHARED)]
    assert sorted(meta.decode_perm.tolist()) == list(range(10))
    assert outs[1].dtype == dtype and outs[1].shape == outs[0].shape
    torch.testing.assert_close(outs[1].float(), outs[0].float(), atol=atol, rtol=0)


def test_cascade_grouping_edges():
    # too few members / too short a shared prefix / nothing shared: no cascade, plain path untouched
    build = lambda starts, tables, cascade=True: AttentionMetadata.build(
        [1] * len(starts), starts, tables, 16, "cpu", torch.float32, 8, cascade=cascade
    )
    shared = list(range(8))
    assert not build([100], [shared]).cascades
    assert not build([40, 100], [shared[:3], shared]).cascades  # shares only 32 tokens before the 1st position
    assert not build([100, 100], [shared, list(range(8, 16))]).cascades
    assert not build([64, 100], [shared[:5], shared]).cascades  # 64 + 2 * 37 slots: not worth it
    meta = build([64, 70], [shared[:5], shared])  # exactly 64 shared tokens before position 64
    assert [(c.prefix_len, c.suffix_len) for c in meta.cascades] == [(64, 7)]
    assert meta.decode_perm is not None and meta.decodes == []
    assert not build([64, 70], [shared[:5], shared], cascade=False).cascades
    # the new tokens' slots follow the step's rows whatever the permutation
    meta = build([20, 64, 70, 80], [[9, 10], shared[:5], [11] * 6, shared])
    assert meta.decode_perm.tolist() == [1, 3, 0, 2] and meta.decode_order.tolist() == [2, 0, 3, 1]
    assert meta.slot_mapping.tolist() == [10 * 16 + 4, 64, 11 * 16 + 6, 80]


def test_runner_default_switch(tiny_checkpoint):
    from prefixkv.model.loader import load_model

    path, _ = tiny_checkpoint("qwen2")
    loaded = load_model(path)
    assert ModelRunner(loaded, num_pages=4, page_size=16).cascade_attention is False
    assert ModelRunner(loaded, num_pages=4, page_size=16, dtype="bfloat16").cascade_attention is True
    assert ModelRunner(loaded, num_pages=4, page_size=16, dtype="bfloat16", cascade_attention=False).cascade_attention \
        is False


NEW = 12
TIE = 1e-4


def _shared_prefix_batch(runner: ModelRunner, prefix: list[int], suffixes: list[list[int]], params):
    """Requests behind one cached prefix, as the prefix cache serves them: the same leading page ids."""
    ps = runner.page_size
    pool = PagePool(runner.num_pages, shuffle_seed=5)
    leader = Sequence("lead", prefix + suffixes[0], pool, ps, chunk=len(prefix), params=params)
    item = leader.next_item()
    leader.advance(item, runner.execute([item])[0])  # writes the prefix pages
    seqs = [leader]
    for i, suffix in enumerate(suffixes[1:]):
        s = Sequence(f"r{i}", prefix + suffix, pool, ps, params=params)
        s.page_table = list(leader.page_table[: len(prefix) // ps])
        s.computed = len(prefix)
        seqs.append(s)
    samples: list[list] = [[] for _ in seqs]
    execute = runner.execute

    def recording(items):  # keep the sampled logprobs, for the tie check
        out = execute(items)
        for it, sample in zip(items, out):
            if sample is not None:
                samples[[s.rid for s in seqs].index(it.request_id)].append(sample)
        return out

    runner.execute = recording
    run_batch(runner, seqs, NEW)
    return [s.output for s in seqs], samples


def test_fp32_runner_cascade_on_equals_off(smol, smol_prompts, monkeypatch):
    tok = smol.tokenizer
    prefix = ((smol_prompts[1] + smol_prompts[2]) * 2)[:96]  # 6 shared 16-token pages
    assert len(prefix) == 96
    suffixes = [tok.encode(s) for s in (" The end.", " Then the fox", " In Paris, the capital of France,", " 1 2 3")]
    params = SamplingParams(temperature=0, max_tokens=None, logprobs=2)
    calls = []
    cascade_attention = attention._cascade_attention
    monkeypatch.setattr(attention, "_cascade_attention", lambda *a: calls.append(1) or cascade_attention(*a))
    results = []
    for on in (False, True):
        runner = ModelRunner(smol, num_pages=64, page_size=16, cascade_attention=on)
        results.append(_shared_prefix_batch(runner, prefix, suffixes, params))
        assert bool(calls) == on
    (off, off_samples), (on_, _) = results
    for k, (a, b) in enumerate(zip(off, on_)):
        if a != b:  # only a numerical near-tie may flip
            j = next(i for i, (x, y) in enumerate(zip(a, b)) if x != y)
            top2 = off_samples[k][j].top_logprobs
            gap = top2[0][1] - top2[1][1]
            assert gap < TIE, f"request {k} diverged at token {j} with top-2 gap {gap}"
