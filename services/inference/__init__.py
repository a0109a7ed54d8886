"""The built-in model server: OpenAI-compatible chat completions and hidden-state extraction."""
