"""A user's own prompts (``+task=prompts``, tuner/tasks/prompts.py): each export format reads to
the prompts a person would write down by hand; every malformed record is refused with one line
naming the file, the line and what is allowed, before anything loads; the file's content is part
of the study's identity; the shipped example runs as a study (tests/test_readme.py runs the
README's command)."""

from __future__ import annotations

import hashlib
import json

import pytest

from tests.conftest import compose_cfg
from tuner.config.errors import ConfigError
from tuner.tasks.prompts import PromptFileError, read_prompts
from tuner.tasks.task import Task

pytestmark = pytest.mark.usefixtures("in_tmp")

CHAT = [
    {"messages": [{"role": "user", "content": "Hi there"}]},
    {"messages": [{"role": "system", "content": "Be brief."},
                  {"role": "user", "content": [{"type": "text", "text": "Two "},
                                               {"type": "text", "text": "parts"}]}]},
    {"messages": [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"},
                  {"role": "user", "content": "and 3+3?"},
                  {"role": "assistant", "content": "6"}]},          # a whole exported chat
]
SHAREGPT = [   # a JSON array, as ShareGPT dumps are
    {"id": "a", "conversations": [{"from": "system", "value": "Be kind."},
                                  {"from": "human", "value": "Hello"},
                                  {"from": "gpt", "value": "Hi!"},
                                  {"from": "human", "value": "Tell me a joke"},
                                  {"from": "gpt", "value": "No."}]},
    {"id": "b", "conversations": [{"from": "human", "value": "Bye"}]},
]


