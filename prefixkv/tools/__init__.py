"""Tool calls: the tools a request offers, how they enter the prompt, the grammar that keeps a call valid, and
how a call is read back out of the answer. Shared by every API door (server/*); no torch, no HTTP."""
