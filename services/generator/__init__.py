"""RQ worker that asks an OpenAI-compatible server (built-in, vLLM or SGLang) for the target's replies."""
