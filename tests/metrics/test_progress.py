"""The progress display: bar on a terminal, lines elsewhere, ETA from the step rate without the first step."""

import io
import logging

import pytest

from titan_npu.errors import ConfigError
from titan_npu.metrics.progress import EtaEstimator, Progress, format_duration, resolve_style


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_auto_style_is_bar_on_a_terminal_and_lines_otherwise():
    assert resolve_style("auto", Terminal()) == "bar"
    assert resolve_style("auto", io.StringIO()) == "lines"
    assert resolve_style("bar", io.StringIO()) == "bar"
    assert resolve_style("lines", Terminal()) == "lines"


def test_unknown_style_is_a_config_error():
    with pytest.raises(ConfigError, match="metrics.progress"):
        resolve_style("fancy")


@pytest.mark.parametrize("seconds, text", [(9.4, "9s"), (252, "4m12s"), (3725, "1h02m"), (float("inf"), "?")])
def test_durations_are_compact(seconds, text):
    assert format_duration(seconds) == text


def test_eta_comes_from_the_recent_step_rate():
    clock = FakeClock()
    eta = EtaEstimator(total_steps=100, clock=clock)
    assert eta.eta_seconds() is None
    for step in range(1, 11):
        clock.now += 2.0
        eta.update(step)
    assert eta.seconds_per_step() == pytest.approx(2.0)
    assert eta.eta_seconds() == pytest.approx(180.0)


def test_first_step_does_not_inflate_the_eta():
    clock = FakeClock()
    prog = Progress("lines", total_steps=20, stream=io.StringIO(), clock=clock)
    clock.now += 60.0  # start-up / compilation
    prog.update(1)
    for step in range(2, 11):
        clock.now += 1.0
        prog.update(step)
    assert prog.eta_seconds() == pytest.approx(10.0)


def test_bar_draws_in_place_with_eta_and_loss():
    clock = FakeClock()
    term = Terminal()
    prog = Progress("bar", total_steps=10, stream=term, clock=clock)
    for step in range(1, 6):
        clock.now += 1.0
        prog.update(step, loss=2.5)
    text = term.getvalue()
    assert text.startswith("\r\x1b[K")
    last = text.split("\r\x1b[K")[-1]
    assert last.startswith("step 5/10 [############------------]  50%")
    assert "1 s/it eta 5s loss 2.5000" in last
    prog.close()
    assert term.getvalue().endswith("\n")


def test_log_records_erase_the_bar_first():
    clock = FakeClock()
    term = Terminal()
    logger = logging.getLogger("titan_npu")
    out = io.StringIO()
    handler = logging.StreamHandler(out)
    saved = logger.handlers[:], logger.level
    logger.handlers[:] = [handler]
    logger.setLevel(logging.INFO)
    try:
        prog = Progress("bar", total_steps=10, stream=term, clock=clock)
        prog.update(1)
        before = term.getvalue()
        logger.info("[Step 1] loss=1.0")
        assert term.getvalue() == before + "\r\x1b[K"
        prog.close()
        logger.info("after close")
        assert term.getvalue() == before + "\r\x1b[K"  # no longer intercepting
    finally:
        logger.handlers[:], level = saved
        logger.setLevel(level)


def test_lines_style_and_other_ranks_draw_nothing():
    term = Terminal()
    Progress("lines", 10, stream=term).update(1)
    Progress("bar", 10, enabled=False, stream=term).update(1)
    assert term.getvalue() == ""
