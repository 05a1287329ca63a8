"""Two questions behind one long system prompt: the second reuses the first one's KV."""
from prefixkv import LLM, SamplingParams

llm = LLM(num_threads=2)
system = ("You are the help desk of a small public library. Opening hours are 9 to 18 on weekdays and 10 to 14 on "
          "Saturdays. Members may borrow ten books for three weeks and renew twice online. ") * 12
params = SamplingParams(temperature=0, max_tokens=32)
for question in ("Can I renew a book online?", "When are you open on Saturday?"):
    out = llm.chat([{"role": "system", "content": system}, {"role": "user", "content": question}], params,
                   use_tqdm=False)[0]
    m = out.metrics
    print(f"Q: {question}\nA: {out.outputs[0].text.strip()}")
    print(f"   prompt {len(out.prompt_token_ids)} tokens, {out.num_cached_tokens} from the prefix cache, "
          f"time to first token {1000 * m.ttft:.0f} ms\n")
stats = llm.llm_engine.get_stats()
print(f"prefix cache hit rate: {stats.prefix_cache_hit_rate:.0%}")
