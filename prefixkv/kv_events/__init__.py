"""KV events on the wire: what a prefix cache stores and evicts, published over ZeroMQ as vLLM publishes it, so
routers written for vLLM (llm-d, Dynamo, Ray Serve's KV event manager, vLLM's own examples) follow prefixkv too.

- wire.py: the msgpack layouts (vLLM's current one and the older array-like one) and their decoders.
- publisher.py: the PUB socket, its sequence numbers and the ROUTER replay socket (used by the engine).
- subscriber.py: a subscriber that notices missed batches from the sequence numbers and replays them.
The events themselves are prefixkv/kvcache/events.py's.
"""
