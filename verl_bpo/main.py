"""``python -m verl_bpo.main``: the documented launch command (see :mod:`verl_bpo.integration.main`)."""

from verl_bpo.integration.main import main

if __name__ == "__main__":
    main()
