"""The fast reader of plain sample lines against prometheus_client's parser: on any page it
reads, it finds the same samples, in the same order, with the same values; a page prometheus_client
refuses it refuses too (it answers None and the caller parses with prometheus_client)."""

from __future__ import annotations

import math

from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client.parser import text_string_to_metric_families

from kvrouter.loadtest.sim_replica import SimReplica
from kvrouter.sglang_protocol import metric_names as sg
from kvrouter.sglang_protocol.exposition_lines import plain_samples
from kvrouter.sglang_protocol.signals import _prefilter, parse_metrics_text

from .test_sglang_metrics_parse import single_rank_exposition


def comparable(value: float | int | str) -> object:
    """The value as the signals parser reads it (``float()``: prometheus_client gives ints for
    integer text), NaN made equal to itself."""
    number = float(value)
    return "nan" if math.isnan(number) else number


def prometheus_samples(text: str) -> list[tuple[str, dict[str, str], object]] | None:
    try:
        return [(s.name, s.labels, comparable(s.value))
                for f in text_string_to_metric_families(text) for s in f.samples]
    except Exception:  # a page prometheus_client refuses (or a value float() refuses)
        return None


def assert_same_reading(text: str) -> None:
    fast = plain_samples(text)
    if fast is None:
        return  # left to prometheus_client
    assert prometheus_samples(text) == [(n, labels, comparable(float(v))) for n, labels, v in fast]


BASES = [spec.base for spec in sg.METRIC_SPECS]
names = st.one_of(
    st.builds(lambda p, b, s: p + b + s, st.sampled_from(sg.PREFIXES), st.sampled_from(BASES),
              st.sampled_from(["", "_bucket", "_sum", "_count", "_total", "_created"])),
    st.from_regex(r"[a-zA-Z_:][a-zA-Z0-9_:]{0,12}", fullmatch=True),
    st.sampled_from(["", "1abc", "a-b", "a b", "sglang:x{", '"sglang:x"']),
)
label_names = st.one_of(
    st.sampled_from(["le", "quantile", "tp_rank", "dp_rank", "pp_rank", "priority", "model_name",
                     "__name__", "__x", "a:b", "1x", ""]),
    st.from_regex(r"[a-zA-Z_][a-zA-Z0-9_]{0,6}", fullmatch=True),
)
label_values = st.one_of(
    st.text(alphabet=st.sampled_from('ab0.+-=,{}#" \\\n\r\t\x85\u2028é'), max_size=8),
    st.sampled_from(["+Inf", "0.005", "0.5", "1e3", "NaN", ""]),
)


@st.composite
def label_text(draw: st.DrawFn) -> str:
    pairs = draw(st.lists(st.tuples(label_names, label_values), max_size=4))
    escape = draw(st.booleans())
    parts = []
    for name, value in pairs:
        if escape:
            value = escaped(value)
        parts.append(f'{name}="{value}"')
    sep = draw(st.sampled_from([",", ", ", ",,"]))
    trailing = draw(st.sampled_from(["", ","]))
    return "{" + sep.join(parts) + trailing + "}"


values = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True).map(repr),
    st.integers(min_value=-(10**30), max_value=10**30).map(str),
    st.sampled_from(["NaN", "-NaN", "nan", "+Inf", "-Inf", "Inf", "inf", "Infinity", "1e3", "-1.5E-2",
                     ".5", "1.", "+7", "-0", "1_000", "0x10", "1e", "", "7 ", " 7", "7\r"]),
)


@st.composite
def sample_line(draw: st.DrawFn) -> str:
    name = draw(names)
    labels = draw(st.one_of(st.just(""), label_text()))
    sep = draw(st.sampled_from([" ", " ", " ", "  ", "\t"]))
    tail = draw(st.sampled_from(["", "", "", " 1700000000000", ' # {trace_id="a"} 1.0 1', " ", "\r"]))
    return name + labels + sep + draw(values) + tail


lines = st.one_of(
    sample_line(),
    st.sampled_from(["# TYPE sglang:num_running_reqs gauge", "# HELP sglang:token_usage The token usage.",
                     "# EOF", "", "   "]),
)


@settings(max_examples=400, deadline=None)
@given(st.lists(lines, min_size=1, max_size=6))
def test_the_fast_reader_reads_what_it_reads_as_prometheus_client_does(page_lines: list[str]) -> None:
    assert_same_reading("\n".join(page_lines) + "\n")


def escaped(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


@st.composite
def well_formed_labels(draw: st.DrawFn) -> str:
    """Distinct valid label names; values of any characters, escaped as the format says."""
    pairs = draw(st.lists(st.tuples(st.from_regex(r"[a-z][a-z_]{0,5}", fullmatch=True), label_values),
                          max_size=3, unique_by=lambda p: p[0]))
    return "{" + ",".join(f'{name}="{escaped(value)}"' for name, value in pairs) + "}"


@settings(max_examples=300, deadline=None)
@given(st.lists(st.builds(lambda n, labels, v: f"{n}{labels} {v}",
                          st.builds(lambda p, b: p + b, st.sampled_from(sg.PREFIXES), st.sampled_from(BASES)),
                          st.one_of(st.just(""), well_formed_labels()),
                          st.one_of(values, st.floats().map(repr))), min_size=1, max_size=6))
def test_plain_pages_read_the_same(page_lines: list[str]) -> None:
    """Pages of well-formed lines (the form SGLang writes, with escapes now and then), so the fast
    reader is used often and meets every escape."""
    assert_same_reading("\n".join(page_lines) + "\n")


def test_an_integer_beyond_float_range_is_left_to_prometheus_client() -> None:
    """prometheus_client reads integer text as an int, which float() then refuses (the page is
    an error); float() of the text would give inf."""
    for digits in (309, 400):
        assert_same_reading(f'sglang:token_usage{{tp_rank="0"}} 1{"0" * (digits - 1)}\n')
    assert_same_reading(f"sglang:token_usage {'9' * 300}\n")
    assert plain_samples(f"sglang:token_usage {'9' * 300}\n") is not None  # still the fast path


def test_a_real_replica_page_is_read_fast_and_the_same() -> None:
    """The simulated replica's page (SGLang's names and labels, prometheus_client's text, as
    SGLang's is) and the fixture page: their read lines all take the fast path, with the same
    signals as the whole page parsed by prometheus_client."""
    sim = SimReplica("tiny", served_model_name="kimi")
    for page in (sim.metrics_page.render().decode(), single_rank_exposition()):
        selected, _ = _prefilter(page)
        assert plain_samples(selected) is not None
        assert_same_reading(selected)
        assert parse_metrics_text(page) == parse_metrics_text(page, strict=True)
