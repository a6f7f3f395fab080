"""The command line: typer commands, thin over the library."""
