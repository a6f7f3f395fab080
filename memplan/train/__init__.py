"""The bundled sharded trainer (needs the ``train`` extra: torch). Import submodules lazily."""
