"""The CPU demo (``python -m verl_bpo.demo``): a tiny model built locally, an embedded sandbox, verl's trainer."""
