"""The trainer service: EAGLE-3 drafter model, training loop, export for vLLM/SGLang, evaluation."""
