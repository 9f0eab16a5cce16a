"""Reuse per step for clients that stream without ``stream_options.include_usage`` (as most agent frameworks do):
no ``usage`` then, as on OpenAI, but the chunk with ``finish_reason`` carries the ``kvrelay`` object."""

from __future__ import annotations

import uuid

from tests.server.conftest import MODEL

DOC = "The Danube flows from the Black Forest to the Black Sea through ten countries and four capitals. " * 3


def test_finish_chunk_reports_reuse_without_include_usage(server):
    ns = uuid.uuid4().hex
    kw = dict(model=MODEL, max_tokens=6, temperature=0, extra_body={"cache_salt": ns})
    server.client().chat.completions.create(messages=[{"role": "system", "content": DOC},
                                                      {"role": "user", "content": "First question."}], **kw)
    chunks = list(server.client().chat.completions.create(
        messages=[{"role": "system", "content": DOC}, {"role": "user", "content": "Second question."}],
        stream=True, **kw))
    assert all(c.usage is None for c in chunks)
    finish = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finish) == 1
    reused = finish[0].model_extra["kvrelay"]["num_reused_tokens"]
    assert reused > 0
    again = server.client().chat.completions.create(
        messages=[{"role": "system", "content": DOC}, {"role": "user", "content": "Second question."}],
        **{**kw, "extra_body": {"cache_salt": uuid.uuid4().hex}})
    assert again.usage.prompt_tokens_details.cached_tokens == 0  # a fresh namespace: the reuse above was real
