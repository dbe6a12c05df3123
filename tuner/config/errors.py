"""User-facing errors: one line naming the setting, the value and what is allowed."""

from __future__ import annotations


class ConfigError(ValueError):
    """Bad input, found before anything expensive runs. The CLI prints it as one line."""


class StudyMismatch(ConfigError):
    """Resuming a study whose recorded settings differ from the requested ones."""


class Interrupted(KeyboardInterrupt):
    """Ctrl-C or SIGTERM (Slurm preemption) while a study ran; its state is saved."""
