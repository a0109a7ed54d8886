from services.inference.reasoning import split_reasoning


def test_text_before_think_close_is_reasoning_and_the_rest_is_content():
    assert split_reasoning("<think>plan it</think>The answer.", enabled=True) == ("plan it", "The answer.")


def test_reasoning_without_a_leading_think_open_is_still_split():
    # Templates that put "<think>" in the generation prompt leave only the close in the reply.
    assert split_reasoning("step one\n</think>\n\nDone", enabled=True) == ("step one\n", "\n\nDone")


def test_split_keeps_whitespace_so_the_reply_renders_back_exactly():
    reply = "<think>\n a \n</think>\n b "
    reasoning, content = split_reasoning(reply, enabled=True)
    assert "<think>" + reasoning + "</think>" + content == reply


def test_only_the_first_think_close_splits():
    assert split_reasoning("a</think>b</think>c", enabled=True) == ("a", "b</think>c")


def test_reply_cut_off_while_thinking_is_all_reasoning():
    assert split_reasoning("<think>still going", enabled=True) == ("still going", "")


def test_reply_without_markers_is_all_content():
    assert split_reasoning("plain answer", enabled=True) == (None, "plain answer")


def test_tokenizer_without_think_close_never_splits():
    assert split_reasoning("<think>x</think>y", enabled=False) == (None, "<think>x</think>y")
