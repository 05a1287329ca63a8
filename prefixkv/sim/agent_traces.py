"""Coding-agent session traces (kv-cache-tester's Claude Code format): load, validate, describe, scale.

One JSON file per session (a directory of them is a set): requests with `t`, `in`, `out`, `hash_ids` over
64-token blocks, `think_time` (the client's delay before the request: tools, the user) and nested `subagent`
entries, each a session of its own that the parent waits for. Unlike the Mooncake and Bailian traces, time here
is closed loop: a request is issued `think_time` after the previous answer, however long that answer took, so the
replay (sessions.py) issues requests as answers come back instead of at recorded times.

A session is a list of steps: a request, or a group of subagents started together (consecutive `subagent`
entries). Hash ids of a `local`-scope file are comparable within that session only, so the loader renumbers them
per file (a session and its subagents share one namespace); `global` ids are kept. Only full blocks carry an id
(`len(hash_ids) == in // 64`): the partial tail of a prompt is its own, never shared. See docs/agent_traces.md.
"""

from __future__ import annotations

import glob
import json
import math
import os
import random
from collections.abc import Sequence
from dataclasses import dataclass, field

from prefixkv.sim.traces import BlockTokens, TraceFormatError, scaled_length

BLOCK_SIZE = 64  # tokens per hash id in this format
_REQUEST_FIELDS = ("t", "in", "out", "hash_ids")


@dataclass(frozen=True, slots=True)
class AgentRequest:
    """One model call of an agent."""

    think_s: float  # after the previous answer of this agent (or its subagents' join, or its start)
    input_tokens: int
    output_tokens: int
    block_ids: tuple[int, ...]  # one id per full 64-token block, renumbered into the set's namespace
    tail_id: int  # the id standing for the partial last block (unique to this request)
    recorded_t: float  # seconds since the session started, as recorded
    api_time_s: float | None  # the original server's time for it, when recorded


@dataclass(frozen=True, slots=True)
class SubagentGroup:
    """Subagents started together: each starts `delay_s` after the parent's previous answer; the parent's next
    request waits for the last of them, then `resume_s` more."""

    delays_s: tuple[float, ...]
    agents: tuple[AgentSession, ...]
    resume_s: float


@dataclass(frozen=True, slots=True)
class AgentSession:
    id: str
    kind: str  # "session" or the subagent's type (e.g. "Explore")
    steps: tuple[AgentRequest | SubagentGroup, ...]
    recorded_s: float  # span of the session as recorded (first request to last answer)

    def requests(self) -> list[AgentRequest]:
        """Every request of the session and its subagents, in recorded order per agent (parent's first)."""
        out: list[AgentRequest] = []
        for step in self.steps:
            if isinstance(step, AgentRequest):
                out.append(step)
            else:
                for agent in step.agents:
                    out.extend(agent.requests())
        return out

    def num_subagents(self) -> int:
        return sum(
            len(s.agents) + sum(a.num_subagents() for a in s.agents) for s in self.steps if isinstance(s, SubagentGroup)
        )


@dataclass
class AgentTrace:
    path: str
    sessions: list[AgentSession]
    max_id: int  # the largest renumbered id (block and tail ids)


def is_agent_trace(path: str) -> bool:
    """A directory of .json files, or one .json file (not JSON lines): this format."""
    return os.path.isdir(path) or (path.endswith(".json") and os.path.isfile(path))


def session_files(path: str) -> list[str]:
    if os.path.isdir(path):
        files = sorted(glob.glob(os.path.join(path, "*.json")))
        if not files:
            raise TraceFormatError(f"{path}: no .json session files in the directory")
        return files
    return [path]


