"""User-facing errors: one line naming the setting, the value and what is allowed."""

from __future__ import annotations


class ConfigError(ValueError):
    """Bad input, found before anything expensive runs. The CLI prints it as one line."""


class StudyMismatch(ConfigError):
    """Resuming a study whose recorded settings differ from the requested ones."""


class MeasurementRefused(ConfigError):
    """A measurement the tuner will not report (an A/A control beyond its bound, a confirmation
    beyond its physical bound twice): one line saying what was read and how to go on."""


class Interrupted(KeyboardInterrupt):
    """Ctrl-C or SIGTERM (Slurm preemption) while a study ran; its state is saved."""