def write_lines(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def test_each_format_reads_to_the_hand_written_prompts(tmp_path):
    chat = write_lines(tmp_path / "chat.jsonl", CHAT)
    assert read_prompts(chat) == [
        {"line": 1, "messages": [["user", "Hi there"]]},
        {"line": 2, "messages": [["system", "Be brief."], ["user", "Two parts"]]},
        {"line": 3, "messages": [["user", "2+2?"], ["assistant", "4"], ["user", "and 3+3?"]]},
    ]
    sharegpt = tmp_path / "share.json"
    sharegpt.write_text(json.dumps(SHAREGPT, indent=2))
    assert read_prompts(sharegpt, "sharegpt") == read_prompts(sharegpt) == [
        {"line": 1, "messages": [["system", "Be kind."], ["user", "Hello"], ["assistant", "Hi!"],
                                 ["user", "Tell me a joke"]]},
        {"line": 2, "messages": [["user", "Bye"]]},
    ]
    plain = tmp_path / "p.jsonl"
    plain.write_text('{"prompt": "first"}\n\n{"prompt": "third line", "extra": 1}\n')
    assert read_prompts(plain, "prompt") == [{"line": 1, "messages": [["user", "first"]]},
                                             {"line": 3, "messages": [["user", "third line"]]}]
    text = tmp_path / "prompts.txt"
    text.write_text("one prompt\n\n  another one  \n")
    assert read_prompts(text) == read_prompts(text, "text") == [
        {"line": 1, "messages": [["user", "one prompt"]]},
        {"line": 3, "messages": [["user", "another one"]]}]
    mixed = write_lines(tmp_path / "mixed.jsonl", [CHAT[0], SHAREGPT[1], {"prompt": "p"}])
    assert [r["messages"] for r in read_prompts(mixed)] == [[["user", "Hi there"]],
                                                            [["user", "Bye"]], [["user", "p"]]]


@pytest.mark.parametrize("name,content,fmt,fragment", [
    ("a.jsonl", '{"prompt": "ok"}\n{"prompt": "cut\n', "auto",
     "line 2 is not valid JSON (Unterminated string"),
    ("a.jsonl", '{"prompt": "ok"}\n[1, 2]\n', "auto", "line 2 is a JSON list, not an object"),
    ("a.jsonl", '{"prompt": "ok"}\n{"text": "x"}\n', "auto",
     "line 2 has none of the fields messages/conversations/prompt (['text'] found)"),
    ("a.jsonl", '{"prompt": ""}\n', "prompt", "line 1: prompt='' is not a non-empty string"),
    ("a.jsonl", '{"messages": [{"role": "assistant", "content": "x"}]}\n', "chat",
     "line 1 has no user turn to generate after"),
    ("a.jsonl", '{"messages": [{"role": "bot", "content": "x"}]}\n', "chat",
     "line 1: messages[0]: role='bot' is not one of system, user, assistant"),
    ("a.jsonl", '{"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}\n', "auto",
     "line 1: messages[0].content is not text"),
    ("a.jsonl", '{"messages": []}\n', "auto", "line 1: messages is not a non-empty list"),
    ("a.jsonl", '{"conversations": [{"from": "human"}]}\n', "sharegpt",
     "line 1: conversations[0] is not an object with 'from' and 'value'"),
    ("a.json", '[{"conversations": [{"from": "gpt", "value": "x"}]}]', "auto",
     "record 1 has no human turn to generate after"),
    ("a.jsonl", '{"prompt": "ok"}\n', "chat", "line 1 has none of the fields messages"),
    ("a.jsonl", "\n\n", "auto", "the file holds no prompts"),
    ("a.txt", "   \n", "auto", "the file holds no prompts"),
    ("a.jsonl", '{"prompt": "ok"}\n', "csv", "task.data.format='csv' is invalid: allowed are "
                                             "auto, chat, sharegpt, prompt, text"),
])
def test_a_malformed_file_is_refused_naming_its_line(tmp_path, name, content, fmt, fragment):
    path = tmp_path / name
    path.write_text(content)
    with pytest.raises(PromptFileError) as caught:
        read_prompts(path, fmt)
    text = str(caught.value)
    assert fragment in text and "\n" not in text, text
    assert fmt == "csv" or text.startswith(f"task.data.local='{path}': {path}") and \
        "allowed" in text


def refused(*overrides: str) -> str:
    """The one line the tuner's validation refuses ``+task=prompts <overrides>`` with."""
    from tuner.engines import validated
    with pytest.raises(ConfigError) as caught:
        validated(compose_cfg(None, *overrides, base=("+task=prompts", "models=tiny",
                                                      "method=speculative", "tracking=none")))
    assert "\n" not in str(caught.value)
    return str(caught.value)


def test_the_tuner_refuses_a_bad_prompt_file_before_anything_loads(tmp_path):
    (tmp_path / "bad.jsonl").write_text('{"prompt": "ok"}\n{"messages": "hello"}\n')
    assert refused("task.data.local=bad.jsonl").startswith(   # relative to where the tuner runs
        f"task.data.local='bad.jsonl': {tmp_path / 'bad.jsonl'} line 2: messages is not a "
        "non-empty list")
    assert "no such file" in refused("task.data.local=nowhere.jsonl")
    (tmp_path / "empty.jsonl").write_text("")
    assert "the file holds no prompts" in refused("task.data.local=empty.jsonl")
    assert "task.data.format=None with task.template='messages'" in \
        refused("task.data.format=null")
    assert "task.data.source='hub' is invalid for a prompt file" in refused("task.data.source=hub")


def test_an_empty_data_file_of_a_shipped_task_is_refused(tmp_path):
    """Any task's data file (here GSM8K's, replaced by an empty one): one line, no traceback."""
    from tuner.engines import validated
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(ConfigError, match=r"task.data.local='empty.jsonl': .*empty.jsonl holds no "
                                          r"records: allowed is one JSON object per line"):
        validated(compose_cfg(None, "task.data.local=empty.jsonl", "task.data.source=local"))


def settings(*overrides: str):
    from tuner.study.settings import StudySettings
    return StudySettings.from_config(compose_cfg(None, *overrides, base=(
        "+task=prompts", "models=tiny", "method=speculative", "tracking=none",
        "task.n_prompts=3", "task.n_held_out=2")))


def test_the_files_content_is_part_of_the_studys_identity(tmp_path):
    path = write_lines(tmp_path / "mine.jsonl", [{"prompt": f"question {i}"} for i in range(6)])
    first = settings("task.data.local=mine.jsonl")                # relative to where it runs
    assert first.fingerprint["task.data_sha256"] == json.dumps(
        hashlib.sha256(path.read_bytes()).hexdigest())
    assert first.name == settings("task.data.local=mine.jsonl").name   # resumable as it was
    ids = {p.id for p in first.tuning + first.held_out}
    assert ids <= {str(n) for n in range(1, 7)} and len(ids) == 5   # line numbers, disjoint
    write_lines(path, [{"prompt": f"question {i}!"} for i in range(6)])
    edited = settings("task.data.local=mine.jsonl")
    assert edited.name != first.name                              # same ids, another content


def test_a_shipped_task_has_no_content_key_so_old_studies_keep_their_names():
    from tuner.study.settings import StudySettings
    gsm8k = StudySettings.from_config(compose_cfg(None, "tracking=none"))
    assert "task.data_sha256" not in gsm8k.fingerprint


@pytest.mark.real_model
def test_a_multi_turn_record_is_answered_after_its_last_user_turn(default_pair, tmp_path):
    """With the target's chat template: the exported chat's trailing assistant answer is cut and
    the prompt ends with the assistant's opening, exactly as the template renders it."""
    path = write_lines(tmp_path / "chat.jsonl", CHAT)
    task = Task({"name": "prompts", "template": "messages", "max_new_tokens": 8,
                 "data": {"local": str(path), "format": "auto"}, "id_field": "line"})
    prompt = next(p for p in task.split(3, 0)[0] if p.id == "3")
    tokenizer = default_pair.tokenizer
    expected = tokenizer.apply_chat_template(
        [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"},
         {"role": "user", "content": "and 3+3?"}], add_generation_prompt=True, tokenize=True,
        return_dict=False)
    assert task.encode(prompt, tokenizer) == list(expected)
