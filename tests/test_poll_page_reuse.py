"""The poller reads an unchanged /metrics page once, and plain gauge lines without
prometheus_client's parser, with the same signals either way."""

from __future__ import annotations

import contextlib

import pytest
from aiohttp import web
from prometheus_client.parser import text_string_to_metric_families

from kvrouter.loadtest.process_group import free_port
from kvrouter.metrics.router_metrics import RouterMetrics
from kvrouter.router import poller as poller_module
from kvrouter.router.config import SignalsConfig
from kvrouter.router.poller import SignalPoller
from kvrouter.router.replicas import ReplicaRegistry
from kvrouter.sglang_protocol import signals as signals_module
from kvrouter.sglang_protocol.exposition_lines import plain_samples
from kvrouter.sglang_protocol.signals import SignalParseError, parse_metrics_text

from .test_sglang_metrics_parse import single_rank_exposition


def page(running: int) -> bytes:
    return single_rank_exposition().replace(
        'tp_rank="0"} 7.0', f'tp_rank="0"}} {running}.0', 1).encode()


@pytest.fixture
async def replica():
    pages = {"body": page(7)}

    async def metrics(request: web.Request) -> web.Response:
        return web.Response(body=pages["body"], content_type="text/plain")

    app = web.Application()
    app.router.add_get("/metrics", metrics)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    yield f"http://127.0.0.1:{port}", pages
    await runner.cleanup()


async def test_an_unchanged_page_is_parsed_once_and_a_changed_one_again(replica, monkeypatch):
    url, pages = replica
    parsed = []
    parse = poller_module.parse_metrics_text
    monkeypatch.setattr(poller_module, "parse_metrics_text", lambda text: parsed.append(text) or parse(text))
    registry = ReplicaRegistry([url])
    seen = []
    poller = SignalPoller(registry, RouterMetrics(), SignalsConfig(), on_signals=lambda u, s: seen.append(s))
    async with contextlib.aclosing(poller):
        await poller.poll_all()
        await poller.poll_all()
        assert len(parsed) == 1  # the same bytes: the same signals, not parsed again
        assert len(seen) == 2 and seen[1] is seen[0] and seen[0].num_running_reqs == 7
        assert registry.view(url).num_running_reqs == 7
        pages["body"] = page(3)
        await poller.poll_all()
        assert len(parsed) == 2
        assert seen[2].num_running_reqs == 3 and registry.view(url).num_running_reqs == 3
        registry.remove(url)
        await poller.poll_all()
    assert poller.last_page == {}  # a removed replica's page is not kept


def test_plain_gauge_lines_need_no_prometheus_parser(monkeypatch):
    def refuse(text):
        raise AssertionError("prometheus_client's parser was used")

    expected = parse_metrics_text(single_rank_exposition(), strict=True)
    monkeypatch.setattr(signals_module, "text_string_to_metric_families", refuse)
    assert parse_metrics_text(single_rank_exposition()) == expected


def prometheus_samples(text):
    return [(s.name, s.labels, float(s.value)) for f in text_string_to_metric_families(text) for s in f.samples]


@pytest.mark.parametrize("line", [
    'sglang:num_running_reqs{model_name="m",tp_rank="0"} 7.0',
    'sglang:num_running_reqs 7',
    'sglang_token_usage{a="x,y}z=",b=""} 0.25',
    'sglang:gen_throughput{} 1e3',
    'sglang:gen_throughput{a="1"} +Inf',
    'sglang:gen_throughput{a="1"} -1.5E-2',
    'sglang:gen_throughput{a="1"} .5',
])
def test_plain_lines_read_as_prometheus_client_reads_them(line):
    got = plain_samples(line + "\n")
    assert got is not None
    assert [(n, labels, float(v)) for n, labels, v in got] == prometheus_samples(line + "\n")


@pytest.mark.parametrize("line", [
    'sglang:num_running_reqs{model_name="a\\"b"} 7.0',  # an escape
    'sglang:num_running_reqs{a="1"} 7.0 1700000000000',  # a timestamp
    'sglang:num_running_reqs{a="1", b="2"} 7.0',  # spacing the plain form does not use
    'sglang:num_running_reqs{a="1",a="2"} 7.0',  # a repeated label
    'sglang:num_running_reqs{__name__="x"} 7.0',  # a reserved label
    '# TYPE sglang:num_running_reqs gauge',
    'sglang:num_running_reqs{a="1"} 1_000',
    'sglang:num_running_reqs{a="1"} 7.0 ',
])
def test_other_lines_are_left_to_prometheus_client(line):
    assert plain_samples("sglang:token_usage 0.5\n" + line + "\n") is None


def test_a_line_the_fast_reader_refuses_still_parses_as_before():
    text = single_rank_exposition().replace('tp_rank="0"} 2.0', 'tp_rank="0",x="a\\"b"} 2.0', 1)
    assert parse_metrics_text(text) == parse_metrics_text(text, strict=True)
    assert parse_metrics_text(text).num_queue_reqs == 2


@pytest.mark.parametrize("running", ["+Inf", "-Inf", "1e400"])
async def test_an_infinite_count_is_a_failed_poll_not_a_dead_poller(replica, running):
    """An int signal cannot hold an infinity: the page is a parse error, counted as a failed
    poll, and the poller goes on polling (the error does not escape poll_all)."""
    url, pages = replica
    pages["body"] = single_rank_exposition().replace('tp_rank="0"} 7.0', f'tp_rank="0"}} {running}', 1).encode()
    with pytest.raises(SignalParseError):
        parse_metrics_text(pages["body"].decode())
    metrics = RouterMetrics()
    poller = SignalPoller(ReplicaRegistry([url]), metrics, SignalsConfig())
    async with contextlib.aclosing(poller):
        await poller.poll_all()
        pages["body"] = page(3)
        await poller.poll_all()
    assert metrics.poll_errors.labels(url)._value.get() == 1
    assert poller.registry.view(url).num_running_reqs == 3


async def test_a_reused_page_keeps_the_signals_fresh_and_a_readded_replica_gets_them(replica):
    """Reuse skips only the parsing: each poll of the same bytes still dates the signals (they do
    not go stale), and a replica removed and added back under the same URL is told them again."""
    url, _ = replica
    now = {"t": 0.0}
    registry = ReplicaRegistry([url])
    poller = SignalPoller(registry, RouterMetrics(), SignalsConfig(stale_after_s=2.0), clock=lambda: now["t"])
    async with contextlib.aclosing(poller):
        for t in (0.0, 1.5, 3.0, 4.5):  # each poll inside stale_after_s of the last one
            now["t"] = t
            await poller.poll_all()
            assert registry.view(url).num_running_reqs == 7
        assert poller.last_update[url] == 4.5
        registry.remove(url)
        registry.add(url)
        assert registry.view(url).num_running_reqs is None
        await poller.poll_all()
        assert registry.view(url).num_running_reqs == 7
