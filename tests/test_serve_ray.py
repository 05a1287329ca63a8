"""Two engine replicas on a real local Ray Serve, behind the ingress, driven by the official openai client.

One module-scoped Ray for every Ray test: starting Ray and loading the weights in each replica is most of the cost.
The replicas take keys from a key file (each key's tenant isolated), so the cache-entry test can play two tenants.
The ingress's pure logic (cache-entry pins, listing merge) is tested without Ray at the end.
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import threading
import time
import uuid
from collections import Counter
from functools import partial
from types import SimpleNamespace
from typing import Any

import httpx
import pytest

ray = pytest.importorskip("ray")
serve = pytest.importorskip("ray.serve")
openai = pytest.importorskip("openai")

from prefixkv.config import EngineConfig  # noqa: E402
from prefixkv.serve_ray import build_application  # noqa: E402
from prefixkv.serve_ray.deployment import init_ray  # noqa: E402
from prefixkv.serve_ray.ingress import RETRIES_HEADER, STATS_PATH  # noqa: E402
from prefixkv.serve_ray.replica import REPLICA_HEADER  # noqa: E402
from prefixkv.server.options import ServingOptions  # noqa: E402

PROMPT = "The capital of France is a city that many people visit every year, and its most famous sight is"
MODEL = None  # the served model: the one name a request may omit


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


KEYS = "unused default\ntenant-a acme\ntenant-b beta\n"  # KEY TENANT: "unused" is the other tests' key


@pytest.fixture(scope="module")
def base_url(tmp_path_factory):
    keys = tmp_path_factory.mktemp("keys") / "keys"
    keys.write_text(KEYS)
    port = _free_port()
    init_ray(num_cpus=2, include_dashboard=False, log_to_driver=False)  # its workers at niceness 0
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        config = EngineConfig(dtype="float32", kv_cache_tokens=4096, max_model_len=512, num_threads=1)
        options = ServingOptions(api_key_file=str(keys))  # tenants isolated by key, none of them an admin
        app = build_application(config, replicas=2, policy="precise", app_options=options)
        serve.run(app, name="prefixkv", route_prefix="/")
        yield f"http://127.0.0.1:{port}/v1"
    finally:
        # ray.shutdown() alone: the local cluster ray.init started here goes with every actor on it (Serve's
        # included), at once; serve.shutdown() first would drain each replica gracefully, ~10 s of waiting
        ray.shutdown()


LONG_ANSWER = 64  # tokens: ~0.5 s of decode on 2 cores, so a kill lands while requests are in flight
ADMITTED_S = 0.3  # how long requests stay ongoing on a replica before it is killed: its engine has taken them
STOPPED_S = 0.5  # how long a stopped victim's last answers (sent before the stop) get to reach the router
BUSY_ANSWER = 400  # tokens (of max_model_len 512): still decoding while the router's view catches up (closed: aborted)


def _complete(client, max_tokens: int = 4):
    raw = client.completions.with_raw_response.create(model=MODEL, prompt=PROMPT, max_tokens=max_tokens, temperature=0)
    return raw.headers[REPLICA_HEADER], raw.parse().choices[0].text


def test_precise_routing_follows_the_cache(base_url):
    """Ray Serve's request router runs prefixkv's precise policy: a repeated prompt goes back to the replica
    whose KV events say it holds the prompt's pages (and hits there), and one sent elsewhere misses them as
    `routed`; distinct prompts sent at once spread over both replicas; the answers are the same whichever replica
    computed them."""
    client = openai.OpenAI(base_url=base_url, api_key="unused", timeout=120, max_retries=0)
    assert client.models.list().data[0].id  # any endpoint passes through
    first, text = _complete(client)
    for _ in range(2):
        raw = client.completions.with_raw_response.create(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0)
        answer = raw.parse()
        assert raw.headers[REPLICA_HEADER] == first and answer.choices[0].text == text
        assert answer.usage.prompt_tokens_details.cached_tokens > 0
    _routed_away_misses_are_routed(client, first)
    replicas: list[str] = []

    def send(i: int) -> None:
        prompt = f"Request {i}: " + " ".join(f"word{i}x{j}" for j in range(40))
        raw = client.completions.with_raw_response.create(model=MODEL, prompt=prompt, max_tokens=16, temperature=0)
        replicas.append(raw.headers[REPLICA_HEADER])

    threads = [threading.Thread(target=send, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=180)
    assert len(replicas) == 6 and len(set(replicas)) == 2
    stream = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0, stream=True)
    assert "".join(chunk.choices[0].text for chunk in stream if chunk.choices) == text
    with pytest.raises(openai.BadRequestError) as bad:  # the replica's own validation, passed through unchanged
        client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=-1)
    assert bad.value.body["param"] == "max_tokens"


def _routed_away_misses_are_routed(client, holder: str) -> None:
    """A request the router sends away from `holder`, the replica holding its prefix (a session pinned to the
    other replica), names that missed prefix `routed`: Router.route's count, recorded on the RouteRequest in
    choose_replicas, reached the replica with Ray's arguments. A client's own held-elsewhere header never does."""
    explain = {"explain_cache_miss": True}
    spoofed = {"x-prefixkv-held-elsewhere": "100000"}
    for _ in range(6):  # a fresh prompt per session goes to the replica caching fewer blocks: soon the other
        key = f"pin-{uuid.uuid4().hex}"
        raw = client.completions.with_raw_response.create(
            model=MODEL,
            prompt=f"[{uuid.uuid4().hex}] {PROMPT}",
            max_tokens=1,
            extra_body={**explain, "prompt_cache_key": key},
            extra_headers=spoofed,
        )
        miss = raw.parse().usage.prompt_tokens_details.model_extra["cache_miss"]
        assert miss["tokens_by_cause"].get("never_seen", 0) >= 32 and "routed" not in miss["tokens_by_cause"], miss
        if raw.headers[REPLICA_HEADER] != holder:
            break
    else:
        pytest.fail("no fresh session went to the replica not holding the prompt")
    raw = client.completions.with_raw_response.create(
        model=MODEL, prompt=PROMPT + " the tower.", max_tokens=1, extra_body={**explain, "prompt_cache_key": key}
    )
    miss = raw.parse().usage.prompt_tokens_details.model_extra["cache_miss"]
    assert raw.headers[REPLICA_HEADER] != holder  # pinned away from the prefix
    assert miss["cause"] == "routed" and miss["tokens_by_cause"]["routed"] >= 16, miss


SYSTEM = "You answer questions about the Eiffel Tower in one word. " + " ".join(
    f"Rule {i}: be brief." for i in range(6)
)


def _tenant(base_url: str, key: str) -> httpx.Client:
    return httpx.Client(base_url=base_url.removesuffix("/v1"), headers={"authorization": f"Bearer {key}"}, timeout=120)


def _one_entry_per_replica(base_url: str, client, tenant: httpx.Client) -> list[dict]:
    """Two messages entries of `tenant` (`client` its OpenAI client), one on each replica, as created (plus
    `replica` and `session`, the create's prompt_cache_key, which the replica ignores and the router pins).

    A long answer streaming on one replica makes it the busier: a fresh entry goes to the other one. The second
    stream follows the first entry's session, so the second entry goes to the first stream's replica. Each entry
    is made only once the router's own view (the ingress's stats) has the streaming replica the busier (its
    polled gauges lag: a request just answered can still count as running on the other replica for a second or
    more on a busy machine), and the placement is judged only if the router still counted the stream unanswered
    after the create (else the create may have been routed after it ended, on a tie): such a round is redone."""
    created: list[dict] = []
    while len(created) < 2:
        for _round in range(3):
            entry = _entry_beside_a_stream(base_url, client, tenant, created[0]["session"] if created else None)
            if entry is not None:
                created.append(entry)
                break
        else:
            pytest.fail("the busy stream ended before the entry was routed, three rounds in a row")
    return created


def _entry_beside_a_stream(base_url: str, client, tenant: httpx.Client, session: str | None) -> dict | None:
    """An entry made while a long stream (pinned to `session`'s replica, if given) runs on another replica; None
    when the stream ended before the router saw it the busier or before the entry was routed (inconclusive)."""
    with client.completions.with_streaming_response.create(
        model=MODEL,
        prompt=f"[{uuid.uuid4().hex}] {PROMPT}",
        max_tokens=BUSY_ANSWER,
        stream=True,
        extra_body={"ignore_eos": True} | ({"prompt_cache_key": session} if session else {}),
    ) as stream:
        # one iterator kept for the stream's life: a dropped one closes the connection, which aborts the stream
        lines = stream.iter_lines()
        next(lines)  # admitted and decoding there (streams pass through a replica chunk by chunk)
        busy = stream.headers[REPLICA_HEADER]
        view = _busier_in_the_routers_view(base_url, busy)
        if view is None:
            return None
        key = f"create-{uuid.uuid4().hex}"
        system = {"role": "system", "content": f"[{uuid.uuid4().hex}] {SYSTEM}"}
        r = tenant.post("/v1/caches", json={"messages": [system], "ttl": "600s", "prompt_cache_key": key})
        assert r.status_code == 200, r.text
        if not _sent_unanswered(_ingress_stats(base_url), busy) or "[DONE]" in next(lines, "[DONE]"):
            return None
        assert r.headers[REPLICA_HEADER] != busy, f"an entry went to the busy replica: {view}"
        return {**r.json(), "replica": r.headers[REPLICA_HEADER], "session": key}


def _busier_in_the_routers_view(base_url: str, busy: str) -> list | None:
    """Wait until every request router of the ingress (one per handle: the create goes through the plain one,
    which knows of the stream only by the replicas' polled gauges) would see `busy` more loaded than every other
    replica; their views then (None: no router counts a request unanswered on `busy` any more, the stream ended
    first)."""
    deadline = time.monotonic() + 60
    while True:
        stats = _ingress_stats(base_url)
        if not _sent_unanswered(stats, busy):
            return None
        views = stats["routers"]
        if views and all(
            len(view) == 2 and all(view[busy]["load"] > s["load"] for rid, s in view.items() if rid != busy)
            for view in views
        ):
            return views
        assert time.monotonic() < deadline, f"the routers never saw {busy} the busier: {views}"
        time.sleep(0.05)


def _sent_unanswered(stats: dict, replica: str) -> int:
    """The requests the ingress's routers sent to `replica` that have not completed, by their own record."""
    return sum(view[replica]["sent_unanswered"] for view in stats["routers"] if replica in view)


def test_cache_entries_behave_as_on_one_server(base_url):
    """/v1/caches behind the ingress, as on one server: entries made on either replica are listed once each,
    newest first, paged across both; every use (OpenAI, streamed, Anthropic, Gemini) goes to the replica holding
    the entry, even a session pinned to the other one, and hits its pages; PATCH extends it there; another tenant
    gets one server's 404 / 400; DELETE releases it, after which it is the 400 of an unknown name."""
    a, b = _tenant(base_url, "tenant-a"), _tenant(base_url, "tenant-b")
    client = openai.OpenAI(base_url=base_url, api_key="tenant-a", timeout=120, max_retries=0)
    model = client.models.list().data[0].id
    created = _one_entry_per_replica(base_url, client, a)
    entry, other = created  # on different replicas
    holder, name = entry["replica"], entry["name"]
    assert entry["usage"]["cached_tokens"] > 0

    newest_first = [e["id"] for e in sorted(created, key=lambda e: e["create_time"], reverse=True)]
    listing = a.get("/v1/caches").json()
    assert [e["id"] for e in listing["data"]] == newest_first and listing["next_page_token"] is None
    paged, params = [], {"page_size": 1}
    while True:  # one entry a page: the merged page token resumes each replica where the page stopped
        page = a.get("/v1/caches", params=params).json()
        paged += [e["id"] for e in page["data"]]
        if page["next_page_token"] is None:
            break
        params["page_token"] = page["next_page_token"]
    assert paged == newest_first
    gemini = a.get("/v1beta/cachedContents").json()
    assert [e["name"] for e in gemini["cachedContents"]] == [f"cachedContents/{i}" for i in newest_first]
    assert "nextPageToken" not in gemini
    bad = a.get("/v1/caches", params={"page_token": "not-a-token"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "page_token"

    def chat(question: str, cache: str = name, stream: bool = False, **extra):
        return client.chat.completions.with_raw_response.create(
            model=MODEL,
            messages=[{"role": "user", "content": question}],
            max_tokens=2,
            temperature=0,
            stream=stream,
            extra_body={"cached_content": cache, **extra},
        )

    # the other entry's session is pinned to the other replica, a fresh one goes where the policy says: all here
    for i, session in enumerate([other["session"], f"s-{uuid.uuid4().hex}", other["session"]]):
        raw = chat(f"Question {i}: how tall is it?", prompt_cache_key=session)
        assert raw.headers[REPLICA_HEADER] == holder
        assert raw.parse().usage.prompt_tokens_details.cached_tokens >= entry["usage"]["cached_tokens"]
    stream = chat("And how old?", stream=True)
    assert stream.headers[REPLICA_HEADER] == holder and any(c.choices for c in stream.parse())
    anthropic = {"x-api-key": "tenant-a", "anthropic-version": "2023-06-01"}
    messages = {
        "model": model,
        "max_tokens": 2,
        "messages": [{"role": "user", "content": "Hi"}],
        "cached_content": name,
    }
    r = httpx.post(base_url + "/messages", json=messages, headers=anthropic, timeout=120)
    assert r.status_code == 200 and r.headers[REPLICA_HEADER] == holder, r.text
    generate = {
        "contents": [{"role": "user", "parts": [{"text": "Hi"}]}],
        "cachedContent": f"cachedContents/{entry['id']}",
        "generationConfig": {"maxOutputTokens": 2},
    }
    r = a.post(f"/v1beta/models/{model}:generateContent", json=generate)
    assert r.status_code == 200 and r.headers[REPLICA_HEADER] == holder, r.text
    assert r.json()["usageMetadata"]["cachedContentTokenCount"] >= entry["usage"]["cached_tokens"]

    r = a.patch(f"/v1/caches/{name}", json={"ttl": "1200s"})
    assert r.status_code == 200 and r.headers[REPLICA_HEADER] == holder
    assert r.json()["expire_time"] > entry["expire_time"]

    # another tenant: one server's answers (the holder's own), whichever replica it is
    assert b.get("/v1/caches").json() == {"object": "list", "data": [], "next_page_token": None}
    for r in (b.get(f"/v1/caches/{name}"), b.delete(f"/v1/caches/{entry['id']}")):
        assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"
    tenant_b = openai.OpenAI(base_url=base_url, api_key="tenant-b", timeout=120, max_retries=0)
    with pytest.raises(openai.BadRequestError) as refused:
        tenant_b.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=2, extra_body={"cached_content": name}
        )
    assert refused.value.body["code"] == "cached_content_not_found"

    r = a.delete(f"/v1/caches/{name}")
    assert r.status_code == 200 and r.json()["deleted"] is True and r.headers[REPLICA_HEADER] == holder
    assert a.get(f"/v1/caches/{entry['id']}").status_code == 404
    for gone in (name, "caches/cache_never_made"):  # a deleted entry reads as one never made
        with pytest.raises(openai.BadRequestError) as unknown:
            chat("Still there?", cache=gone)
        assert unknown.value.body["code"] == "cached_content_not_found"
        assert unknown.value.body["param"] == "cached_content"
    assert [e["id"] for e in a.get("/v1/caches").json()["data"]] == [i for i in newest_first if i != entry["id"]]
    assert a.delete(f"/v1beta/cachedContents/{other['id']}").json() == {}  # Gemini's delete, on the same store
    assert a.get("/v1beta/cachedContents").json() == {"cachedContents": []}


def _ingress_stats(base_url: str) -> dict:
    response = httpx.get(
        base_url.removesuffix("/v1") + STATS_PATH, headers={"authorization": "Bearer unused"}, timeout=30
    )
    response.raise_for_status()
    return response.json()


def test_replicas_and_ingress_run_at_niceness_zero(base_url):
    """Ray starts workers at niceness 15, where any other load on the node starves the engine (deployment.py's
    WORKER_NICENESS has the measurement); the Ray prefixkv starts runs them at 0."""
    names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if "prefixkv#" in a["name"]]
    actors = [ray.get_actor(name, namespace="serve") for name in names]
    assert len(actors) == 3  # two engine replicas and the ingress
    assert ray.get([a.__ray_call__.remote(lambda _self: os.nice(0)) for a in actors]) == [0, 0, 0]


def test_replica_killed_under_load(base_url):
    """A replica is killed while it is serving requests: each of them is lost with it and the ingress retries it
    on the other replica, which answers it exactly as the victim would have; new requests succeed too; nothing
    hangs (the client's timeout is only a hang guard). The proof is the ingress's: each answer names the replica
    that gave it and how many replicas were lost under it, and its counters name the actor each attempt was lost
    with. A cache entry on the victim goes with it: naming it is the 400 of a name never made (not a 500), and
    the listing has only the survivor's."""
    client = openai.OpenAI(base_url=base_url, api_key="unused", timeout=120, max_retries=0)
    # long enough answers that a request still in flight when the replica is killed is not answered first
    _, reference = _complete(client, max_tokens=LONG_ANSWER)
    tenant = _tenant(base_url, "unused")
    entries = _one_entry_per_replica(base_url, client, tenant)  # the victim's goes with it
    prefix = "SERVE_REPLICA::prefixkv#EngineReplica#"
    names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if a["name"].startswith(prefix)]
    actors = {name.removeprefix(prefix): ray.get_actor(name, namespace="serve") for name in names}
    assert len(actors) == 2
    pids = {rid: ray.get(actor.__ray_call__.remote(lambda _replica: os.getpid())) for rid, actor in actors.items()}

    def ongoing() -> dict[str, int]:
        """Ray's own count of the requests each replica has accepted and not answered (its control thread
        answers while the engine decodes)."""
        return {rid: ray.get(actor.get_num_ongoing_requests.remote()) for rid, actor in actors.items()}

    def idle() -> None:
        deadline = time.monotonic() + 60
        while any(ongoing().values()):  # a finished request leaves the count a moment after its answer
            assert time.monotonic() < deadline, "the replicas never went idle"
            time.sleep(0.02)

    def send(results: list[object]) -> None:
        try:
            raw = client.completions.with_raw_response.create(
                model=MODEL, prompt=PROMPT, max_tokens=LONG_ANSWER, temperature=0
            )
            answer = raw.parse()
            results.append((raw.headers[REPLICA_HEADER], int(raw.headers[RETRIES_HEADER]), answer.choices[0].text))
        except Exception as exc:  # noqa: BLE001 - recorded, asserted on below
            results.append(exc)

    # Kill a replica only once requests are in flight there, and still there a moment later (Ray counts a request
    # as ongoing on a replica before its engine has taken it). The victim is stopped first (SIGSTOP: it can answer
    # nothing more), then the router's own record says whether a request it sent there is still unanswered: one
    # is then lost with the kill, whatever the machine's load. Where none is (the victim answered them all in the
    # moment between the count and the stop), it is resumed and the round is sent again.
    for _attempt in range(3):
        idle()
        before = _ingress_stats(base_url)
        results: list[object] = []
        threads = [threading.Thread(target=send, args=(results,)) for _ in range(6)]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 60
        while True:
            assert time.monotonic() < deadline, "no request reached a replica"
            if any(ongoing().values()):
                time.sleep(ADMITTED_S)
                if any((counts := ongoing()).values()):
                    break
            time.sleep(0.02)
        victim = max(counts, key=counts.__getitem__)
        os.kill(pids[victim], signal.SIGSTOP)
        time.sleep(STOPPED_S)  # an answer it sent just before the stop reaches the router meanwhile
        in_flight = _sent_unanswered(_ingress_stats(base_url), victim)
        if in_flight:
            break
        os.kill(pids[victim], signal.SIGCONT)
        for t in threads:
            t.join(timeout=180)
    else:
        pytest.fail("the victim had answered every request before it was stopped, three rounds in a row")
    victim_actor_id = actors[victim]._actor_id.hex()  # what the ingress's counters key lost attempts by
    os.kill(pids[victim], signal.SIGKILL)  # at once (ray.kill is asynchronous)
    for t in threads:
        t.join(timeout=180)
    assert not any(t.is_alive() for t in threads)
    failures = [r for r in results if isinstance(r, Exception)]
    assert not failures, failures
    assert len(results) == 6
    answers: list[tuple[str, int, str]] = results  # type: ignore[assignment]
    assert all(text == reference for _, _, text in answers)  # greedy: the same text whichever replica answered
    retried = [(replica, retries) for replica, retries, _ in answers if retries]
    # at least one request the victim held was lost with it and retried; which ones is the ingress's count below.
    # (Ray's ongoing count is not that set: a run saw 4 "ongoing" on the victim, 2 lost and retried and the other
    # 2 answered by the survivor without a retry, so Ray had moved them itself.)
    assert len(retried) >= 1 and in_flight >= 1, f"{in_flight} in flight on {victim} when it was killed: {answers}"
    assert all(replica != victim for replica, _ in retried)  # the survivor answered every retried request
    after = _ingress_stats(base_url)
    lost = Counter(after["lost_attempts_by_replica_actor"]) - Counter(before["lost_attempts_by_replica_actor"])
    assert set(lost) == {victim_actor_id}  # every lost attempt was lost with the killed replica
    assert after["retries"] - before["retries"] == sum(retries for _, retries in retried) == lost.total()
    assert after["unanswered"] == before["unanswered"] and after["requests"] - before["requests"] == 6
    for _ in range(3):
        replica, text = _complete(client)
        assert text and replica != victim
    died, kept = sorted(entries, key=lambda e: e["replica"] != victim)
    with pytest.raises(openai.BadRequestError) as gone:  # as a name never made: a 400, not a 500
        client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "Hi"}],
            max_tokens=1,
            extra_body={"cached_content": died["name"]},
        )
    assert gone.value.body["code"] == "cached_content_not_found"
    assert tenant.get(f"/v1/caches/{died['id']}").status_code == 404
    assert [e["id"] for e in tenant.get("/v1/caches").json()["data"]] == [kept["id"]]


