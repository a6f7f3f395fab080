"""The analytic cost model: pure functions of the specs, standard library only."""
