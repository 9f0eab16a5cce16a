"""Over HTTP, with API keys: what a method learns from one tenant's requests never shows in another's answers."""

from __future__ import annotations

from tests.server.conftest import MODEL, Server, start_servers

SYSTEM = "You answer questions about the document the user quotes."
DOCS = [  # each long enough (over 2 x 16 - 1 tokens) that the matcher always finds it in a later request
    "The quarterly report lists revenue of nine million and a loss in the northern region offices; the board asks "
    "for a plan to cut travel, to merge two warehouses and to hire an auditor before the end of the next quarter.",
    "Our merger plan moves the research team to Lisbon in March and closes the Oslo office; staff who stay get a "
    "bonus, the lease ends in June, and the servers move to a data centre near Porto over two long weekends.",
    "The patient was given forty milligrams twice daily and the fever went down after three days; the nurse noted "
    "a mild rash on the fourth day, so the dose was halved and a follow-up visit was booked for the next week.",
]
LEARNING = ("kvcomm",)  # the one method that learns across calls


def _ask(server: Server, key: str, method: str, question: str, doc: str) -> tuple:
    """One request quoting ``doc``; what its tenant sees of the method's work."""
    r = server.client(key).chat.completions.create(
        model=MODEL, max_tokens=4, temperature=0,
        extra_body={"kvrelay": {"method": method}, "cache_salt": method},  # each method's spans apart
        messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": f"{question}\n\n{doc}"}])
    ext = r.model_extra["kvrelay"]
    return (r.usage.prompt_tokens_details.cached_tokens, ext["reuse_rate"], ext["num_computed_token_layers"],
            ext["fallback"], r.choices[0].message.content)


def _sends(server: Server, key: str, method: str, doc_ids: list[int]) -> list[tuple]:
    """Each document read once, then asked about three times: the questions quote a document the tenant's own
    earlier request stored, so the method plans them with that span as a placeholder (and learns from them)."""
    seen = []
    for d in doc_ids:
        seen.append(_ask(server, key, method, "Read this.", DOCS[d]))
        seen += [_ask(server, key, method, q, DOCS[d]) for q in ("Who is it about?", "What numbers?", "When?")]
    return seen


def test_what_a_method_learns_from_one_tenant_never_shows_in_another_tenants_answers(tmp_path):
    """Tenant B guesses which documents tenant A sent: its cached tokens, reuse rate, computed token-layers,
    fallback text and answers are the same on a server where A sent them first as on one where A sent nothing."""
    keys = tmp_path / "keys.txt"
    keys.write_text("key-a\nkey-b\n")
    flags = ("--api-keys", str(keys), "--methods", ",".join(LEARNING))
    seen, servers = {}, dict(zip((False, True), start_servers(flags, flags), strict=True))  # one per a_first
    try:
        for a_first, srv in servers.items():
            if a_first:
                for method in LEARNING:
                    _sends(srv, "key-a", method, [0, 1])
            seen[a_first] = [_sends(srv, "key-b", method, [0, 2]) for method in LEARNING]
    finally:
        for srv in servers.values():
            srv.stop()
    for alone, after_a in zip(seen[False], seen[True], strict=True):
        assert any(fallback is not None for *_, fallback, _ in alone)  # B's own learning calls
        assert after_a == alone