def load_agent_trace(path: str, limit: int | None = None) -> AgentTrace:
    """Every session file under `path` (a directory, sorted by name, or one file), at most `limit` sessions.
    A malformed file raises TraceFormatError naming the file, the request (by index path, e.g. requests[4]
    .requests[2]) and the field."""
    if limit is not None and limit < 1:
        raise ValueError(f"limit must be >= 1, got {limit}")
    files = session_files(path)[:limit]
    ids = _Renumber()
    sessions = []
    for file in files:
        try:
            with open(file, encoding="utf-8") as f:
                obj = json.load(f)
        except json.JSONDecodeError as e:
            raise TraceFormatError(f"{file}: not valid JSON ({e.msg} at line {e.lineno})") from None
        except UnicodeDecodeError:
            raise TraceFormatError(f"{file}: not UTF-8 text") from None
        if not isinstance(obj, dict):
            raise TraceFormatError(f"{file}: expected a JSON object (one session), got {type(obj).__name__}")
        scope = obj.get("hash_id_scope", "local")
        if scope not in ("local", "global"):
            raise TraceFormatError(f"{file}: field 'hash_id_scope' must be 'local' or 'global', got {scope!r}")
        block = obj.get("block_size", BLOCK_SIZE)
        if block != BLOCK_SIZE:
            raise TraceFormatError(
                f"{file}: field 'block_size' is {block!r}; this loader reads {BLOCK_SIZE}-token blocks"
            )
        namespace = os.path.basename(file) if scope == "local" else ""
        name = str(obj.get("id", os.path.splitext(os.path.basename(file))[0]))
        sessions.append(_parse_session(_Where(file, "requests"), obj, name, "session", namespace, ids))
    return AgentTrace(path, sessions, ids.count)


class _Renumber:
    """(namespace, id) -> a dense id; tails get fresh ids no block shares."""

    def __init__(self) -> None:
        self.ids: dict[tuple[str, int], int] = {}
        self.count = 0

    def block(self, namespace: str, raw: int) -> int:
        key = (namespace, raw)
        got = self.ids.get(key)
        if got is None:
            self.count += 1
            got = self.ids[key] = self.count
        return got

    def fresh(self) -> int:
        self.count += 1
        return self.count


@dataclass(frozen=True)
class _Where:
    file: str
    path: str

    def at(self, index: int, name: str = "") -> _Where:
        return _Where(self.file, f"{self.path}[{index}]" + (f".{name}" if name else ""))

    def error(self, why: str) -> TraceFormatError:
        return TraceFormatError(f"{self.file}: {self.path}: {why}")


def _number(where: _Where, obj: dict, name: str, default: float | None = None) -> float:
    value = obj.get(name, default)
    if value is None:
        raise where.error(f"field {name!r} is missing")
    if type(value) not in (int, float) or not math.isfinite(value) or value < 0:
        raise where.error(f"field {name!r} must be a finite number >= 0, got {value!r}")
    return float(value)


def _count(where: _Where, obj: dict, name: str) -> int:
    value = obj.get(name)
    if value is None:
        raise where.error(f"field {name!r} is missing")
    if type(value) is not int or value < 0:
        raise where.error(f"field {name!r} must be an integer >= 0, got {value!r}")
    return value


