"""Two engine replicas on a real local Ray Serve, behind the ingress, driven by the official openai client.

One module-scoped Ray for both Ray tests: starting Ray and loading the weights in each replica is most of the cost.
"""

from __future__ import annotations

import socket
import threading
import time
import uuid
from collections import Counter

import httpx
import pytest

ray = pytest.importorskip("ray")
serve = pytest.importorskip("ray.serve")
openai = pytest.importorskip("openai")

from prefixkv.config import EngineConfig  # noqa: E402
from prefixkv.serve_ray import build_application  # noqa: E402
from prefixkv.serve_ray.ingress import RETRIES_HEADER, STATS_PATH  # noqa: E402
from prefixkv.serve_ray.replica import REPLICA_HEADER  # noqa: E402
from prefixkv.server.options import ServingOptions  # noqa: E402

PROMPT = "The capital of France is a city that many people visit every year, and its most famous sight is"
MODEL = None  # the served model: the one name a request may omit


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def base_url():
    port = _free_port()
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        config = EngineConfig(dtype="float32", kv_cache_tokens=4096, max_model_len=512, num_threads=1)
        serve.run(build_application(config, replicas=2, policy="precise"), name="prefixkv", route_prefix="/")
        yield f"http://127.0.0.1:{port}/v1"
    finally:
        # ray.shutdown() alone: the local cluster ray.init started here goes with every actor on it (Serve's
        # included), at once; serve.shutdown() first would drain each replica gracefully, ~10 s of waiting
        ray.shutdown()


LONG_ANSWER = 64  # tokens: ~0.5 s of decode on 2 cores, so a kill lands while requests are in flight


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


def _ingress_stats(base_url: str) -> dict:
    response = httpx.get(base_url.removesuffix("/v1") + STATS_PATH, timeout=30)
    response.raise_for_status()
    return response.json()


def test_replica_killed_under_load(base_url):
    """A replica is killed while it is serving requests: each of them is lost with it and the ingress retries it
    on the other replica, which answers it exactly as the victim would have; new requests succeed too; nothing
    hangs (the client's timeout is only a hang guard). The proof is the ingress's: each answer names the replica
    that gave it and how many replicas were lost under it, and its counters name the actor each attempt was lost
    with."""
    client = openai.OpenAI(base_url=base_url, api_key="unused", timeout=120, max_retries=0)
    # long enough answers that a request still in flight when the replica is killed is not answered first
    _, reference = _complete(client, max_tokens=LONG_ANSWER)
    prefix = "SERVE_REPLICA::prefixkv#EngineReplica#"
    names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if a["name"].startswith(prefix)]
    actors = {name.removeprefix(prefix): ray.get_actor(name, namespace="serve") for name in names}
    assert len(actors) == 2

    def ongoing() -> dict[str, int]:
        """Ray's own count of the requests each replica has accepted and not answered (its control thread
        answers while the engine decodes)."""
        return {rid: ray.get(actor.get_num_ongoing_requests.remote()) for rid, actor in actors.items()}

    deadline = time.monotonic() + 60
    while any(ongoing().values()):  # a finished request leaves the count a moment after its answer
        assert time.monotonic() < deadline, "the replicas never went idle"
        time.sleep(0.02)
    before = _ingress_stats(base_url)
    results: list[object] = []

    def send():
        try:
            raw = client.completions.with_raw_response.create(
                model=MODEL, prompt=PROMPT, max_tokens=LONG_ANSWER, temperature=0
            )
            answer = raw.parse()
            results.append((raw.headers[REPLICA_HEADER], int(raw.headers[RETRIES_HEADER]), answer.choices[0].text))
        except Exception as exc:  # noqa: BLE001 - recorded, asserted on below
            results.append(exc)

    threads = [threading.Thread(target=send) for _ in range(6)]
    for t in threads:
        t.start()
    while not any((counts := ongoing()).values()):  # kill a replica only once requests are in flight there
        assert time.monotonic() < deadline, "no request reached a replica"
        time.sleep(0.02)
    victim = max(counts, key=counts.__getitem__)
    in_flight, actor = counts[victim], actors[victim]
    victim_actor_id = actor._actor_id.hex()  # what the ingress's counters key lost attempts by
    ray.kill(actor)
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
    assert len(retried) >= 1 and in_flight >= 1, f"{in_flight} in flight on the victim when it was killed: {answers}"
    assert all(replica != victim for replica, _ in retried)  # the survivor answered every retried request
    after = _ingress_stats(base_url)
    lost = Counter(after["lost_attempts_by_replica_actor"]) - Counter(before["lost_attempts_by_replica_actor"])
    assert set(lost) == {victim_actor_id}  # every lost attempt was lost with the killed replica
    assert after["retries"] - before["retries"] == sum(retries for _, retries in retried) == lost.total()
    assert after["unanswered"] == before["unanswered"] and after["requests"] - before["requests"] == 6
    for _ in range(3):
        replica, text = _complete(client)
        assert text and replica != victim


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
    assert route_request(body, {}, tokenizer=object(), salts=TenantSalts(ServingOptions())).cache_salt is None


def test_ingress_stats_count_each_lost_attempt_and_only_the_retries_that_follow():
    """Three attempts lost with one request: three lost attempts by actor, two retries (the last loss is the 503)."""
    from ray.exceptions import RayActorError

    from prefixkv.serve_ray.ingress import MAX_ATTEMPTS, IngressStats

    stats = IngressStats()
    for attempt in range(MAX_ATTEMPTS):
        stats.lost(RayActorError(actor_id="a1" if attempt else None), attempt, "before answering")
    assert stats.as_dict() == {
        "requests": 0,
        "retries": MAX_ATTEMPTS - 1,
        "unanswered": 0,
        "streams_cut": 0,
        "lost_attempts_by_replica_actor": {"unknown": 1, "a1": MAX_ATTEMPTS - 1},
    }