def test_route_request_tokens_and_session_key():
    """The ingress routes on the prompt the replica will see (a chat after its template) and the session key."""
    from prefixkv.serve_ray.ingress import route_request, routing_tokenizer

    tokenizer = routing_tokenizer(None)
    body = b'{"prompt": "Hello there", "prompt_cache_key": "conv-1"}'
    route = route_request(body, {}, tokenizer)
    assert list(route.token_ids) == tokenizer.encode("Hello there") and route.session_key == "conv-1"
    messages = [{"role": "user", "content": "Hi"}]
    chat = route_request(b'{"messages": [{"role": "user", "content": "Hi"}]}', {"x-session-id": "s"}, tokenizer)
    assert list(chat.token_ids) == tokenizer.encode(tokenizer.apply_chat_template(messages))
    assert chat.session_key == "s"
    assert route_request(b"not json", {}, tokenizer).token_ids == []  # the replica answers it with a 400


def test_route_request_keys_tenants_apart(tmp_path):
    """With tenant isolation the router keys a prompt with the salt the replica will give it: two tenants'
    equal prompts never share block hashes; two keys of one tenant do."""
    from prefixkv.serve_ray.ingress import TenantSalts, route_request
    from prefixkv.server.auth import Principal, derive_cache_salt

    keys = tmp_path / "keys"
    keys.write_text("k1 acme\nk2 acme\nk3 beta\n")
    salts = TenantSalts(ServingOptions(api_key_file=str(keys)))
    body = b'{"prompt": [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17]}'
    routes = [
        route_request(body, {"authorization": f"Bearer {k}"}, tokenizer=object(), salts=salts)
        for k in ("k1", "k2", "k3")
    ]
    assert routes[0].cache_salt == derive_cache_salt("api-key", Principal("acme", "user"), "k1", None, None)
    assert routes[0].block_hashes(16) == routes[1].block_hashes(16) != routes[2].block_hashes(16)
    for header in ("x-api-key", "x-goog-api-key"):  # Anthropic's and Gemini's clients send the key so
        assert route_request(body, {header: "k1"}, tokenizer=object(), salts=salts).cache_salt == routes[0].cache_salt
    assert route_request(body, {}, tokenizer=object(), salts=TenantSalts(ServingOptions())).cache_salt is None


