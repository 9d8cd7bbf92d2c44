"""`main.py serve`: an OpenAI-compatible HTTP server over the continuous-batching scheduler (never imports app)."""
