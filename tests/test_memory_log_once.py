"""Each planner message once, also when a trace worker logged it first."""

from __future__ import annotations

import dataclasses
import logging

import pytest

from trainlab.engine.debug import debug_run_config
from trainlab.memory.log_once import each_message_once, emitted_elsewhere
from trainlab.memory.trace_workers import TraceJob, _run_sent
from trainlab.recipes.var import VARRecipe


class _Kept(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


@pytest.fixture
def kept() -> logging.Handler:
    handler = _Kept()
    logging.getLogger().addHandler(handler)
    yield handler
    logging.getLogger().removeHandler(handler)


def test_a_message_is_kept_once_and_not_at_all_when_another_process_logged_it(kept: _Kept) -> None:
    log = logging.getLogger("trainlab.recipes.example")
    with each_message_once():
        emitted_elsewhere([("trainlab.recipes.example", logging.WARNING, "facts 2")])
        for text in ("facts 1", "facts 2", "facts 1", "other"):
            log.warning(text)
    log.warning("facts 1")  # outside: kept again
    assert kept.messages == ["facts 1", "other", "facts 1"]


def test_the_job_that_logs_the_facts_sends_back_what_it_logged() -> None:
    recipe = VARRecipe(debug_run_config(VARRecipe(VARRecipe.config_class())))
    job = TraceJob(2, 1, recipe.config.precision, checkpointing=False, count_flops=False)
    logger = logging.getLogger("trainlab.recipes.var")
    level = logger.level
    logger.setLevel(logging.INFO)
    try:
        quiet = _run_sent(VARRecipe, recipe.config, "cuda", job)
        loud = _run_sent(VARRecipe, recipe.config, "cuda", dataclasses.replace(job, logs_facts=True))
    finally:
        logger.setLevel(level)
    assert quiet[1] == []
    assert any(name == "trainlab.recipes.var" and "parameters" in text for name, _, text in loud[1])
    assert quiet[0].trace.records == loud[0].trace.records  # the same trace: the flag changes what comes back only
