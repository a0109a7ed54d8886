"""Which assistant turns of a conversation the target writes, and what each one answers.

With ``generation.turns = "all"`` the target regenerates every assistant turn, turn by turn: turn k's
prompt is the conversation up to its k-th user turn, with the target's own replies in place of the
dataset's earlier assistant turns. The drafter then learns only text the target wrote, after contexts
the target itself produced, in every turn (a dataset's assistant turns are another model's text).

How a conversation splits into turns (``turn_segments``): a turn is a run of non-assistant messages (the
user's, with any system message) followed by a reply. The dataset's assistant messages mark where
replies go and are dropped. Two user turns with no assistant turn between them stay one turn: the
target answers them together, once, as a server answers a client that sent both. Assistant turns before
the first user turn (ShareGPT's split cuts long conversations, so a part may begin with the assistant)
answer nothing the conversation holds and are dropped. ``"last"`` keeps the conversation as it is: one
turn, earlier assistant messages as the dataset wrote them.
"""

from __future__ import annotations

Messages = list[dict]


def turn_segments(messages: Messages, mode: str) -> list[Messages]:
    """The messages each turn adds before the target's reply, in order; at least one."""
    if mode == "last":
        return [list(messages)]
    segments: list[Messages] = []
    current: Messages = []
    for message in messages:
        if message["role"] == "assistant":
            if any(m["role"] == "user" for m in current):
                segments.append(current)
                current = []
            elif not segments:
                continue  # before the first user turn: it answers nothing here
            # An assistant message right after another (no user turn between) marks no new turn.
            continue
        current.append(message)
    if current:
        segments.append(current)
    return segments
