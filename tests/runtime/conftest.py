"""Fixtures shared by the runtime tests."""

import signal

import pytest


@pytest.fixture
def deadline():
    """Fail instead of hanging: a stuck test is a failing test."""
    signal.signal(signal.SIGALRM, lambda *_: pytest.fail("timed out: training hung"))
    signal.alarm(60)
    yield
    signal.alarm(0)
