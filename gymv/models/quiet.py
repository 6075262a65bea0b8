"""Keep transformers' own progress bars off gymv's stderr while it saves or loads tiny checkpoints."""

from __future__ import annotations

from contextlib import contextmanager


@contextmanager
def quiet_transformers():
    from transformers.utils import logging

    was_on = logging.is_progress_bar_enabled()
    logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_on:
            logging.enable_progress_bar()
