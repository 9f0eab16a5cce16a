"""Output registry, prompt splicing, the namespaced span catalog and stop strings (no server process)."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from kvrelay.cache.store import KVStore
from kvrelay.errors import StoreFullError
from kvrelay.server.catalog import MatchConfig, SpanCatalog
from kvrelay.server.prompting import chat_ids, completion_ids
from kvrelay.server.registry import OutputRegistry, RegisteredOutput
from kvrelay.server.textstream import StopMatcher
from tests.helpers import tiny_lm
from tests.retained import MAX_BOUNDED_BYTES_PER_CALL, retained_bytes_per_call

ANSWER = "The answer is 42 because six times seven."


def out(text: str, span: str = "s1", ns: str = "", ids=(1, 2, 3, 4, 5)) -> RegisteredOutput:
    return RegisteredOutput(text, tuple(ids), span, 10, ns)


def test_registry_finds_texts_at_their_offsets_longest_first():
    reg = OutputRegistry()
    a, b = out(ANSWER, "a"), out(ANSWER + " Really sure.", "b")
    reg.add(a)
    reg.add(b)
    content = "Solution:\n" + ANSWER + " Really sure.\nOther: " + ANSWER
    hits = reg.find(content)
    assert [(h.start, h.end, h.output.span_id) for h in hits] == [
        (10, 10 + len(b.text), "b"), (len(content) - len(ANSWER), len(content), "a")]


def test_registry_skips_short_texts_other_namespaces_and_evicted_spans():
    reg = OutputRegistry()
    assert not reg.add(out("Yes."))
    assert not reg.add(out(ANSWER, ids=(1, 2)))  # too few tokens to be worth a splice
    reg.add(out(ANSWER, "a", ns="t1"))
    assert reg.find(ANSWER, "t2") == [] and len(reg.find(ANSWER, "t1")) == 1
    reg.remove_span("a")
    assert reg.find(ANSWER, "t1") == [] and len(reg) == 0


def test_registry_newest_registration_of_a_text_wins():
    reg = OutputRegistry()
    reg.add(out(ANSWER, "old"))
    reg.add(out(ANSWER, "new"))
    assert [h.output.span_id for h in reg.find(ANSWER)] == ["new"]
    reg.remove_span("old")  # evicting the old span leaves the new registration
    assert [h.output.span_id for h in reg.find(ANSWER)] == ["new"]


def test_chat_ids_splice_generated_ids_for_the_quoted_text():
    lm = tiny_lm()
    tok = lm.tokenizer
    generated = tok.encode(ANSWER)[::-1]  # ids that are not the re-tokenization of the text
    reg = OutputRegistry()
    reg.add(RegisteredOutput(ANSWER, tuple(generated), "s", 7))
    messages = [{"role": "user", "content": f"Check this: {ANSWER} Is it right?"}]
    build = chat_ids(tok, messages, reg)
    (splice,) = build.splices
    assert build.ids[splice.start : splice.end] == generated
    before = tok.apply_chat_template([{"role": "user", "content": "Check this: "}])
    before = before[: before.index("Check this: ") + len("Check this: ")]
    assert build.ids[: splice.start] == tok.encode(before)
    plain = chat_ids(tok, messages, None)
    assert plain.splices == [] and plain.ids == tok.encode(tok.apply_chat_template(messages))
    comp = completion_ids(tok, f"Q: {ANSWER}", reg)
    assert comp.ids == tok.encode("Q: ") + generated


def test_chat_ids_mark_the_message_contents_with_and_without_splices():
    tok = tiny_lm().tokenizer
    reg = OutputRegistry()
    generated = tuple(tok.encode(ANSWER)[::-1])
    reg.add(RegisteredOutput(ANSWER, generated, "s", 7))
    system, user = "You check answers.", f"Check this: {ANSWER} Is it right?"
    messages = [{"role": "system", "content": system}, {"role": "user", "content": user}]
    for registry in (None, reg):
        build = chat_ids(tok, messages, registry)
        (a, b), (c, d) = build.content_ranges
        assert tok.decode(build.ids[a:b], skip_special_tokens=False) == system
        if registry is None:
            assert tok.decode(build.ids[c:d], skip_special_tokens=False) == user
        else:  # the spliced output lies inside the user content, and so do the texts around it
            (splice,) = build.splices
            assert c < splice.start < splice.end < d
            assert tok.decode(build.ids[c : splice.start]) == "Check this: "
            assert tok.decode(build.ids[splice.end : d]) == " Is it right?"
        # the framing (turn tokens, role headers, the generation prompt) lies outside every range
        framing = build.ids[:a] + build.ids[b:c] + build.ids[d:]
        assert tok.decode(framing, skip_special_tokens=False) == (
            "<|im_start|>system\n" + "<|im_end|>\n<|im_start|>user\n" + "<|im_end|>\n<|im_start|>assistant\n")
    assert completion_ids(tok, f"Q: {ANSWER}", reg).content_ranges is None  # a raw prompt has no framing


@pytest.mark.parametrize("match_framing", [False, True])
def test_catalog_matches_runs_inside_contents_unless_told_to_take_the_framing(match_framing):
    from kvrelay.server.prompting import PromptBuild

    cat = SpanCatalog(KVStore(10_000, block_len=4), "fp", block_len=4,
                      match=MatchConfig(min_match_tokens=4, match_framing=match_framing))
    stored = [1, 2, 3] + list(range(10, 30))  # another agent's prompt: its framing, then a shared run
    cat.put("a", "a#0", ToySpan(tuple(stored), 10))
    # this prompt's contents are [5, 15) and [17, 25); tokens 3..24 repeat stored[1:23] (framing 15..17 included)
    ids = [7, 7, 7] + stored[1:23] + [8]
    built = cat.build_call(PromptBuild(ids, [], [(5, 15), (17, 25)]), "a", "agent")
    got = [(r.start, r.end, r.src_start) for r in built.call.refs]
    if match_framing:
        assert got == [(3, 25, 1)] and built.framing == []
    else:  # the longest piece inside one content, then the next; the framing between is computed
        assert got == [(5, 15, 3), (17, 25, 15)]
        assert built.framing == [(0, 5), (15, 17), (25, 26)]  # kept unmatchable in the span this call publishes
    assert cat.build_call(PromptBuild(ids, [], None), "a", "agent").call.refs[0].start == 3  # no structure


def test_a_published_span_s_framing_is_never_matched():
    from kvrelay.server.prompting import PromptBuild

    cat = SpanCatalog(KVStore(10_000, block_len=4), "fp", block_len=4, match=MatchConfig(min_match_tokens=4))
    stored = [1, 2, 3] + list(range(10, 30))
    cat.view("a", framing=[(0, 3)]).put("a#0", ToySpan(tuple(stored), 10))  # as the server publishes a call
    built = cat.build_call(PromptBuild([7] + stored[1:23], [], None), "a", "agent")
    assert [(r.start, r.end, r.src_start) for r in built.call.refs] == [(3, 23, 3)]  # stops at the span's framing


@dataclass
class ToySpan:
    token_ids: tuple[int, ...]
    nbytes: int
    start_pos: int = 0
    fingerprint: str = "fp"


def test_catalog_evicts_only_within_the_namespace():
    cat = SpanCatalog(KVStore(300, block_len=4), "fp", block_len=4, match=MatchConfig(min_match_tokens=4))
    cat.put("a", "a#0", ToySpan(tuple(range(8)), 100))
    cat.put("b", "b#0", ToySpan(tuple(range(8)), 100))
    cat.put("a", "a#1", ToySpan(tuple(range(100, 108)), 100))
    cat.put("a", "a#2", ToySpan(tuple(range(200, 208)), 100))  # full: a evicts its own oldest, never b's
    assert cat.store.ids("a") == ["a#1", "a#2"] and cat.store.ids("b") == ["b#0"]
    assert "a#0" not in cat.index and cat.index.find(list(range(8)), "a", min_tokens=4) == []
    assert [m.span_id for m in cat.index.find(list(range(8)), "b", min_tokens=4)] == ["b#0"]
    with pytest.raises(StoreFullError):  # b cannot push a's spans out, and has nothing else to evict
        cat.put("b", "b#1", ToySpan(tuple(range(8)), 250))
    assert cat.store.ids("a") == ["a#1", "a#2"] and cat.store.ids("b") == ["b#0"]


def test_catalog_views_hide_other_namespaces_and_calls_pin_what_they_read():
    cat = SpanCatalog(KVStore(10_000, block_len=4), "fp", block_len=4, match=MatchConfig(min_match_tokens=4))
    cat.put("a", "a#0", ToySpan(tuple(range(12)), 10))
    view_a, view_b = cat.view("a"), cat.view("b")
    assert "a#0" in view_a and "a#0" not in view_b
    with pytest.raises(KeyError):
        view_b.get("a#0")
    assert view_b.match_prefix("fp", list(range(12))) is None
    assert view_a.match_prefix("other-model", list(range(12))) is None
    from kvrelay.server.prompting import PromptBuild

    built = cat.build_call(PromptBuild([50, 51] + list(range(2, 12)) + [60], []), "a", "agent")
    assert [(r.start, r.end, r.span_id, r.src_start, r.kind) for r in built.call.refs] == [(2, 12, "a#0", 2, "input")]
    assert cat.store.is_pinned("a#0", "a")
    cat.unpin(built)
    assert not cat.store.is_pinned("a#0", "a")
    assert cat.build_call(PromptBuild(list(range(12)), []), "b", "agent").call.refs == []
    cat.store.remove("a#0", "a")  # gone from the store behind the catalog's back: its index entry is not used
    assert cat.build_call(PromptBuild([50, 51] + list(range(2, 12)) + [60], []), "a", "agent").call.refs == []


def test_stop_matcher_holds_back_a_possible_stop_and_cuts_at_it():
    m = StopMatcher(["END"])
    assert m.feed("Hello E") == ("Hello ", False)  # "E" may start "END"
    assert m.feed("Hello EN") == ("", False)
    assert m.feed("Hello ENX") == ("ENX", False)
    assert m.feed("Hello ENX and END more") == (" and ", True)
    assert m.final_text("Hello ENX and END more!") == "Hello ENX and "
    assert StopMatcher([]).feed("abc\ufffd") == ("abc", False)  # a split character waits for its bytes


def test_incremental_decoder_equals_whole_decode_and_waits_for_split_characters():
    from kvrelay.server.textstream import IncrementalDecoder

    tok = tiny_lm().tokenizer
    ids = tok.encode("Grüße, 世界! naïve café ☕ done.")
    dec = IncrementalDecoder(tok)
    for k in range(1, len(ids) + 1):
        text = dec.feed(ids[:k])
        assert "\ufffd" not in text and tok.decode(ids[:k]).startswith(text)
    assert text == tok.decode(ids)


def test_registry_forgets_a_namespace_whose_outputs_are_all_gone():
    """A namespace per conversation (``cache_salt``): its outputs go with their spans, and so does the namespace."""
    reg = OutputRegistry()

    def conversation(i: int) -> None:
        reg.add(out(f"{ANSWER} Conversation {i}.", span=f"span{i}", ns=f"k0/s{i:08d}"))
        reg.remove_span(f"span{i}")

    assert retained_bytes_per_call(conversation) <= MAX_BOUNDED_BYTES_PER_CALL
    assert len(reg) == 0 and reg.num_namespaces == 0