def test_ingress_stats_count_each_lost_attempt_and_only_the_retries_that_follow():
    """Three attempts lost with one request: three lost attempts by actor, two retries (the last loss is the 503)."""
    from ray.exceptions import RayActorError

    from prefixkv.serve_ray.ingress import MAX_ATTEMPTS, IngressStats

    stats = IngressStats()
    for attempt in range(MAX_ATTEMPTS):
        stats.lost(RayActorError(actor_id="a1") if attempt else RayActorError(), attempt, "before answering")
    assert stats.as_dict() == {
        "requests": 0,
        "retries": MAX_ATTEMPTS - 1,
        "unanswered": 0,
        "streams_cut": 0,
        "lost_attempts_by_replica_actor": {"unknown": 1, "a1": MAX_ATTEMPTS - 1},
    }


# -- the ingress's cache-entry logic, without Ray ---------------------------------------------------------------


def test_cache_calls_are_recognised_on_every_api():
    from prefixkv.serve_ray.cache_entries import CacheCall, cache_call

    assert cache_call("POST", "/v1/caches", {"prompt": "x"}) == CacheCall("create", "openai")
    assert cache_call("get", "/v1beta/cachedContents", None) == CacheCall("list", "gemini")
    assert cache_call("PATCH", "/v1/caches/caches/cache_1", {}) == CacheCall("entry", "openai", "cache_1")
    assert cache_call("DELETE", "/v1beta/cachedContents/cache_2", None) == CacheCall("entry", "gemini", "cache_2")
    assert cache_call("POST", "/v1/caches/cache_1", {}) is None  # no such route: any replica answers it
    assert cache_call("POST", "/v1/chat/completions", {"cached_content": "caches/cache_3"}) == CacheCall(
        "use", entry_id="cache_3"
    )
    gemini_count = {"generateContentRequest": {"cachedContent": "cachedContents/cache_4"}}
    assert cache_call("POST", "/v1beta/models/m:countTokens", gemini_count) == CacheCall("use", entry_id="cache_4")
    assert cache_call("POST", "/v1/completions", {"cached_content": 5}) is None  # the replica's 400/422
    assert cache_call("GET", "/v1/models", None) is None


