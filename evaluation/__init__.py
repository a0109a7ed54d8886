"""Evaluation: the acceptance length an exported drafter gets against its target, beside the baselines it must
beat (no drafter, prompt lookup), on the run's held-out conversations and HumanEval (``evaluate``, ``evalsets``,
``eval_pool``); speculative decoding as engines do it (``speculative``, ``speculative_batch``, ``lookup``); and the
same export served by a real vLLM, its own count beside ours (``engine_acceptance``, ``vllm_launch``)."""
