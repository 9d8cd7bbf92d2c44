"""What the window talks to: the local engine on a worker thread, or an OpenAI-compatible server and its /metrics."""
