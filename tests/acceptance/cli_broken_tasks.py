"""A task module that fails to import, as one with a bug does (``CLI_IMPORTS`` names it)."""

raise RuntimeError("the tasks' settings module is missing")
