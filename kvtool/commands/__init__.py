"""kvtool's commands, one module each; ``kvtool.cli`` builds the Typer app from them.

``options`` declares the flags several commands share (the pair's, the output's), ``output`` prints
what a command produces (tables or JSON, errors, exit codes).
"""
