"""Grammar-constrained decoding: a request's StructuredOutputs as a token mask per step (llguidance)."""
