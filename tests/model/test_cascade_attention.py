"""Cascade attention (decodes sharing leading pages attend to the shared prefix once) equals the plain paged path.

Attention level: a random pool, decodes sharing many / one / no leading pages (16-token and 1-token pages), mixed
with prefill chunks in the same step, with the CPU flash kernel and with the float32 reference ops. Runner level:
the fp32 default model gives the same greedy tokens with cascade forced on and off (cascade is off by default in
fp32, on in bf16/fp16).
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from prefixkv.model.attention import (
    CascadeDecodes,
    PaddedDecodes,
    StepPlanner,
    paged_attention,
)
from prefixkv.model.options import KernelOptions
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


def rows_of(group) -> list[int]:
    """The step rows a group answers for, in its order."""
    rows = group.rows
    return list(range(rows.start, rows.stop)) if isinstance(rows, slice) else rows.tolist()


def plan_step(counts, starts, tables, page_size, dtype, gather_width, options: KernelOptions):
    return StepPlanner(options, page_size, dtype, gather_width).plan(counts, starts, tables)


@pytest.mark.parametrize("page_size", [16, 1])
@pytest.mark.parametrize("dtype, atol", [(torch.float32, 1e-5), (torch.bfloat16, 3e-2), (torch.float16, 5e-3)])
@pytest.mark.parametrize("kernel", ["flash", "reference"])
def test_cascade_equals_plain(page_size, dtype, atol, kernel):
    # reference: the plain float32 ops used where the CPU flash kernel is unavailable
    options = KernelOptions(flash_lse=kernel == "flash")
    counts, starts, tables, num_slots = _step(page_size)
    gen = torch.Generator().manual_seed(0)
    pool = torch.randn(2, KVH, num_slots, D, generator=gen).to(dtype)
    t = sum(counts)
    q = torch.randn(t, KVH * GROUP, D, generator=gen).to(dtype)
    kv = torch.randn(t, 2, KVH, D, generator=gen).to(dtype)
    outs, metas = [], []
    for cascade in (False, True):
        meta = plan_step(
            counts, starts, tables, page_size, dtype, 2 * KVH * D, replace(options, cascade_decodes=cascade)
        )
        layer = pool.clone()
        outs.append(paged_attention(q, kv, layer, meta, D**-0.5))
        metas.append((meta, layer))
    assert not metas[0][0].groups_of(CascadeDecodes)
    assert torch.equal(metas[0][1], metas[1][1])  # both wrote the new K/V to the same slots

    meta = metas[1][0]
    got = [(rows_of(c), c.prefix_len, c.suffix_len) for c in meta.groups_of(CascadeDecodes)]
    assert sorted(got) == [([3, 4], B_SHARED, 150 + 1 - B_SHARED), ([5, 6, 7, 8], SHARED, 230 + 1 - SHARED)]
    assert sorted(r for g in meta.groups for r in rows_of(g)) == list(range(t))  # every row answered once
    assert outs[1].dtype == dtype and outs[1].shape == outs[0].shape
    torch.testing.assert_close(outs[1].float(), outs[0].float(), atol=atol, rtol=0)


def test_cascade_grouping_edges():
    # too few members / too short a shared prefix / nothing shared: no cascade, plain path untouched
    build = lambda starts, tables, cascade=True: plan_step(
        [1] * len(starts), starts, tables, 16, torch.float32, 8, KernelOptions(cascade_decodes=cascade)
    )
    shared = list(range(8))
    cascades = lambda meta: meta.groups_of(CascadeDecodes)
    assert not cascades(build([100], [shared]))
    assert not cascades(build([40, 100], [shared[:3], shared]))  # shares only 32 tokens before the 1st position
    assert not cascades(build([100, 100], [shared, list(range(8, 16))]))
    assert not cascades(build([64, 100], [shared[:5], shared]))  # 64 + 2 * 37 slots: not worth it
    meta = build([64, 70], [shared[:5], shared])  # exactly 64 shared tokens before position 64
    assert [(c.prefix_len, c.suffix_len) for c in cascades(meta)] == [(64, 7)]
    assert rows_of(meta.groups[0]) == [0, 1] and meta.groups_of(PaddedDecodes) == []
    assert not cascades(build([64, 70], [shared[:5], shared], cascade=False))
    # members of a group need not be adjacent rows; the new tokens' slots follow the step's rows all the same
    meta = build([20, 64, 70, 80], [[9, 10], shared[:5], [11] * 6, shared])
    assert [(type(g), rows_of(g)) for g in meta.groups] == [(CascadeDecodes, [1, 3]), (PaddedDecodes, [0, 2])]
    assert meta.slot_mapping.tolist() == [10 * 16 + 4, 64, 11 * 16 + 6, 80]


def test_runner_default_switch(tiny_checkpoint):
    from prefixkv.model.loader import load_model

    path, _ = tiny_checkpoint("qwen2")
    loaded = load_model(path)
    merged = lambda runner: (runner.options.cascade_decodes, runner.options.split_prefill)
    assert merged(ModelRunner(loaded, num_pages=4, page_size=16)) == (False, False)
    bf16 = ModelRunner(loaded, num_pages=4, page_size=16, dtype="bfloat16")
    assert merged(bf16) == (True, True)
    off = replace(bf16.options, cascade_decodes=False, split_prefill=False)
    assert merged(ModelRunner(loaded, num_pages=4, page_size=16, dtype="bfloat16", options=off)) == (False, False)


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


def test_fp32_runner_cascade_on_equals_off(smol, smol_prompts):
    tok = smol.tokenizer
    prefix = ((smol_prompts[1] + smol_prompts[2]) * 2)[:96]  # 6 shared 16-token pages
    assert len(prefix) == 96
    suffixes = [tok.encode(s) for s in (" The end.", " Then the fox", " In Paris, the capital of France,", " 1 2 3")]
    params = SamplingParams(temperature=0, max_tokens=None, logprobs=2)
    calls = []
    results = []
    for on in (False, True):
        options = KernelOptions.choose("cpu", torch.float32, smol.config, cascade_decodes=on, split_prefill=on)
        runner = ModelRunner(smol, num_pages=64, page_size=16, options=options)

        def recording_plan(*batch, plan=runner.planner.plan):  # record the cascade groups the steps planned
            step = plan(*batch)
            calls.extend(step.groups_of(CascadeDecodes))
            return step

        runner.planner.plan = recording_plan
        results.append(_shared_prefix_batch(runner, prefix, suffixes, params))
        assert bool(calls) == on
    (off, off_samples), (on_, _) = results
    for k, (a, b) in enumerate(zip(off, on_)):
        if a != b:  # only a numerical near-tie may flip
            j = next(i for i, (x, y) in enumerate(zip(a, b)) if x != y)
            top2 = off_samples[k][j].top_logprobs
            gap = top2[0][1] - top2[1][1]
            assert gap < TIE, f"request {k} diverged at token {j} with top-2 gap {gap}"
