"""policies/slots.py: frozen slotted dataclass instances made without their generated __init__ are
the objects the constructors make (equal, same class, still frozen), for the request path's
uses: a request summary with its KV-index matches (the engine), a view, a snapshot."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import pytest

from kvrouter.policies.domain import Decision, RequestSummary, Snapshot
from kvrouter.router.engine import _with_matches
from kvrouter.policies.slots import slot_filler, slot_replacer, slot_setters


def test_a_summary_with_its_matches_equals_dataclasses_replace() -> None:
    summary = RequestSummary("/v1/chat/completions", "s1", 123, "m", frozenset({"a"}), (1, 2, 3),
                             streamed=False)
    cached, host = {"r1": 64}, {"r2": 32}
    made = _with_matches(summary, cached, host)
    assert type(made) is RequestSummary
    assert made == dataclasses.replace(summary, cached_tokens=cached, host_cached_tokens=host)
    assert made.cached_tokens is cached and made.host_cached_tokens is host
    assert summary.cached_tokens == {} and summary.host_cached_tokens == {}  # the original kept
    with pytest.raises(dataclasses.FrozenInstanceError):
        made.prompt_tokens = 1  # type: ignore[misc]


@dataclass(frozen=True, slots=True)
class _Point:
    x: int
    y: int = 0
    label: str = dataclasses.field(default="p", init=False)


def test_filled_fields_and_defaults() -> None:
    fill = slot_filler(_Point, ("x", "y"), (("label", "p"),))
    point = fill([3, 4])
    assert type(point) is _Point and point == _Point(3, 4) and point.label == "p"
    assert hash(point) == hash(_Point(3, 4))


def test_a_class_whose_layout_cannot_be_twinned_is_refused_at_once() -> None:
    class Plain:  # no __slots__: an instance dict, not a slot layout
        pass

    with pytest.raises((TypeError, AttributeError)):
        slot_filler(Plain, ())


def test_a_snapshot_with_a_session_equals_dataclasses_replace() -> None:
    from kvrouter.policies.domain import SessionView, snapshot_with_session
    from kvrouter.router.replicas import ReplicaRegistry

    registry = ReplicaRegistry(["http://a:1", "http://b:1"])
    registry.dispatched("http://a:1", 10, 5)
    snapshot = registry.snapshot()
    session = SessionView("k", "http://a:1", 2)
    made = snapshot_with_session(snapshot, session)
    assert snapshot.with_session(session) == made  # the method is the same replacement
    expected = dataclasses.replace(snapshot, session=session)
    assert type(made) is Snapshot and made == expected and made.session is session
    assert all(getattr(made, f.name) is getattr(expected, f.name) for f in dataclasses.fields(Snapshot))
    assert made.memo is snapshot.memo  # scans made on these replicas are shared, as there



def test_a_well_formed_usage_object_reads_as_its_report() -> None:
    from kvrouter.router.usage import UsageReport, from_usage

    report = from_usage({"prompt_tokens": 8, "completion_tokens": 1,
                         "prompt_tokens_details": {"cached_tokens": 4}})
    assert type(report) is UsageReport and report == UsageReport(8, 4, 1)
    with pytest.raises(dataclasses.FrozenInstanceError):
        report.prompt_tokens = 9  # type: ignore[misc]


def test_a_field_not_filled_is_refused_at_once() -> None:
    @dataclass(frozen=True, slots=True)
    class Grown:
        x: int
        added: int | None = None  # a field added later, not named to the filler

    with pytest.raises(TypeError, match="added"):
        slot_filler(Grown, ("x",))
    with pytest.raises(TypeError, match="nope"):
        slot_filler(Grown, ("x", "added", "nope"))


def test_the_filler_runs_post_init_which_sets_the_derived_fields() -> None:
    @dataclass(frozen=True, slots=True)
    class Derived:
        a: int
        b: int
        total: int = dataclasses.field(init=False, compare=False)

        def __post_init__(self) -> None:
            object.__setattr__(self, "total", self.a + self.b)

    made = slot_filler(Derived, ("a", "b"))([2, 3])
    assert made == Derived(2, 3) and made.total == 5


def test_slot_setters_make_the_objects_the_generated_init_makes() -> None:
    @dataclass(frozen=True, slots=True, init=False)
    class Hand:
        a: int
        b: str

        def __init__(self, a: int, b: str) -> None:
            set_a(self, a)
            set_b(self, b)

    set_a, set_b = slot_setters(Hand, "a", "b")

    @dataclass(frozen=True, slots=True)
    class Generated:
        a: int
        b: str

    made = Hand(1, "x")
    assert (made.a, made.b) == dataclasses.astuple(Generated(1, "x")) and made == Hand(1, "x")
    with pytest.raises(dataclasses.FrozenInstanceError):
        made.a = 2  # type: ignore[misc]
    assert Decision("r", "affinity") == Decision("r", "affinity", None)  # the policies' own


def test_a_replacer_refuses_what_replace_would_compute_or_does_not_know() -> None:
    @dataclass(frozen=True, slots=True)
    class Derived:
        a: int
        b: int = dataclasses.field(default=0, init=False)

    with pytest.raises(TypeError, match="Derived: cannot replace"):
        slot_replacer(Derived, ("a",))
    with pytest.raises(TypeError, match="RequestSummary: cannot replace"):
        slot_replacer(RequestSummary, ("nope",))
    replace = slot_replacer(RequestSummary, ("prompt_tokens",))
    summary = RequestSummary("/v1/completions", "s", 10, prefix_blocks=(1, 2))
    made = replace(summary, 20)
    assert type(made) is RequestSummary and made == dataclasses.replace(summary, prompt_tokens=20)
    assert made.prefix_blocks is summary.prefix_blocks and summary.prompt_tokens == 10
