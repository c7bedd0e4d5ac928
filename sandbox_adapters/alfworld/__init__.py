"""ALFWorld: the real text engine with a fast SAS snapshot (``sandbox``), and our generator of ALFRED-format
problems turned into games by the real ``alfworld-generate`` (``gen``)."""

from sandbox_adapters.alfworld.sandbox import ALFWorldSandbox, game_walkthrough, resolve_games_dir

__all__ = ["ALFWorldSandbox", "game_walkthrough", "resolve_games_dir"]
