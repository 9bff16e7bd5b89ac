"""A user's own Lightning project: a model and a DataModule that know nothing of lit_speed (see ../README.md)."""
