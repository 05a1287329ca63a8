"""OpenAI-compatible HTTP server: many connections share one engine loop, so their requests batch together."""
