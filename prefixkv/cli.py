"""prefixkv generate | chat | serve | bench | cache-tree | cache | simulate | checkpoint"""

from __future__ import annotations

import argparse
import importlib
import sys

from prefixkv.bench.registry import register_bench
from prefixkv.engine_args import add_engine_args, engine_kwargs
from prefixkv.model.shapes import register as register_checkpoint
from prefixkv.server.cache_cli import register as register_cache
from prefixkv.server.cli import register as register_serve
from prefixkv.server.cli import serve
from prefixkv.sim import command as simulate_command
from prefixkv.sim.session_command import register_sessions


def _sampling(args):
    from prefixkv.sampling_params import SamplingParams

    return SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature)  # unseeded: --seed seeds the engine


def cmd_generate(args) -> int:
    from prefixkv.llm import LLM

    llm = LLM(**engine_kwargs(args))
    params = _sampling(args)
    if args.raw:
        outs = llm.generate(args.prompt, params, use_tqdm=False)
    else:
        outs = llm.chat([{"role": "user", "content": args.prompt}], params, use_tqdm=False)
    print(outs[0].outputs[0].text)
    return 0


def cmd_chat(args) -> int:
    """An interactive loop that streams tokens and keeps the conversation (each turn hits the cache)."""
    from prefixkv.llm import LLM

    llm = LLM(**engine_kwargs(args))
    engine, tok = llm.llm_engine, llm.get_tokenizer()
    messages = [{"role": "system", "content": args.system}] if args.system else []
    print("prefixkv chat: empty line or Ctrl-D to quit", file=sys.stderr)
    while True:
        try:
            line = input("> ")
        except EOFError:
            break
        if not line.strip():
            break
        messages.append({"role": "user", "content": line})
        rid = engine.add_request(None, tok.encode_chat(messages), _sampling(args))
        shown, final = "", None
        while final is None:
            for out in engine.step():
                if out.request_id != rid:
                    continue
                text = out.outputs[0].text
                print(text[len(shown) :], end="", flush=True)
                shown = text
                if out.finished:
                    final = out
        print()
        if args.show_cache:
            print(f"[cached prompt tokens: {final.num_cached_tokens}/{len(final.prompt_token_ids)}]", file=sys.stderr)
        messages.append({"role": "assistant", "content": shown})
    return 0


def cmd_cache_tree(args) -> int:
    """Print the top of a radix tree: a running server's (--url), or one built by replaying prompts (one per
    line of --prompts-file, or a built-in demo)."""
    if args.url:
        import httpx

        headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
        r = httpx.get(args.url.rstrip("/") + "/cache/tree", params={"depth": args.depth}, headers=headers)
        if r.status_code != 200:
            raise ValueError(f"{args.url} answered {r.status_code}: {r.text}")
        print(r.text)
        return 0
    from prefixkv.llm import LLM
    from prefixkv.sampling_params import SamplingParams

    kwargs = engine_kwargs(args)
    kwargs["prefix_cache"] = "radix"
    llm = LLM(**kwargs)
    if args.prompts_file:
        with open(args.prompts_file) as f:
            prompts = [line.rstrip("\n") for line in f if line.strip()]
    else:
        system = "You are a careful assistant for a travel agency. Answer briefly."
        prompts = [
            llm.get_tokenizer().apply_chat_template(
                [{"role": "system", "content": system}, {"role": "user", "content": q}], add_generation_prompt=True
            )
            for q in ("Best month for Lisbon?", "Is Kyoto crowded in April?", "Cheap flights to Oslo?")
        ]
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens)
    for prompt in prompts:  # one by one, as a conversation log replays: later prompts hit earlier ones
        llm.generate(prompt, params, use_tqdm=False)
    print(llm.render_cache_tree(max_depth=args.depth))
    return 0


# `simulate fit` and `simulate validate` run the model, so they live in prefixkv.bench (prefixkv.sim never imports it)
SIMULATE_MODEL_COMMANDS = {"fit": "prefixkv.bench.sim_fit", "validate": "prefixkv.bench.sim_validate"}


def register_simulate(sub) -> None:
    """`simulate` (one run) with its subcommands: sweep, and fit / validate where their modules are present."""
    parser = simulate_command.register(sub)
    simulate_sub = parser.add_subparsers(dest="simulate_command", metavar="{sweep,sessions,fit,validate}")
    simulate_command.register_sweep(simulate_sub)
    register_sessions(simulate_sub)
    for name, module_name in SIMULATE_MODEL_COMMANDS.items():
        try:
            module = importlib.import_module(module_name)
        except ImportError:
            continue
        doc = (module.__doc__ or "").strip().splitlines()
        p = simulate_sub.add_parser(name, help=doc[0] if doc else None, description=module.__doc__)
        module.add_arguments(p)
        p.set_defaults(func=module.run)


def cmd_serve(args) -> int:
    """`prefixkv serve`: one process, or with --replicas above 1 the engines as Ray Serve replicas."""
    if args.replicas > 1:
        from prefixkv.serve_ray.cli import serve_replicas  # imports Ray: only when asked for

        return serve_replicas(args)
    return serve(args)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="prefixkv", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="complete one prompt and print the answer")
    g.add_argument("prompt")
    g.add_argument("--raw", action="store_true", help="send the prompt as is, without the chat template")
    g.add_argument("--max-tokens", type=int, default=64)
    g.add_argument("--temperature", type=float, default=0.0)
    add_engine_args(g)
    g.set_defaults(func=cmd_generate)

    c = sub.add_parser("chat", help="interactive chat that streams tokens")
    c.add_argument("--system", default=None, help="system prompt")
    c.add_argument("--max-tokens", type=int, default=256)
    c.add_argument("--temperature", type=float, default=0.0)
    c.add_argument("--show-cache", action="store_true", help="print cached prompt tokens after each turn")
    add_engine_args(c)
    c.set_defaults(func=cmd_chat)

    t = sub.add_parser("cache-tree", help="replay prompts through the radix cache and print its tree")
    t.add_argument("--prompts-file", default=None)
    t.add_argument("--url", default=None, help="a running `prefixkv serve --prefix-cache radix` to ask instead")
    t.add_argument("--api-key", default=None)
    t.add_argument("--max-tokens", type=int, default=8)
    t.add_argument("--depth", type=int, default=3)
    add_engine_args(t)
    t.set_defaults(func=cmd_cache_tree)

    register_cache(sub)
    register_serve(sub).set_defaults(func=cmd_serve)
    register_bench(sub)
    register_simulate(sub)
    register_checkpoint(sub)

    args = parser.parse_args(argv)
    try:
        return args.func(args) or 0
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
