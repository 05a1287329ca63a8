"""`prefixkv cache list | create | get | extend | delete --url URL`: a running server's /v1/caches, printed as JSON.

A thin client (httpx, no engine): what a script or an operator types instead of curl. An answer that is not a
success raises ValueError with the server's status and body, which the CLI prints as its error (exit 2).
"""

from __future__ import annotations

import argparse
import json
from typing import Any


def register(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("cache", help="list, create, get, extend or delete a running server's cache entries")
    actions = p.add_subparsers(dest="cache_command", required=True, metavar="{list,create,get,extend,delete}")

    def action(name: str, help: str) -> argparse.ArgumentParser:
        a = actions.add_parser(name, help=help)
        a.add_argument("--url", required=True, help="the server, e.g. http://127.0.0.1:8000")
        a.add_argument("--api-key", default=None)
        a.set_defaults(func=run)
        return a

    action("list", "every entry the key may see, newest first")
    create = action("create", "compute a prefix and keep it retained until its expiry")
    what = create.add_mutually_exclusive_group(required=True)
    what.add_argument("--prompt", help="a text prompt (an entry for /v1/completions)")
    what.add_argument("--messages", help="chat messages as JSON (an entry for the chat routes)")
    what.add_argument("--messages-file", metavar="PATH", help="chat messages as a JSON file")
    create.add_argument("--display-name", default=None)
    create.add_argument("--cache-salt", default=None)
    named = {
        name: action(name, help)
        for name, help in (("get", "one entry"), ("extend", "set a new expiry"), ("delete", "delete it now"))
    }
    for a in named.values():
        a.add_argument("id", help="the entry's id or name (cache_... or caches/cache_...)")
    for a in (create, named["extend"]):
        when = a.add_mutually_exclusive_group(required=a is not create)
        when.add_argument("--ttl", help="a duration such as 3600s (create's default: 3600s)")
        when.add_argument("--expire-time", help="an RFC 3339 time, e.g. 2026-12-02T00:00:00Z")
    return p


def run(args) -> int:
    import httpx

    base = args.url.rstrip("/") + "/v1/caches"
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    with httpx.Client(headers=headers, timeout=600) as client:
        if args.cache_command == "list":
            rows: list[Any] = []
            params: dict[str, Any] = {"page_size": 1000}
            while True:
                page = _ok(client.get(base, params=params))
                rows.extend(page["data"])
                if not page.get("next_page_token"):
                    break
                params["page_token"] = page["next_page_token"]
            out: Any = {"object": "list", "data": rows}
        elif args.cache_command == "create":
            out = _ok(client.post(base, json=_create_body(args)))
        elif args.cache_command == "get":
            out = _ok(client.get(f"{base}/{args.id}"))
        elif args.cache_command == "extend":
            out = _ok(client.patch(f"{base}/{args.id}", json=_expiry(args)))
        else:
            out = _ok(client.delete(f"{base}/{args.id}"))
    print(json.dumps(out, indent=2))
    return 0


def _create_body(args) -> dict:
    body: dict[str, Any] = {"display_name": args.display_name, "cache_salt": args.cache_salt, **_expiry(args)}
    if args.prompt is not None:
        body["prompt"] = args.prompt
    else:
        text = args.messages
        if args.messages_file is not None:
            with open(args.messages_file, encoding="utf-8") as f:
                text = f.read()
        try:
            body["messages"] = json.loads(text)
        except ValueError as exc:
            raise ValueError(f"--messages is not JSON: {exc}") from None
    return {k: v for k, v in body.items() if v is not None}


def _expiry(args) -> dict:
    if args.ttl is not None:
        return {"ttl": args.ttl}
    return {"expire_time": args.expire_time} if args.expire_time is not None else {}


def _ok(response) -> Any:
    if response.status_code >= 300:
        raise ValueError(f"{response.request.url} answered {response.status_code}: {response.text}")
    return response.json()
