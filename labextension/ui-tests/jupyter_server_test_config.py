"""The server the UI tests drive: JupyterLab with jupyter-gpumigrate, Galata's test settings, no token."""

import tempfile

from jupyterlab.galata import configure_jupyter_server

configure_jupyter_server(c)  # noqa: F821 - c is the config object jupyter_server passes in
c.ServerApp.allow_root = True  # noqa: F821 - CI runs as root
c.ServerApp.ip = "127.0.0.1"  # noqa: F821
c.MigratableProvisioner.state_dir = tempfile.mkdtemp(prefix="gpumigrate-ui-")  # noqa: F821
c.MigratableProvisioner.suspend_to = "memory"  # noqa: F821 - the panel test checks that it says so