def test_entry_pins_are_bounded_and_keep_only_recent_prefixes():
    from prefixkv.serve_ray.cache_entries import EntryPins, EntryPrefix, created_entry_id, entry_prefix

    pins = EntryPins(max_entries=2, max_prefixes=1)
    prompt = entry_prefix({"prompt": "Hello"}, [7, 8])
    assert prompt == EntryPrefix("prompt", token_ids=(7, 8)) and entry_prefix({"prompt": "Hello"}, []) is None
    pins.pin("e1", "r1", prompt)
    pins.pin("e2", "r2", entry_prefix({"messages": [{"role": "system", "content": "S"}]}, [1]))
    assert pins.prefix("e1") is None and pins.prefix("e2").kind == "messages"  # type: ignore[union-attr]
    assert pins.replica("e1") == "r1"  # now the most recent: e2 is dropped next
    pins.pin("e3", "r1")
    assert (pins.replica("e2"), pins.replica("e3"), len(pins)) == (None, "r1", 2)
    pins.unpin("e3")
    assert pins.replica("e3") is None
    assert created_entry_id("gemini", b'{"name": "cachedContents/cache_9"}') == "cache_9"
    assert created_entry_id("openai", b"not json") is None


def test_a_use_routes_on_the_entry_prefix_and_its_own_prompt():
    from prefixkv.serve_ray.cache_entries import EntryPrefix
    from prefixkv.serve_ray.ingress import route_request

    tokenizer = SimpleNamespace(encode=lambda text: [len(w) for w in text.split()], apply_chat_template=repr)
    prompt = route_request(b'{"prompt": "ab c"}', {}, tokenizer, prefix=EntryPrefix("prompt", token_ids=(9, 9)))
    assert list(prompt.token_ids) == [9, 9, 2, 1]
    system, user = {"role": "system", "content": "S"}, {"role": "user", "content": "U"}
    chat = route_request(
        b'{"messages": [%s]}' % repr(user).replace("'", '"').encode(),
        {},
        tokenizer,
        prefix=EntryPrefix("messages", messages=(system,)),
    )
    assert list(chat.token_ids) == tokenizer.encode(repr([system, user]))


