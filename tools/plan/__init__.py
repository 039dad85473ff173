"""The planner (`python -m tools.plan`): its subcommands' code, one module each, and data/ (cost files,
cluster figures, recorded validations, published setups)."""
