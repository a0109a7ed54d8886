"""RQ worker that tokenizes prompt + reply with the chat template and has the built-in server write hidden states."""
