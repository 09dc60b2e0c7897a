"""The `lora-rl` command line (`cli.main:main`): train, eval, serve, subscribe, adapters.

`main` holds the typer app and the entry point; `adapters` the `lora-rl adapters` commands;
`shutdown` the handling of SIGINT/SIGTERM/SIGHUP shared by every command.
"""
