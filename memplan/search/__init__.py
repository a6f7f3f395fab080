"""The plan search behind ``memplan tune``: the space of valid plans (``space``), each plan's
predicted memory and speed (``evaluate``), an Optuna study over them (``study``), validation
runs of the best plans (``validation``) and their calibration (``calibration``).

Only ``study`` and ``tune`` import optuna; the rest is pure Python and light to import.
"""
