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
