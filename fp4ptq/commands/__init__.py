"""The bodies of the ``fp4ptq`` commands, one module each (``quantize``, ``evaluate``: eval and compare,
``inspect_checkpoint``), over ``common`` (exit codes, ``CLIError``, shared helpers). ``fp4ptq/cli.py``
parses the command line, calls them and maps errors to exit codes."""
