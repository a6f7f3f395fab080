"""memplan inside other tools' loops: :mod:`memplan.integrations.transformers` (a ``Trainer`` callback)."""
