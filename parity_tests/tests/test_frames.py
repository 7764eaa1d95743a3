"""The user's own frames of a plugin's exception (``protocol/frames.py``)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from parity_tests.protocol.frames import is_library_file, is_tool_file, last_line, user_traceback


def _users_helper():
    json.loads("{")  # raises inside the standard library


def _users_code():
    try:
        _users_helper()
    except ValueError as e:
        raise KeyError("lr") from e


def test_a_chain_shows_each_exception_with_the_users_frames_and_counts_library_frames():
    with pytest.raises(KeyError) as info:
        _users_code()
    text = user_traceback(info.value)
    assert text.count("Traceback (most recent call last; the tool's frames left out):") == 2
    assert "The above exception was the direct cause of the following exception:" in text
    assert 'in _users_helper\n    json.loads("{")' in text and 'raise KeyError("lr") from e' in text
    assert "frames in libraries]" in text or "frame in libraries]" in text  # json's own frames, one line
    assert "json/decoder.py" not in text
    assert text.index("JSONDecodeError") < text.index("KeyError: 'lr'")  # the cause first, as Python prints
    assert last_line(info.value) == "KeyError: 'lr'"


def test_what_counts_as_the_tool_a_library_and_the_user():
    try:
        np.asarray([1, 2]).reshape(3)
    except ValueError as e:
        err = e
    assert user_traceback(err).count("File ") == 1  # this test's line: numpy's own frames are not shown
    assert is_tool_file(__import__("parity_tests.protocol.frames").protocol.frames.__file__)
    assert not is_tool_file(__file__)  # the tool's tests and their plugins are users' code
    assert is_library_file(np.__file__) and is_library_file(json.__file__) and is_library_file("<frozen runpy>")


def test_tools_frames_listed_inside_an_exception_message_are_left_out():
    tool = __import__("parity_tests.running.tf_worker").running.tf_worker.__file__
    message = (f'Graph execution error:\n\nDetected at node x defined at (most recent call last):\n'
               f'  File "<frozen runpy>", line 198, in _run_module_as_main\n\n'
               f'  File "{tool}", line 373, in <module>\n\n'
               f'  File "/home/me/my_towers.py", line 42, in train\n\nsome detail')
    try:
        raise RuntimeError(message)
    except RuntimeError as e:
        text = user_traceback(e)
    assert tool not in text and "<frozen runpy>" not in text
    assert '  File "/home/me/my_towers.py", line 42, in train\n\nsome detail' in text
