"""The official openai client works unchanged through the router."""

from __future__ import annotations

import openai

from .fakes import FakeUpstream


async def test_openai_client_streaming_and_non_streaming(start_app, start_router):
    up = FakeUpstream(chunks=4)
    _, router_url = await start_router([await start_app(up.app())])
    client = openai.AsyncOpenAI(base_url=router_url + "/v1", api_key="unused", max_retries=0)
    try:
        reply = await client.chat.completions.create(
            model="fake-model", messages=[{"role": "user", "content": "hi"}]
        )
        assert reply.choices[0].message.content == "hello"
        stream = await client.chat.completions.create(
            model="fake-model", messages=[{"role": "user", "content": "hi"}], stream=True
        )
        text = "".join([c.choices[0].delta.content or "" async for c in stream])
        assert text == "tok1 tok2 tok3 "
        models = await client.models.list()
        assert [m.id for m in models.data] == ["fake-model"]
    finally:
        await client.close()
