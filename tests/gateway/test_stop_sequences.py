"""Stop sequences through the official `openai` client: the answer ends before the first stop string, whole or
streamed (a stop string that spans tokens too, so the stream holds back what may begin one), with finish_reason
"stop"; the text the stream sends is the whole answer's."""

import pytest

from tests.gateway.conftest import BASE_MODEL, client

pytestmark = [pytest.mark.slow, pytest.mark.django_db]

REQUEST = {"model": BASE_MODEL, "prompt": "w30 w31", "max_tokens": 8, "temperature": 0}


def streamed(api, **request) -> tuple[str, str | None]:
    chunks = [chunk.choices[0] for chunk in api.completions.create(**request, stream=True) if chunk.choices]
    assert all(choice.finish_reason is None for choice in chunks[:-1])
    return "".join(choice.text for choice in chunks), chunks[-1].finish_reason


def test_the_answer_ends_before_the_first_stop_string(stack):
    api = client(stack, stack.keys["main"])
    free = api.completions.create(**REQUEST).choices[0]
    words = free.text.split()
    assert free.finish_reason == "length" and len(words) == 8, free.text
    third = words[2]
    within = f"{words[3][:-1]}"  # the start of the fourth word: a stop string inside a token
    across = f"{words[4]} {words[5][:2]}"  # the fifth word, the space and the start of the sixth: across tokens
    for stop in ([f" {third}"], [across], [within], ["never-there", across]):
        expected = free.text[: min(free.text.find(s) for s in stop if s in free.text)]
        whole = api.completions.create(**REQUEST, stop=stop).choices[0]
        assert (whole.text, whole.finish_reason) == (expected, "stop"), stop
        assert streamed(api, **REQUEST, stop=stop) == (expected, "stop"), stop
    chat = api.chat.completions.create(model=BASE_MODEL, messages=[{"role": "user", "content": "w30 w31"}],
                                       max_tokens=8, temperature=0)  # fmt: skip
    text = chat.choices[0].message.content
    stop = text.split()[2]
    answer = api.chat.completions.create(model=BASE_MODEL, messages=[{"role": "user", "content": "w30 w31"}],
                                         max_tokens=8, temperature=0, stop=stop)  # fmt: skip
    assert (answer.choices[0].message.content, answer.choices[0].finish_reason) == (text[: text.find(stop)], "stop")