def _parse_session(where: _Where, obj: dict, name: str, kind: str, namespace: str, ids: _Renumber) -> AgentSession:
    raw = obj.get("requests")
    if not isinstance(raw, list) or not raw:
        raise where.error("must be a non-empty list of requests")
    steps: list[AgentRequest | SubagentGroup] = []
    prev_end = 0.0  # recorded time of the previous answer of this agent (or its subagents' join)
    group: list[tuple[float, AgentSession, float]] = []  # (start t, agent, recorded end)
    last_t = -math.inf
    for i, entry in enumerate(raw):
        here = where.at(i)
        if not isinstance(entry, dict):
            raise here.error(f"expected a JSON object, got {type(entry).__name__}")
        t = _number(here, entry, "t")
        if t < last_t:
            raise here.error(f"field 't' goes back in time ({t} after {last_t})")
        last_t = t
        if entry.get("type") == "subagent":
            # an async-launched subagent has no recorded duration (4 of the upstream set's subagents, in one of
            # its files): its own requests' span stands for it, and the parent waits for it as for the others,
            # as the upstream replayer does
            if entry.get("duration_ms") is None and entry.get("status") == "async_launched":
                duration = 0.0
            else:
                duration = _number(here, entry, "duration_ms") / 1000
            agent_name = str(entry.get("agent_id", f"{name}/{i}"))
            sub = _parse_session(
                _Where(here.file, f"{here.path}.requests"),
                entry,
                f"{name}/{agent_name}",
                str(entry.get("subagent_type", "subagent")),
                namespace,
                ids,
            )
            group.append((t, sub, t + max(duration, sub.recorded_s)))
            continue
        if group:
            steps.append(_join(group, prev_end, t))
            prev_end = max(end for _, _, end in group)
            group = []
        n_in, n_out = _count(here, entry, "in"), _count(here, entry, "out")
        hashes = entry.get("hash_ids")
        if not isinstance(hashes, list) or not all(type(h) is int and h >= 0 for h in hashes):
            raise here.error("field 'hash_ids' must be a list of integers >= 0")
        if len(hashes) != n_in // BLOCK_SIZE:
            raise here.error(
                f"field 'hash_ids' has {len(hashes)} ids but 'in' {n_in} has {n_in // BLOCK_SIZE} full blocks "
                f"of {BLOCK_SIZE} tokens"
            )
        if n_in == 0:
            raise here.error("field 'in' is 0: a request without a prompt")
        api = entry.get("api_time")
        api_s = _number(here, entry, "api_time") if api is not None else None
        if "think_time" in entry:
            think = _number(here, entry, "think_time")
        else:  # not recorded: the gap since the previous answer (the first request starts the session)
            think = max(0.0, t - prev_end) if steps else 0.0
        steps.append(
            AgentRequest(
                think_s=think,
                input_tokens=n_in,
                output_tokens=n_out,
                block_ids=tuple(ids.block(namespace, h) for h in hashes),
                tail_id=ids.fresh(),
                recorded_t=t,
                api_time_s=api_s,
            )
        )
        prev_end = t + (api_s or 0.0)
    if group:
        steps.append(_join(group, prev_end, None))
        prev_end = max(end for _, _, end in group)
    first_t = raw[0]["t"] if isinstance(raw[0], dict) else 0.0
    return AgentSession(name, kind, tuple(steps), max(0.0, prev_end - first_t))


def _join(group: list[tuple[float, AgentSession, float]], prev_end: float, next_t: float | None) -> SubagentGroup:
    """Subagents start at their recorded offsets after the previous answer; the parent resumes after the last
    one ends, plus the recorded gap (0 where the trace shows the parent resuming before its last subagent
    ended: the format's parent waits for its subagents, and so does the replay)."""
    last_end = max(end for _, _, end in group)
    resume = max(0.0, next_t - last_end) if next_t is not None else 0.0
    return SubagentGroup(
        tuple(max(0.0, t - prev_end) for t, _, _ in group), tuple(agent for _, agent, _ in group), resume
    )


# -- facts -------------------------------------------------------------------------------------------------------
def session_hit_rate(session: AgentSession) -> float:
    """The session's prompt tokens an unbounded cache would hit (whole 64-token blocks, the leading run of ids
    seen before in this session, at most in - 1 tokens), over its prompt tokens; subagents in recorded order."""
    trie: dict[tuple[int, int], int] = {}  # (parent node, block id) -> node: a leading run of ids seen before
    hit = total = 0
    for r in sorted(session.requests(), key=lambda r: r.recorded_t):
        node, run, missed = 0, 0, False
        for block in r.block_ids:
            child = trie.get((node, block))
            if child is None:
                missed = True
                child = trie[(node, block)] = len(trie) + 1
            elif not missed:
                run += 1
            node = child
        hit += min(run * BLOCK_SIZE, r.input_tokens - 1)
        total += r.input_tokens
    return hit / total if total else 0.0


