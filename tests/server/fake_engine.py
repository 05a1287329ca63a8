"""A model-free stand-in for prefixkv.engine.Engine, so the server's plumbing (engine thread, streaming,
aborts, errors, auth) is tested in well under a second.

Tokens are UTF-8 bytes; each step appends one letter per request, derived from the prompt, so outputs are
deterministic. Pages are counted like the real engine: held while a request runs, released when it ends.
"""
from __future__ import annotations

import time

from prefixkv.engine.metrics import EngineStats
from prefixkv.outputs import CompletionOutput, RequestMetrics, RequestOutput
from prefixkv.sampling_params import SamplingParams

PAGE = 16


class ByteTokenizer:
    eos_token_ids = {0}

    def encode(self, text: str) -> list[int]:
        return list(text.encode())

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return bytes(ids).decode(errors="replace")

    def apply_chat_template(self, messages, add_generation_prompt: bool = True) -> str:
        return "".join(f"<{m['role']}>{m['content']}\n" for m in messages) + "<assistant>"


def expected_text(prompt_ids: list[int], num_tokens: int, index: int = 0) -> str:
    """What the fake generates for a prompt: letters walking from a prompt-dependent start."""
    start = (sum(prompt_ids) + index) % 26
    return "".join(chr(ord("a") + (start + i) % 26) for i in range(num_tokens))


class FakeEngine:
    model_name = "fake-model"
    max_model_len = 256

    def __init__(self, step_delay: float = 0.002, num_pages: int = 1024) -> None:
        self.tokenizer = ByteTokenizer()
        self.step_delay = step_delay
        self.num_pages = num_pages
        self.requests: dict[str, dict] = {}
        self.aborted: list[str] = []
        self.added: list[dict] = []
        self.prompt_tokens = self.generation_tokens = 0
        self.fail_steps = 0  # that many next steps raise, like an engine bug would

    def add_request(self, request_id, prompt, sampling_params: SamplingParams, *, priority=0, cache_salt=None,
                    lora_id=None) -> str:
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        sampling_params.validate()
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        if not all(isinstance(t, int) and 0 <= t < 256 for t in ids):
            raise ValueError("prompt token ids must be integers in [0, 256)")
        if len(ids) >= self.max_model_len:
            raise ValueError(f"the prompt has {len(ids)} tokens but max_model_len is {self.max_model_len}")
        max_tokens = sampling_params.max_tokens or self.max_model_len - len(ids)
        if len(ids) + max_tokens > self.max_model_len:
            raise ValueError(f"max_tokens={max_tokens} with a {len(ids)}-token prompt exceeds max_model_len")
        self.requests[request_id] = {"ids": ids, "params": sampling_params, "max_tokens": max_tokens,
                                     "out": [[] for _ in range(sampling_params.n)], "arrival": time.monotonic(),
                                     "first": None, "salt": cache_salt}
        self.added.append({"request_id": request_id, "prompt": prompt, "priority": priority, "cache_salt": cache_salt})
        self.prompt_tokens += len(ids)
        return request_id

    def abort(self, request_id: str) -> None:
        if self.requests.pop(request_id, None) is not None:
            self.aborted.append(request_id)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def _output(self, rid: str, r: dict, finished: bool, now: float) -> RequestOutput:
        comps = [CompletionOutput(i, self.tokenizer.decode(out), list(out), "length" if finished else None)
                 for i, out in enumerate(r["out"])]
        return RequestOutput(rid, None, r["ids"], comps, finished, num_cached_tokens=0,
                             metrics=RequestMetrics(r["arrival"], r["arrival"], r["first"], now if finished else None))

    def step(self) -> list[RequestOutput]:
        time.sleep(self.step_delay)
        if self.fail_steps:
            self.fail_steps -= 1
            raise RuntimeError("injected step failure")
        now = time.monotonic()
        outputs = []
        for rid, r in list(self.requests.items()):
            for i, out in enumerate(r["out"]):
                out.append(ord(expected_text(r["ids"], len(out) + 1, i)[-1]))
            self.generation_tokens += len(r["out"])
            r["first"] = r["first"] or now
            finished = len(r["out"][0]) >= r["max_tokens"]
            outputs.append(self._output(rid, r, finished, now))
            if finished:
                del self.requests[rid]
        return outputs

    def pages_used(self) -> int:
        return sum(-(-(len(r["ids"]) + len(r["out"][0])) // PAGE) * len(r["out"]) for r in self.requests.values())

    def get_stats(self) -> EngineStats:
        used = self.pages_used()
        return EngineStats(num_running=len(self.requests), num_waiting=0, num_pages_total=self.num_pages,
                           num_pages_used=used, kv_usage=used / self.num_pages, prefix_cache_queries=self.prompt_tokens,
                           prefix_cache_hits=0, prefix_cache_hit_rate=0.0, num_preemptions=0, num_steps=0,
                           prompt_tokens_total=self.prompt_tokens, generation_tokens_total=self.generation_tokens,
                           computed_tokens_total=0)

    def reset_prefix_cache(self) -> bool:
        return True

    def cache_summary(self) -> dict:
        return {"type": "fake", "num_pages": self.num_pages, "free_pages": self.num_pages - self.pages_used()}
