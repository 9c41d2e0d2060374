"""``python -m jupyter_gpumigrate.engine.nodehelper``: the daemon, as ``jupyter-gpumigrate-helper``."""

from .daemon import main

if __name__ == "__main__":
    raise SystemExit(main())