def _replica_store(rid: str, times: list[tuple[int, int]]) -> list[dict]:
    """A replica's entries, newest first as it lists them: seq, create time (seconds), id."""
    return [{"seq": s, "create_time": f"2026-01-01T00:00:{t:02d}.000000Z", "id": f"{rid}-{t}"} for s, t in times]


def _fake_listing(stores: dict[str, list[dict]], gone: set[str]):
    """A replica's GET /v1/caches as caches.py answers it: entries before the token's seq, newest first, each
    row's token in the header; a gone replica answers None (another replica answered for it)."""
    from prefixkv.serve_ray.cache_entries import ReplicaPage

    async def fetch(rid: str, token: str | None, size: int):
        if rid in gone:
            return None
        rows = [e for e in stores[rid] if token is None or e["seq"] < int(token)]
        page = rows[:size]
        body = [{k: e[k] for k in ("id", "create_time")} for e in page]
        return ReplicaPage(token, body, [str(e["seq"]) for e in page], len(rows) > size)

    return fetch


def test_merged_listing_pages_like_one_server_while_entries_change():
    """Pages of 2 over two replicas' entries, interleaved in time: every entry once, newest first; an entry deleted
    after being listed does not shift the next page (the token is a position, not a count), one created after the
    first page is not in the later ones (as on one server), and a replica that died is skipped."""
    from prefixkv.serve_ray.cache_entries import (
        decode_cursor,
        gather_pages,
        list_query,
        listing_body,
        merge_pages,
    )

    stores = {
        "r1": _replica_store("r1", [(4, 9), (3, 6), (2, 5), (1, 1)]),
        "r2": _replica_store("r2", [(3, 8), (2, 7), (1, 2)]),
    }
    gone: set[str] = set()

    def page(params: dict) -> dict:
        query = list_query("openai", params)
        assert query is not None
        start = query.cursor if query.cursor is not None else dict.fromkeys(stores)
        pages, refused = asyncio.run(gather_pages(start, partial(_fake_listing(stores, gone), size=query.size)))
        assert not refused
        return listing_body("openai", *merge_pages("openai", pages, query.size))

    first = page({"page_size": "2"})
    assert [e["id"] for e in first["data"]] == ["r1-9", "r2-8"]
    stores["r1"] = [e for e in stores["r1"] if e["id"] != "r1-9"]  # deleted after it was listed
    stores["r2"].insert(0, {"seq": 4, "create_time": "2026-01-01T00:00:10.000000Z", "id": "r2-10"})  # made now
    second = page({"page_size": "2", "page_token": first["next_page_token"]})
    assert [e["id"] for e in second["data"]] == ["r2-7", "r1-6"]
    gone.add("r2")
    third = page({"page_size": "2", "page_token": second["next_page_token"]})
    assert [e["id"] for e in third["data"]] == ["r1-5", "r1-1"] and third["next_page_token"] is None
    assert decode_cursor(second["next_page_token"]) == {"r1": "3", "r2": "2"}
    rows, cursor = merge_pages("openai", {}, 5)
    assert listing_body("gemini", rows, cursor) == {"cachedContents": []}


