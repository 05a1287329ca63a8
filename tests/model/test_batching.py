"""A step mixing decodes and prefill chunks of several requests gives each request exactly the tokens it
gets when run alone (on a tiny checkpoint, so the test is fast)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from prefixkv.batch import BatchItem
from prefixkv.model.attention import StepPlanner
from prefixkv.model.loader import load_model
from prefixkv.model.options import KernelOptions
from prefixkv.model.runner import ModelRunner
from prefixkv.sampling_params import SamplingParams
from tests.model.helpers import PagePool, Sequence, greedy_generate, run_batch

PROMPTS = [
    [1, 504, 3575, 282, 4649, 314, 7042, 30, 2, 198, 17, 9046],
    [5, 6],
    list(range(300, 341)),
    [9000],
    list(range(1000, 1019)),
]
NEW = 10


@pytest.fixture(scope="module")
def tiny(tiny_checkpoint):
    path, _ = tiny_checkpoint("qwen2")
    return load_model(path)


# the default options, and padded decode groups where decodes of different context lengths go to separate groups
@pytest.mark.parametrize("page_size, padded_groups", [(1, False), (16, False), (16, True)])
def test_mixed_batch_equals_alone(tiny, page_size, padded_groups):
    options = KernelOptions.choose("cpu", torch.float32, tiny.config)
    if padded_groups:
        options = replace(options, in_place_decodes=False, cache_invariant=False, fused_decode=False, min_split_len=0)
    runner = ModelRunner(tiny, num_pages=200 // page_size + 20, page_size=page_size, options=options)
    alone = [greedy_generate(runner, p, NEW) for p in PROMPTS]
    pool = PagePool(runner.num_pages, shuffle_seed=7)
    seqs = [Sequence(f"r{i}", p, pool, page_size, chunk=[None, 1, 9, None, 4][i]) for i, p in enumerate(PROMPTS)]
    # stagger arrivals so that steps really mix decodes with prefill chunks
    run_batch(runner, seqs[:2], 3)
    run_batch(runner, seqs, NEW)
    assert [s.output for s in seqs] == alone


def test_decode_groups_bound_padding():
    lens = [3, 5, 300, 310, 700, 2000]
    meta = StepPlanner(KernelOptions(), 1, torch.float32, 8).plan(
        [1] * len(lens), [n - 1 for n in lens], [list(range(n)) for n in lens]
    )
    groups = [(g.rows.start, g.rows.stop, g.max_len) for g in meta.groups]
    assert groups == [(0, 2, 5), (2, 4, 310), (4, 5, 700), (5, 6, 2000)]
    assert meta.slot_mapping.tolist() == [n - 1 for n in lens]


def test_non_sampling_items_return_none(tiny):
    runner = ModelRunner(tiny, num_pages=8, page_size=16)
    greedy = SamplingParams(temperature=0)
    items = [
        BatchItem("a", [1, 2, 3], 0, [0], False, greedy),
        BatchItem("b", [4, 5], 0, [1], True, greedy),
    ]
    out = runner.execute(items)
    assert out[0] is None and out[1] is not None
    assert runner.execute([]) == []


def test_short_page_table_is_an_error(tiny):
    runner = ModelRunner(tiny, num_pages=8, page_size=4)
    with pytest.raises(ValueError, match="page_table"):
        runner.execute([BatchItem("a", list(range(10)), 0, [0, 1], True, SamplingParams(temperature=0))])


def test_kv_bytes_per_token(tiny):
    c = tiny.config
    assert ModelRunner.kv_bytes_per_token(c, "float32") == 2 * c.num_layers * c.num_kv_heads * c.head_dim * 4
    assert ModelRunner.kv_bytes_per_token(c, "bfloat16") == 2 * c.num_layers * c.num_kv_heads * c.head_dim * 2
