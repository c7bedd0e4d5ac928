"""hydra configs of verl_bpo.main (a package, so hydra can load them by module name)."""
