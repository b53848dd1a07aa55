"""Runtime: tokenizer, chat templates, engine, sampling and speculative decoding."""