def test_list_queries_one_server_would_refuse_are_left_to_a_replica():
    from prefixkv.serve_ray.cache_entries import encode_cursor, list_query, replica_page

    assert list_query("openai", {}) is not None and list_query("openai", {}).size == 100  # type: ignore[union-attr]
    assert list_query("gemini", {"pageSize": "0", "pageToken": ""}).size == 100  # type: ignore[union-attr]
    assert list_query("gemini", {"pageSize": "5000"}).size == 1000  # type: ignore[union-attr]
    token = encode_cursor({"r1": None, "r2": "7"})
    assert list_query("openai", {"page_token": token}).cursor == {"r1": None, "r2": "7"}  # type: ignore[union-attr]
    for params in (
        {"page_size": "0"},
        {"page_size": "x"},
        {"page_token": "12"},
        {"page_token": ""},
        {"page_token": token[:-3] + "@@@"},
        {"page_token": encode_cursor({"r1": "x"})},
    ):
        assert list_query("openai", params) is None, params
    assert list_query("gemini", {"pageSize": "-1"}) is None
    with pytest.raises(ValueError, match="page token per row"):
        replica_page("openai", None, b'{"data": [{"id": "a"}], "next_page_token": null}', None)


class _FakeReplicas:
    """What the ingress's DeploymentHandle does for it, without Ray: the request router sends a call to its target
    while that replica lives (else to the first), and records the live replicas on the call's RouteRequest."""

    def __init__(self, stores: dict[str, set[str]]) -> None:
        self.stores = stores
        self.calls: Counter[str] = Counter()

    def __getattr__(self, method: str):
        return SimpleNamespace(remote=partial(self._call, method))

    async def _call(self, method: str, route, *args):
        self.calls[method] += 1
        route.live_replicas = tuple(sorted(self.stores))
        rid = route.target_replica if route.target_replica in self.stores else route.live_replicas[0]
        return rid if method == "identify" else (rid, args[0] in self.stores[rid])


