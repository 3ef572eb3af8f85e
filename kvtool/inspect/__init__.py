"""`kvtool inspect`: what is in the store, read through the Mooncake master's admin endpoints.

One module per subcommand (keys, watermarks, prompt, store); each separates pure logic from the
I/O that feeds it, and renders through ``output.Report`` (a Rich table, or JSON with ``--json``).
"""
