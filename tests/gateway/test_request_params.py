"""A request's parameters as a real gateway reads them: each malformed or out-of-range field is a 400 in OpenAI's
shape that names it (`param`), with the message a client shows; where several are wrong, the same one is named
every time (an unknown field before a bad value); the body is read as JSON reads it (a duplicate key's last value,
a byte-order mark, UTF-16) and whole however it arrives."""

import json
import time

import httpx
import pytest

from tests.gateway.conftest import BASE_MODEL

pytestmark = [pytest.mark.slow, pytest.mark.django_db]

CHAT = {"model": BASE_MODEL, "messages": [{"role": "user", "content": "w20 w21"}], "max_tokens": 2}
COMPLETION = {"model": BASE_MODEL, "prompt": "w20 w21", "max_tokens": 2}


def post(stack, path: str, content: bytes) -> httpx.Response:
    return httpx.post(f"{stack.gateways[0]}{path}", content=content, timeout=60,
                      headers={"Authorization": f"Bearer {stack.keys['main']}", "Content-Type": "application/json"})  # fmt: skip


# (endpoint's base body, the fields changed, param, code, message)
REFUSED = {
    "temperature-type": (COMPLETION, {"temperature": True}, "temperature", None, "'temperature' must be a number."),
    "top-p-type": (COMPLETION, {"top_p": "1"}, "top_p", None, "'top_p' must be a number."),
    "presence-range": (CHAT, {"presence_penalty": 3}, "presence_penalty", None,
                       "3 is not a valid value for 'presence_penalty': it must be between -2 and 2."),
    "frequency-range": (CHAT, {"frequency_penalty": -3}, "frequency_penalty", None,
                        "-3 is not a valid value for 'frequency_penalty': it must be between -2 and 2."),
    "n-type": (COMPLETION, {"n": "1"}, "n", None, "'n' must be an integer."),
    "n-range": (COMPLETION, {"n": 0}, "n", None, "0 is not a valid value for 'n': it must be between 1 and 16."),
    "seed-range": (COMPLETION, {"seed": 2**63}, "seed", None,
                   "9223372036854775808 is not a valid value for 'seed': it must be between -9223372036854775808 "
                   "and 9223372036854775807."),
    "max-tokens-range": (COMPLETION, {"max_tokens": 0}, "max_tokens", None,
                         "0 is not a valid value for 'max_tokens': it must be between 1 and 2147483648."),
    "max-completion-tokens-range": (CHAT, {"max_completion_tokens": 0}, "max_completion_tokens", None,
                                    "0 is not a valid value for 'max_completion_tokens': it must be between 1 and "
                                    "2147483648."),
    "stop-empty": (COMPLETION, {"stop": [""]}, "stop", None,
                   "'stop' must be a non-empty string or a list of up to 4 of them."),
    "stop-too-many": (CHAT, {"stop": ["w1"] * 5}, "stop", None,
                      "'stop' must be a non-empty string or a list of up to 4 of them."),
    "user-type": (COMPLETION, {"user": 3}, "user", None, "'user' must be a string."),
    "logit-bias-key": (COMPLETION, {"logit_bias": {"x": 1}}, "logit_bias", None,
                       "Invalid key in 'logit_bias': 'x' is not a token id."),
    "stream-type": (COMPLETION, {"stream": 1}, "stream", None, "'stream' must be a boolean."),
    "stream-options-alone": (COMPLETION, {"stream_options": {"include_usage": True}}, "stream_options", None,
                             "The 'stream_options' parameter is only allowed when 'stream' is enabled."),
    "stream-options-key": (COMPLETION, {"stream": True, "stream_options": {"x": 1}}, "stream_options", None,
                           "Unrecognized key in 'stream_options': 'x'. It accepts 'include_usage', "
                           "'include_obfuscation' and 'continuous_usage_stats'."),
    "echo-type": (COMPLETION, {"echo": 1}, "echo", None, "'echo' must be a boolean."),
    "best-of": (COMPLETION, {"best_of": 3}, "best_of", "unsupported_parameter",
                "`best_of` other than n is not supported by this server."),
    "suffix": (COMPLETION, {"suffix": "x"}, "suffix", "unsupported_parameter",
               "`suffix` (insertion) is not supported by this server."),
    "completion-logprobs-range": (COMPLETION, {"logprobs": 6}, "logprobs", None,
                                  "6 is not a valid value for 'logprobs': it must be between 0 and 5."),
    "chat-logprobs-type": (CHAT, {"logprobs": 1}, "logprobs", None, "'logprobs' must be a boolean."),
    "top-logprobs-alone": (CHAT, {"top_logprobs": 2}, "top_logprobs", None,
                           "'top_logprobs' requires 'logprobs' to be true."),
    "model-empty": (COMPLETION, {"model": ""}, "model", None, "You must provide a model parameter."),
    "model-too-long": (COMPLETION, {"model": "m" * 257}, "model", None, "The model name is longer than 256 characters."),
    "model-nul": (COMPLETION, {"model": "a\x00b"}, "model", None, "'model' must not contain NUL characters."),
    "modalities": (CHAT, {"modalities": ["audio"]}, "modalities", "unsupported_parameter",
                   "Only the 'text' modality is supported."),
    "metadata-type": (CHAT, {"metadata": 3}, "metadata", None, "'metadata' must be an object."),
    "messages-empty": (CHAT, {"messages": []}, "messages", None, "'messages' must be a non-empty list."),
    "message-not-object": (CHAT, {"messages": ["w1"]}, "messages.[0]", None,
                           "messages.[0] must be an object with a role and content."),
    "message-function": (CHAT, {"messages": [{"role": "function", "content": "f"}]}, "messages.[0]",
                         "unsupported_parameter",
                         "The deprecated function messages are not supported; answer tool calls with role 'tool'."),
    "message-tool-without-id": (CHAT, {"messages": [{"role": "tool", "content": "r"}]}, "messages.[0].tool_call_id",
                                None, "messages.[0].tool_call_id must name the tool call this message answers."),
    "message-tool-calls-type": (CHAT, {"messages": [{"role": "assistant", "tool_calls": "no"}]},
                                "messages.[0].tool_calls", None,
                                "messages.[0].tool_calls must be a list, on an assistant message."),
    "message-content-type": (CHAT, {"messages": [{"role": "user", "content": "w1"}, {"role": "user", "content": 5}]},
                             "messages.[1].content", None,
                             "messages.[1].content must be a string or a list of text parts."),
    "unknown-before-bad-value": (COMPLETION, {"frobnicate": 1, "temperature": 9}, "frobnicate", None,
                                 "Unrecognized request argument supplied: frobnicate."),
}  # fmt: skip