def describe(trace: AgentTrace) -> dict:
    """The set's facts: sessions, requests, tokens, subagents, context growth, per-session unbounded hit rate."""
    rates = sorted(session_hit_rate(s) for s in trace.sessions)
    requests = [r for s in trace.sessions for r in s.requests()]
    firsts = sorted(s.requests()[0].input_tokens for s in trace.sessions)
    lasts = sorted(max(r.input_tokens for r in s.requests()) for s in trace.sessions)
    return {
        "sessions": len(trace.sessions),
        "requests": len(requests),
        "subagents": sum(s.num_subagents() for s in trace.sessions),
        "input_tokens": sum(r.input_tokens for r in requests),
        "output_tokens": sum(r.output_tokens for r in requests),
        "max_input_tokens": max(r.input_tokens for r in requests),
        "median_first_context": _median(firsts),
        "median_largest_context": _median(lasts),
        "median_think_s": _median(sorted(r.think_s for r in requests)),
        "session_hit_rate_median": _median(rates),
        "session_hit_rate_p25": rates[len(rates) // 4] if rates else 0.0,
        "median_recorded_s": _median(sorted(s.recorded_s for s in trace.sessions)),
    }


def _median(values: Sequence[float]) -> float:
    if not values:
        return 0.0
    mid = len(values) // 2
    return values[mid] if len(values) % 2 else (values[mid - 1] + values[mid]) / 2


# -- scaling -----------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class AgentScaling:
    """How sessions are replayed on a smaller model: tokens per 64-token block, output lengths, think times."""

    tokens_per_block: int = BLOCK_SIZE
    output_scale: float | None = None  # None: as prompts (tokens_per_block / 64)
    think_scale: float = 1.0
    max_think_s: float | None = None  # a longer pause (the user away for hours) is cut to this, after scaling

    def __post_init__(self) -> None:
        if self.tokens_per_block < 1:
            raise ValueError(f"tokens_per_block must be >= 1, got {self.tokens_per_block}")
        if self.output_scale is not None and not (math.isfinite(self.output_scale) and self.output_scale > 0):
            raise ValueError(f"output_scale must be > 0, got {self.output_scale}")
        if not (math.isfinite(self.think_scale) and self.think_scale >= 0):
            raise ValueError(f"think_scale must be >= 0, got {self.think_scale}")
        if self.max_think_s is not None and not self.max_think_s >= 0:
            raise ValueError(f"max_think_s must be >= 0, got {self.max_think_s}")

    @property
    def output_factor(self) -> float:
        return self.output_scale if self.output_scale is not None else self.tokens_per_block / BLOCK_SIZE

    def describe(self) -> str:
        cap = f", pauses cut to {self.max_think_s:g} s" if self.max_think_s is not None else ""
        return (
            f"{BLOCK_SIZE}->{self.tokens_per_block} tokens/block, output x{self.output_factor:g}, "
            f"think time x{self.think_scale:g}{cap}"
        )

    def pause(self, seconds: float) -> float:
        """A recorded pause as replayed: scaled, then cut to max_think_s."""
        scaled = seconds * self.think_scale
        return scaled if self.max_think_s is None else min(scaled, self.max_think_s)

    def prompt_len(self, r: AgentRequest) -> int:
        return scaled_length(r.input_tokens, BLOCK_SIZE, self.tokens_per_block)

    def output_len(self, r: AgentRequest) -> int:
        return max(1, round(r.output_tokens * self.output_factor))


@dataclass(slots=True)
class AgentPrompt:
    """A scaled request's prompt (the bounds' BlockPrompt): full blocks, then the tail's own id."""

    prompt_len: int
    block_ids: tuple[int, ...]
    tokens_per_block: int
    mapping: BlockTokens | None = field(default=None, repr=False)

    def prompt_tokens(self) -> list[int]:
        assert self.mapping is not None
        return self.mapping.tokens(self.block_ids, self.prompt_len)


def scaled_prompt(r: AgentRequest, scaling: AgentScaling, mapping: BlockTokens | None) -> AgentPrompt:
    length = scaling.prompt_len(r)
    ids = r.block_ids if length <= len(r.block_ids) * scaling.tokens_per_block else r.block_ids + (r.tail_id,)
    return AgentPrompt(length, ids, scaling.tokens_per_block, mapping)


def token_mapping(trace: AgentTrace, scaling: AgentScaling, seed: int = 0) -> BlockTokens:
    return BlockTokens(scaling.tokens_per_block, trace.max_id, seed=seed)


def draw_sessions(trace: AgentTrace, count: int, seed: int) -> list[AgentSession]:
    """`count` sessions drawn from the set, seeded: without replacement while the set lasts, then again."""
    if count < 1:
        raise ValueError(f"the number of sessions must be >= 1, got {count}")
    rng = random.Random(seed)
    out: list[AgentSession] = []
    while len(out) < count:
        order = list(trace.sessions)
        rng.shuffle(order)
        out.extend(order[: count - len(out)])
    return out
