"""`ds4 serve`: OpenAI- and Anthropic-compatible HTTP server."""
