"""ModelRunner: owns the KV pool, turns a list of BatchItems into one forward pass and samples.

It sees only page tables: which prefix cache (if any) produced them is invisible here. It is also where the
forward pass's kernel choices are made, once: the KernelOptions it starts with configure the model (fused ops,
packed weights) and the step planner (which attention path each row takes).
"""

from __future__ import annotations

import warnings

import numpy as np
import torch

from prefixkv.batch import BatchItem, Sample
from prefixkv.model import cpu_features, native
from prefixkv.model.attention import StepPlanner
from prefixkv.model.config import ModelConfig
from prefixkv.model.loader import LoadedModel, parse_dtype
from prefixkv.model.options import KernelOptions
from prefixkv.model.pool_memory import lazily_zeroed
from prefixkv.model.sampler import Sampler


class ModelRunner:
    def __init__(
        self,
        loaded: LoadedModel,
        num_pages: int,
        page_size: int,
        device: str | None = None,
        dtype: str | None = None,
        seed: int | None = None,
        options: KernelOptions | None = None,
        nan_kv: bool = False,
    ) -> None:
        """device/dtype default to the loaded model's; if given and different, the model is moved/cast.

        options: how the forward pass computes (prefixkv.model.options); None = `KernelOptions.choose` for this
        device, dtype and model: every bit-exact fast path that runs here, and the paths that reorder the
        attention sum (cascade decodes, split prefill) only below float32. A LoadedModel serves one runner at a
        time: the runner built last sets its device, dtype and kernels. nan_kv: the debug mode (EngineConfig's
        debug_nan_kv): pages the cache calls invalid are filled with NaN (poison_pages), and a step whose logits
        are not finite raises.
        """
        if num_pages < 1 or page_size < 1:
            raise ValueError(f"num_pages and page_size must be >= 1, got {num_pages}, {page_size}")
        self.loaded = loaded
        self.model = loaded.model
        self.config = loaded.config
        first = next(self.model.parameters())
        self.device = torch.device(device) if device is not None else first.device
        self.dtype = parse_dtype(dtype) if dtype is not None else first.dtype
        if first.device != self.device or first.dtype != self.dtype:
            self.model.to(device=self.device, dtype=self.dtype)
        if options is None:
            options = KernelOptions.choose(self.device, self.dtype, self.config)
        else:
            options.check(self.device, self.dtype, self.config)
        self.options = options
        self.model.use_kernels(options)
        self.num_pages, self.page_size = num_pages, page_size
        c = self.config
        # one page more than the cache hands out: the pad page, which padded rows and page tables read (masked
        # out, but read), so it must stay finite; zeros, not empty, for the same reason everywhere else
        self.kv_cache = lazily_zeroed(
            (c.num_layers, 2, c.num_kv_heads, (num_pages + 1) * page_size, c.head_dim), self.dtype, self.device
        )
        self.model.bind_kv_cache(self.kv_cache)
        self.nan_kv = nan_kv
        self._pending_poison: list[int] = []  # pages poison_pages was told of, NaN before the next write
        self.sampler = Sampler(seed)
        self.planner = StepPlanner(
            options, page_size, self.dtype, 2 * c.num_kv_heads * c.head_dim, self.device, pad_page=num_pages
        )

    def kernel_report(self) -> dict[str, str]:
        """Which hardware and kernels compute here, as labels: the start log line, /metrics' prefixkv:kernel_info
        and every benchmark's JSON carry it (a number means little without the CPU and path it came from)."""
        cpu = self.device.type == "cpu"
        return {
            "device": self.device.type,
            "cpu": cpu_features.model_name(),
            "isa_path": self.options.isa_path if cpu else "torch",
            "matmul": self.options.matmul,
            "weights": self.options.weight_format,
            "attention": ("amx" if self.options.amx_attention else native.attention_isa())
            if self.options.native_attention
            else "torch",
            "cache_invariant": "on" if self.options.cache_invariant else "off",
        }

    @staticmethod
    def kv_bytes_per_token(config: ModelConfig, dtype: str = "float32") -> int:
        """Bytes of K and V for one token across all layers (the engine sizes the pool from this)."""
        element = torch.empty((), dtype=parse_dtype(dtype)).element_size()
        return 2 * config.num_layers * config.num_kv_heads * config.head_dim * element

    # -- KV in and out of the pool (a second tier's loads and saves; the runner knows nothing of tiers) ---------
    @torch.inference_mode()
    def read_kv(self, slots: list[int]) -> bytes:
        """K and V of these pool token slots, laid out [layers, 2, kv_heads, len(slots), head_dim], C-contiguous,
        in the pool's dtype (bf16 travels as its raw bytes)."""
        index = torch.tensor(slots, dtype=torch.long, device=self.device)
        picked = self.kv_cache.index_select(3, index).contiguous().cpu()
        return picked.view(-1).view(torch.uint8).numpy().tobytes()

    @torch.inference_mode()
    def write_kv(self, slots: list[int], payload: bytes, first_token: int = 0) -> None:
        """Write tokens [first_token, first_token + len(slots)) of a payload in read_kv's layout (of any number
        of tokens) into these pool token slots."""
        c = self.config
        element = self.kv_cache.element_size()
        tokens = len(payload) // (2 * c.num_layers * c.num_kv_heads * c.head_dim * element)
        if first_token < 0 or first_token + len(slots) > tokens:
            raise ValueError(f"tokens [{first_token}, {first_token + len(slots)}) of a {tokens}-token payload")
        with warnings.catch_warnings():  # read only here: frombuffer warns that bytes are immutable
            warnings.simplefilter("ignore", UserWarning)
            raw = torch.frombuffer(payload, dtype=torch.uint8)
        kv = raw.view(self.dtype).view(c.num_layers, 2, c.num_kv_heads, tokens, c.head_dim)
        kv = kv[:, :, :, first_token : first_token + len(slots)].to(self.device)
        index = torch.tensor(slots, dtype=torch.long, device=self.device)
        self._apply_poison()
        self.kv_cache.index_copy_(3, index, kv)

    def poison_pages(self, pages: list[int]) -> None:
        """The debug_nan_kv mode: these pages hold no KV anyone may read (the cache reports each page it hands
        out, evicts or frees uncached). They are filled with NaN before the next load into the pool or forward
        pass, so a later read of KV never written or freed turns the answers it touches into NaN instead of
        plausible tokens. Not at once: a write_back tier reads an evicted page's KV after the allocation that
        reuses it and before that step's loads and forward pass, by design (kvcache/offload/tiered_cache.py)."""
        if pages and (max(pages) >= self.num_pages or min(pages) < 0):
            raise ValueError(f"pages {min(pages)}..{max(pages)} outside the pool's {self.num_pages}")
        self._pending_poison.extend(pages)

    @torch.inference_mode()
    def _apply_poison(self) -> None:
        if not self._pending_poison:
            return
        c, pages = self.config, torch.tensor(self._pending_poison, dtype=torch.long, device=self.device)
        self._pending_poison = []
        by_page = self.kv_cache.view(c.num_layers, 2, c.num_kv_heads, self.num_pages + 1, self.page_size, -1)
        by_page.index_fill_(3, pages, float("nan"))

    @torch.inference_mode()
    def execute(self, items: list[BatchItem]) -> list[Sample | None]:
        """One forward pass over all items; returns a Sample for each item with sample=True, else None."""
        if not items:
            return []
        for it in items:
            self._check(it)
        self._apply_poison()
        # single-token items (decodes) first, shortest context first: they share batched attention calls
        order = sorted(
            range(len(items)),
            key=lambda i: (0, items[i].start_pos) if len(items[i].token_ids) == 1 else (1, 0),
        )
        ordered = [items[i] for i in order]
        counts = [len(it.token_ids) for it in ordered]
        plan = self.planner.plan(counts, [it.start_pos for it in ordered], [it.page_table for it in ordered])
        input_ids = torch.tensor([t for it in ordered for t in it.token_ids], dtype=torch.long, device=self.device)
        positions = np.concatenate([np.arange(it.start_pos, it.start_pos + n) for it, n in zip(ordered, counts)])
        hidden = self.model(input_ids, torch.from_numpy(positions).to(self.device), plan)

        # rows whose logits are needed: the last token of each sampling item
        sample_rows, sample_at, row = [], [], 0
        for k, (it, n) in enumerate(zip(ordered, counts)):
            row += n
            if it.sample:
                sample_rows.append(row - 1)
                sample_at.append(k)
        results: list[Sample | None] = [None] * len(items)
        if not sample_at:
            return results
        logits = self.model.compute_logits(hidden[torch.tensor(sample_rows, device=self.device)])
        if self.nan_kv and not bool(torch.isfinite(logits).all()):
            bad = [ordered[k].request_id for k, ok in zip(sample_at, torch.isfinite(logits).all(-1).tolist()) if not ok]
            raise RuntimeError(
                f"debug_nan_kv: the logits of {', '.join(map(str, bad))} are not finite: a step read KV that was "
                "never written or was freed (a page the cache handed out, evicted or freed uncached)"
            )
        chosen = [ordered[k] for k in sample_at]
        gates = [(row, it.grammar) for row, it in enumerate(chosen) if it.grammar is not None]
        masked = [(row, gate.mask()) for row, gate in gates if not gate.check_first]
        if masked:
            logits = _mask_disallowed(logits, masked)
        samples = self._sample(logits, chosen)
        for row, gate in gates:  # greedy rows checked after sampling: resampled masked where the grammar refuses
            if gate.check_first and not gate.admits(samples[row].token_id):
                _mask_disallowed(logits, [(row, gate.mask())])
                samples[row] = self._sample(logits[row : row + 1], [chosen[row]])[0]
        for k, sample in zip(sample_at, samples):
            results[order[k]] = sample
        return results

    def _sample(self, logits: torch.Tensor, items: list[BatchItem]) -> list[Sample]:
        return self.sampler(
            logits,
            [it.sampling_params for it in items],
            [it.num_output_tokens for it in items],
            [None if it.history is None else (it.history, it.num_prompt_tokens) for it in items],
        )

    def _check(self, it: BatchItem) -> None:
        n = len(it.token_ids)
        if n == 0:
            raise ValueError(f"request {it.request_id}: empty token_ids")
        needed = -(-(it.start_pos + n) // self.page_size)
        if len(it.page_table) < needed:
            raise ValueError(
                f"request {it.request_id}: page_table has {len(it.page_table)} pages, "
                f"positions up to {it.start_pos + n} need {needed}"
            )


def _mask_disallowed(logits: torch.Tensor, constrained: list[tuple[int, bytes]]) -> torch.Tensor:
    """Structured outputs: each constrained row's logits with every token its grammar does not allow at -inf, in
    place, a row at a time (allowed: bit t of the little-endian 32-bit words is token t; words past the vocabulary
    are ignored, and tokens past a narrower mask are not allowed: unpackbits pads with zeros)."""
    vocab = logits.shape[-1]
    for row, allowed in constrained:
        bits = np.unpackbits(np.frombuffer(allowed, dtype=np.uint8), bitorder="little", count=vocab)
        blocked = torch.from_numpy(bits.view(np.bool_)).logical_not_().to(logits.device)
        logits[row].masked_fill_(blocked, float("-inf"))
    return logits
