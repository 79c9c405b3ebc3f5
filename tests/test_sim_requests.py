"""The simulated replica's request parsing (loadtest/sim_requests.py) on plain dicts: what SGLang
accepts becomes one Submission, what it rejects raises SimError (answered 400)."""

from __future__ import annotations

import pytest

from kvrouter.loadtest.sim_prompt import render_chat
from kvrouter.loadtest.sim_replica import SimError
from kvrouter.loadtest.sim_requests import (
    COMPLETIONS_DEFAULT_MAX_TOKENS,
    GENERATE_DEFAULT_MAX_NEW_TOKENS,
    Submission,
    int_field,
    parse_chat,
    parse_completions,
    parse_generate,
)


def test_generate_text_or_ids_with_sampling_params():
    assert parse_generate({"text": "hi"}) == Submission("hi", None, GENERATE_DEFAULT_MAX_NEW_TOKENS, False, None)
    got = parse_generate({"text": "ignored", "input_ids": [1, 2], "rid": "r",
                          "sampling_params": {"max_new_tokens": 5, "ignore_eos": True}})
    assert got == Submission(None, [1, 2], 5, True, "r")  # input_ids win over text


@pytest.mark.parametrize("body, message", [
    ({"text": ["a", "b"]}, "Batch"),
    ({"input_ids": [[1], [2]]}, "Batch"),
    ({}, "Either text, input_ids"),
    ({"text": 3}, "text must be a string"),
    ({"input_ids": [1, True]}, "input_ids must be a list of integers"),
    ({"text": "x", "sampling_params": [1]}, "sampling_params must be an object"),
    ({"text": "x", "sampling_params": {"max_new_tokens": "5"}}, "max_new_tokens must be an integer"),
    ({"text": "x", "rid": 7}, "rid must be a string"),
])
def test_generate_rejects_what_sglang_rejects(body, message):
    with pytest.raises(SimError, match=message):
        parse_generate(body)


def test_chat_renders_messages_and_reads_openai_fields():
    messages = [{"role": "user", "content": "hello"}]
    got = parse_chat({"messages": messages, "max_completion_tokens": 9, "max_tokens": 3, "ignore_eos": True})
    assert got == Submission(render_chat(messages), None, 9, True, None)  # max_completion_tokens first
    assert parse_chat({"messages": messages}).max_new_tokens is None  # up to the context length


@pytest.mark.parametrize("body, message", [
    ({"messages": []}, "messages must be a non-empty list"),
    ({"messages": ["hi"]}, "messages must be a non-empty list"),
    ({"messages": [{"role": "user", "content": "x"}], "n": 2}, "n > 1"),
    ({"messages": [{"role": "user", "content": "x"}], "max_tokens": 1.5}, "max_tokens must be an integer"),
])
def test_chat_rejects_bad_bodies(body, message):
    with pytest.raises(SimError, match=message):
        parse_chat(body)


def test_completions_one_prompt_as_text_or_ids():
    assert parse_completions({"prompt": "p"}) == Submission("p", None, COMPLETIONS_DEFAULT_MAX_TOKENS, False, None)
    assert parse_completions({"prompt": [[4, 5]], "max_tokens": 2}) == Submission(None, [4, 5], 2, False, None)
    assert parse_completions({"prompt": ["p"]}).prompt_text == "p"
    for bad in ({"prompt": ["a", "b"]}, {"prompt": []}, {"prompt": 3}, {}):
        with pytest.raises(SimError, match="prompt must be"):
            parse_completions(bad)


def test_int_field_takes_the_first_present_and_refuses_bools():
    assert int_field({"b": 2}, "a", "b") == 2
    assert int_field({}, "a") is None
    with pytest.raises(SimError):
        int_field({"a": True}, "a")
