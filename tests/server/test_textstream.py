"""``StopMatcher``'s vLLM options: ``include_stop_str_in_output`` keeps the stop string, and a stop string counts
only where it ends past the text of the first ``min_tokens`` tokens (vLLM's detokenizer)."""

from __future__ import annotations

from kvrelay.server.textstream import StopMatcher


def _fed(matcher: StopMatcher, pieces: list[str]) -> tuple[str, bool]:
    text, sent, hit = "", "", False
    for piece in pieces:
        text += piece
        delta, hit = matcher.feed(text)
        sent += delta
        if hit:
            break
    return sent + matcher.flush(matcher.final_text(text)), hit


def test_the_stop_string_is_cut_off_or_kept():
    assert _fed(StopMatcher(["END"]), ["a b", " EN", "D c"]) == ("a b ", True)
    assert _fed(StopMatcher(["END"], include_in_output=True), ["a b", " EN", "D c"]) == ("a b END", True)


def test_a_stop_string_within_the_first_min_tokens_text_does_not_count():
    matcher = StopMatcher(["x"])
    matcher.min_end_chars = len("ax")  # the first tokens' text: "ax"
    assert matcher.feed("ax") == ("ax", False)  # the x is text here, sent as such
    delta, hit = matcher.feed("axbx")
    assert hit and matcher.final_text("axbxc") == "axb"


def test_a_stop_string_that_straddles_the_min_tokens_boundary_counts():
    matcher = StopMatcher(["xy"])
    matcher.min_end_chars = 2  # "ax" was the first tokens' text; "xy" ends at 3, past it
    matcher.feed("ax")
    assert matcher.feed("axy")[1] and matcher.final_text("axy") == "a"
