"""Drive a ModelRunner the way the engine will: page tables from a (shuffled) free list, chunked prefill."""

from __future__ import annotations

import random

from prefixkv.batch import BatchItem
from prefixkv.model.runner import ModelRunner
from prefixkv.sampling_params import SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=None)


class PagePool:
    """Hands out page ids in a shuffled order, so a request's pages are never contiguous."""

    def __init__(self, num_pages: int, shuffle_seed: int | None = 0) -> None:
        self.free = list(range(num_pages))
        if shuffle_seed is not None:
            random.Random(shuffle_seed).shuffle(self.free)

    def take(self, n: int) -> list[int]:
        assert len(self.free) >= n, "test pool too small"
        pages, self.free = self.free[:n], self.free[n:]
        return pages


class Sequence:
    """One request: its tokens, page table and the next BatchItem to run."""

    def __init__(
        self,
        rid: str,
        prompt: list[int],
        pool: PagePool,
        page_size: int,
        chunk: int | None = None,
        params: SamplingParams = GREEDY,
    ) -> None:
        self.rid, self.prompt, self.pool, self.page_size = rid, list(prompt), pool, page_size
        self.chunk = chunk or len(prompt)
        self.params = params
        self.tokens = list(prompt)  # prompt + generated
        self.computed = 0  # tokens whose KV is in the pages
        self.page_table: list[int] = []
        self.output: list[int] = []

    def next_item(self) -> BatchItem:
        if self.computed < len(self.prompt):
            todo = self.prompt[self.computed : self.computed + self.chunk]
        else:
            todo = self.tokens[self.computed :]
        end = self.computed + len(todo)
        need = -(-end // self.page_size) - len(self.page_table)
        if need > 0:
            self.page_table += self.pool.take(need)
        sample = end >= len(self.prompt)
        return BatchItem(self.rid, todo, self.computed, list(self.page_table), sample, self.params, len(self.output))

    def advance(self, item: BatchItem, sample) -> None:
        self.computed += len(item.token_ids)
        if sample is not None:
            self.output.append(sample.token_id)
            self.tokens.append(sample.token_id)


def run_batch(runner: ModelRunner, seqs: list[Sequence], max_new_tokens: int) -> None:
    """Step all sequences together until each has max_new_tokens outputs (mixed prefill/decode batches)."""
    while True:
        active = [s for s in seqs if len(s.output) < max_new_tokens]
        if not active:
            return
        items = [s.next_item() for s in active]
        for s, item, sample in zip(active, items, runner.execute(items)):
            s.advance(item, sample)


def greedy_generate(
    runner: ModelRunner,
    prompt: list[int],
    max_new_tokens: int,
    *,
    chunk: int | None = None,
    shuffle_seed: int | None = 0,
) -> list[int]:
    pool = PagePool(runner.num_pages, shuffle_seed)
    seq = Sequence("r0", prompt, pool, runner.page_size, chunk)
    run_batch(runner, [seq], max_new_tokens)
    return seq.output


def shared_prefix_step(page_size: int):
    """(token counts, start positions, page tables) of one step: decodes and prefill chunks behind one cached
    prefix of 96 tokens, plus unrelated rows (the attention plan tests' shared-prefix and cascade step)."""
    pool = PagePool(2048 // page_size, shuffle_seed=3)
    pages = lambda tokens: -(-tokens // page_size)
    shared = pool.take(96 // page_size)
    table = lambda prefix, end: prefix + pool.take(pages(end) - len(prefix))
    decodes = [(100, table(shared, 101)), (120, table(shared, 121)), (40, table([], 41))]
    prefills = [
        (20, 96, table(shared, 116)),  # chunks after the shared prefix
        (9, 0, table([], 9)),  # a fresh chunk between them: the group's rows are not adjacent
        (33, 96, table(shared, 129)),
        (5, 112, table(shared + pool.take(1 if page_size == 16 else 16), 117)),  # more cached context of its own
        (17, 50, table([], 67)),  # after cached tokens shared with nobody
    ]
    counts = [1] * len(decodes) + [n for n, _, _ in prefills]
    starts = [s for s, _ in decodes] + [s for _, s, _ in prefills]
    tables = [t for _, t in decodes] + [t for _, _, t in prefills]
    return counts, starts, tables