def test_the_ingress_finds_an_entry_it_never_saw_created():
    """After an ingress restart its pins are gone: the replicas are asked once, and the answer is pinned."""
    from prefixkv.serve_ray.cache_entries import EntryPins
    from prefixkv.serve_ray.ingress import Ingress, IngressStats

    cls: Any = Ingress.func_or_class  # type: ignore[attr-defined]  # the class under serve.deployment
    replicas = _FakeReplicas({"r1": set(), "r2": {"cache_b"}})
    ingress = SimpleNamespace(pins=EntryPins(), _live=(), _replicas=replicas, stats=IngressStats())
    ingress._saw = partial(cls._saw, ingress)
    ingress._live_replicas = partial(cls._live_replicas, ingress)
    assert asyncio.run(cls._holder(ingress, "cache_b")) == "r2"
    assert replicas.calls == {"identify": 1, "holds_cache_entry": 2}
    assert asyncio.run(cls._holder(ingress, "cache_b")) == "r2" and replicas.calls["holds_cache_entry"] == 2
    assert asyncio.run(cls._holder(ingress, "cache_unknown")) is None  # routed as any request: 'not found'


def test_a_replica_passes_a_stream_on_as_the_app_sends_it():
    """The in-process call yields each chunk as the app sends it (the app sends its second only once the first
    has reached the caller), and closing it early tells the app its client went away."""
    from starlette.applications import Starlette
    from starlette.responses import StreamingResponse
    from starlette.routing import Route

    from prefixkv.serve_ray.in_process import call_app, call_app_whole

    first_read, app_stopped = asyncio.Event(), asyncio.Event()

    async def chunks():
        try:
            yield b"first"
            await first_read.wait()  # a transport that buffered the body would wait here for ever
            yield b"second"
            await asyncio.Event().wait()  # a generation that would go on: only a disconnect ends it
        finally:
            app_stopped.set()

    app = Starlette(routes=[Route("/s", lambda r: StreamingResponse(chunks(), status_code=201), methods=["POST"])])

    async def drive() -> list:
        seen: list = []
        answer = call_app(app, "POST", "/s?x=1", [("content-type", "text/plain")], b"body")
        async for part in answer:
            seen.append(part)
            if part == b"first":
                first_read.set()
            if part == b"second":
                break
        await answer.aclose()
        await asyncio.wait_for(app_stopped.wait(), 10)
        return seen

    seen = asyncio.run(asyncio.wait_for(drive(), 30))  # buffered, it would time out here
    assert seen[0][0] == 201 and seen[1:] == [b"first", b"second"]
    app.router.routes.append(Route("/whole", lambda request: StreamingResponse(iter([b"a", b"b"])), methods=["GET"]))
    status, _, body = asyncio.run(call_app_whole(app, "GET", "/whole", [], b""))
    assert (status, body) == (200, b"ab")
