"""Command lines: the quickstart CLI, launch and recovery (``main``), the worker entry (``remote``), cluster tools."""
