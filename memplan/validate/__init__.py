"""memplan validate: run a plan with the bundled trainer and compare with the estimate."""
