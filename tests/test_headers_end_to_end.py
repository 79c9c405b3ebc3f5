"""end_to_end: hop-by-hop and Connection-named fields dropped in any letter case, every other
field kept with its case, order and repeats, whatever mapping the headers come in."""

from multidict import CIMultiDict, CIMultiDictProxy

from kvrouter.router.headers import drop_set, end_to_end, field_lines

RAW = [("Host", "x"), ("X-Trace", "1"), ("content-LENGTH", "4"), ("Connection", "keep-alive, X-Secret"),
       ("x-secret", "s"), ("Accept", "a"), ("X-Trace", "2"), ("TE", "trailers"), ("X-Api-Key", "k")]
KEPT = [("X-Trace", "1"), ("Accept", "a"), ("X-Trace", "2")]


def test_multidict_headers() -> None:
    for headers in (CIMultiDict(RAW), CIMultiDictProxy(CIMultiDict(RAW))):
        assert list(end_to_end(headers, drop_set(["x-api-KEY"])).items()) == KEPT


def test_plain_mapping_headers() -> None:
    plain = {k: v for k, v in RAW if k not in ("X-Trace", "Connection")}
    plain |= {"X-Trace": "1", "connection": "close, x-secret"}
    assert dict(end_to_end(plain, drop_set(["x-api-key"]))) == {"Accept": "a", "X-Trace": "1"}


def test_a_plain_frozenset_of_extra_names_still_drops_the_hop_by_hop_ones() -> None:
    kept = end_to_end(CIMultiDict(RAW), frozenset({"X-Api-Key"}))
    assert list(kept.items()) == KEPT


def test_the_parsers_lower_cased_names_give_the_same_copy() -> None:
    names = frozenset(k.lower() for k, _ in RAW)
    for headers in (CIMultiDict(RAW), CIMultiDictProxy(CIMultiDict(RAW))):
        assert list(end_to_end(headers, drop_set(["x-api-KEY"]), names).items()) == KEPT
    no_connection = [(k, v) for k, v in RAW if k != "Connection"]
    kept = end_to_end(CIMultiDict(no_connection), drop_set(), frozenset(k.lower() for k, _ in no_connection))
    assert list(kept.items()) == [("X-Trace", "1"), ("x-secret", "s"), ("Accept", "a"), ("X-Trace", "2"),
                                  ("X-Api-Key", "k")]


def test_field_lines() -> None:
    assert field_lines(CIMultiDict([("A", "1"), ("b", "2 3"), ("A", "")]).items()) == "A: 1\r\nb: 2 3\r\nA: \r\n"
    assert field_lines(CIMultiDict().items()) == ""


def test_every_connection_line_s_names_are_dropped() -> None:
    # Repeated field lines are one list (RFC 9110): a second Connection line's names are hop-by-hop too.
    raw = [("Connection", "keep-alive, X-Hop"), ("connection", "x-hop2"), ("X-Hop", "1"), ("X-Hop2", "2"),
           ("X-Kept", "3")]
    for headers in (CIMultiDict(raw), CIMultiDictProxy(CIMultiDict(raw))):
        assert list(end_to_end(headers, drop_set()).items()) == [("X-Kept", "3")]
        assert list(end_to_end(headers, drop_set(), frozenset(k.lower() for k, _ in raw)).items()) == [("X-Kept", "3")]
