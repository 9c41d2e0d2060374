"""JupyterHub with the jupyter-gpumigrate service: every user's kernels and GPUs for admins, and an idle
policy that suspends GPU kernels instead of culling them. Copy what you need into your jupyterhub_config.py.

Each node that runs users' servers needs what `jupyter gpumigrate doctor` checks: CRIU >= 4.2, root for
the single-user servers (for example in their own containers), and, for GPU moves, NVIDIA driver >= 580,
cuda-core and nvidia-ml-py in the servers' environment, with jupyter-gpumigrate installed there (its
server extension is enabled by installing it). The service itself needs only jupyter-gpumigrate and a
route to users' servers through the proxy.
"""

import sys

c = get_config()  # noqa: F821 - JupyterHub provides get_config

# Who may use the service: admins get this scope through the role below; give it to an operators'
# group the same way. Everyone else gets 403 from the service and learns nothing.
c.JupyterHub.custom_scopes = {
    "custom:gpumigrate:admin": {"description": "See, move, suspend and resume every user's kernels."},
}
c.JupyterHub.load_roles = [
    {
        "name": "gpumigrate-service",
        # Find users' servers, and mint for each user a short-lived token limited to that user's server
        # (tokens). The service's own token never goes to a user's server, which its user controls.
        "description": "What the service needs: find users' servers and call their /api/gpumigrate.",
        "scopes": ["list:users", "read:users:name", "read:servers", "access:servers", "tokens"],
        "services": ["gpumigrate"],
    },
    {
        "name": "gpumigrate-admin",
        "scopes": ["custom:gpumigrate:admin", "access:services!service=gpumigrate"],
        "users": ["admin"],  # and/or "groups": ["gpu-operators"]
    },
]
c.JupyterHub.services = [
    {
        "name": "gpumigrate",
        "display": True,  # in the Hub's Services menu
        "url": "http://127.0.0.1:10101",
        "command": [
            sys.executable, "-m", "jupyter_gpumigrate.hub",
            # Suspend GPU kernels idle for an hour, instead of culling them: their GPUs are freed and
            # their state kept; users resume them from the panel. 0 turns the policy off.
            "--idle-suspend-minutes", "60",
            # Where users' servers are reached: the Hub's public URL (through its proxy).
            "--proxy-url", "http://127.0.0.1:8000",
        ],
        "oauth_client_allowed_scopes": ["custom:gpumigrate:admin"],
    },
]
