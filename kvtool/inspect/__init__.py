"""`kvtool inspect`: what is in the store, read through the Mooncake master's admin endpoints.

One module per subcommand (keys, watermarks, prompt, store); each separates pure logic from the
I/O that feeds it, and returns a ``kvtool.report.Report`` (tables, or JSON with ``--format json``); the
commands are in ``kvtool/commands/inspect.py``.
"""