@pytest.mark.parametrize("case", REFUSED)
def test_a_bad_field_is_a_400_that_names_it(stack, case):
    base, changed, param, code, message = REFUSED[case]
    path = "/chat/completions" if "messages" in base else "/completions"
    response = post(stack, path, json.dumps(base | changed).encode())
    assert response.status_code == 400, response.text
    assert response.json() == {"error": {"message": message, "type": "invalid_request_error", "param": param,
                                         "code": code}}  # fmt: skip
    assert response.headers["x-request-id"]


UNREADABLE = {
    "trailing-data": (b'{"model": "tiny", "prompt": "w1"} x', "The request body is not valid JSON: Extra data: line 1 "
                                                                   "column 35 (char 34).", None),
    "not-utf8": (b'{"model": "\xff"}', "The request body is not valid JSON: 'utf-8' codec can't decode byte 0xff in "
                                       "position 11: invalid start byte.", None),
    "not-an-object": (b"[1]", "The request body must be a JSON object.", None),
    "too-deep": (b'{"model": "tiny", "x": [' + b"[" * 5000 + b"]" * 5000 + b"]}",
                 "The request body is nested too deeply.", None),
    "lone-surrogate": (b'{"model": "tiny", "prompt": "w1", "x": "\xed\xa0\x80"}',
                       "The request body holds a lone UTF-16 surrogate, which is not valid Unicode text.", "x"),
}  # fmt: skip


@pytest.mark.parametrize("case", UNREADABLE)
def test_a_body_json_cannot_read_is_a_400_saying_why(stack, case):
    raw, message, param = UNREADABLE[case]
    response = post(stack, "/completions", raw)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert (error["message"], error["type"], error["param"]) == (message, "invalid_request_error", param)


GREEDY = COMPLETION | {"temperature": 0}
PLAIN = json.dumps(GREEDY)


@pytest.mark.parametrize("raw", [
    b'{"model": "no-such-model", ' + PLAIN[1:].encode(),  # a key given twice: its last value counts
    PLAIN.encode("utf-8-sig"),
    PLAIN.encode("utf-16-le"),
], ids=["duplicate-key", "utf-8-bom", "utf-16"])  # fmt: skip
def test_a_body_json_reads_is_served_as_its_plain_form(stack, raw):
    plain = post(stack, "/completions", PLAIN.encode()).json()
    response = post(stack, "/completions", raw)
    assert response.status_code == 200, response.text
    assert response.json()["model"] == BASE_MODEL and response.json()["choices"] == plain["choices"]


def test_a_body_sent_in_pieces_is_read_whole(stack):
    """A chunked upload whose pieces arrive apart, its JSON cut mid-token: the gateway answers the whole body."""
    raw = json.dumps(GREEDY | {"max_tokens": 3}).encode()
    whole = post(stack, "/completions", raw).json()

    def pieces():
        for start in range(0, len(raw), 7):
            yield raw[start : start + 7]
            time.sleep(0.02)

    response = httpx.post(f"{stack.gateways[0]}/completions", content=pieces(), timeout=60,
                          headers={"Authorization": f"Bearer {stack.keys['main']}",
                                   "Content-Type": "application/json"})  # fmt: skip
    assert response.status_code == 200, response.text
    assert response.json()["choices"] == whole["choices"] and response.json()["usage"] == whole["usage"]
