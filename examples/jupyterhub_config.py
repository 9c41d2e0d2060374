"""JupyterHub with the jupyter-gpumigrate service: every user's kernels and GPUs for admins, and an idle
policy that suspends GPU kernels instead of culling them. Copy what you need into your jupyterhub_config.py;
docs/hub.md says what each node and the service need. tests/test_hub.py runs a real Hub from this file
(changing only ports, paths, test users, named servers, the service's timings and, in one test, the
environment the service runs from), so what it says here is what is tested.

Who may use the service:
- the Hub's admins (c.Authenticator.admin_users, or the admin page), through the `admin-ui` scope that
  JupyterHub's built-in admin role holds and no other role does by default: nothing to configure;
- operators who should not be Hub admins: members of the group "gpu-operators" below, through the
  custom scope `custom:gpumigrate:admin` that the role "gpumigrate-operators" gives them.
Anyone else gets 403 from the service and learns nothing about anyone's kernels.
"""

import sys

c = get_config()  # noqa: F821 - JupyterHub provides get_config

c.JupyterHub.custom_scopes = {
    "custom:gpumigrate:admin": {"description": "See, move, suspend and resume every user's kernels."},
}
c.JupyterHub.load_roles = [
    {
        "name": "gpumigrate-service",
        # Find users' servers (named ones too), and mint for each user a one-hour token limited to that
        # user's servers (`tokens`: a powerful scope, docs/hub.md). The service's own token never goes to
        # a user's server, which its user controls.
        "description": "What the service needs: find users' servers and call their /api/gpumigrate.",
        "scopes": ["list:users", "read:users:name", "read:servers", "access:servers", "tokens"],
        "services": ["gpumigrate"],
    },
    {
        # Operators: see and act on every user's kernels without being Hub admins. Add people to the group
        # (the Hub's admin page, its REST API, or c.JupyterHub.load_groups), or name them in "users".
        "name": "gpumigrate-operators",
        "description": "Use the gpumigrate service: every user's kernels and GPUs.",
        "scopes": ["custom:gpumigrate:admin", "access:services!service=gpumigrate"],
        "groups": ["gpu-operators"],
    },
]
c.JupyterHub.services = [
    {
        "name": "gpumigrate",
        "display": True,  # in the Hub's Services menu
        "url": "http://127.0.0.1:10101",
        "command": [
            sys.executable, "-m", "jupyter_gpumigrate_client.hub",
            # Where users' servers are reached: the Hub's public URL (through its proxy).
            "--proxy-url", "http://127.0.0.1:8000",
            # Suspend GPU kernels idle for an hour instead of culling them: their GPUs are freed and their
            # state kept; users resume them from the panel or by running a cell. 0 turns the policy off.
            # A kernel is also left alone for an hour after its last operation (--idle-grace-minutes).
            "--idle-suspend-minutes", "60",
            # Opt-in: an idle GPU kernel whose objects all carry goes on on the CPU instead (a transplant;
            # its user can go back to its GPU process for an hour). The others are suspended.
            # "--idle-to-cpu",
            # How long one user's server may take to answer before the page shows it as an error.
            "--server-timeout", "10",
        ],
        # What a login to the service's page may carry: Hub admins are let in by `admin-ui`, operators by
        # the custom scope. Without `admin-ui` here, a Hub admin could use the API with a token but not
        # the page.
        "oauth_client_allowed_scopes": ["custom:gpumigrate:admin", "admin-ui"],
        # An admins' tool run by the Hub: no "authorize this service" prompt at login.
        "oauth_no_confirm": True,
    },
]

# Users' servers (each user's jupyter_server, whatever the spawner): a server the Hub stops (an admin, the
# idle culler, the user) suspends its running kernels first, and its next start brings them back with
# their notebooks. Suspended kernels survive a stop under any policy. Give the spawner time for it:
# more than stop_timeout (docs/hub.md, "Stopping users' servers").
c.Spawner.args = ["--GPUMigrateApp.stop_policy=suspend", "--GPUMigrateApp.stop_timeout=100"]
c.LocalProcessSpawner.interrupt_timeout = 120  # SIGINT, then this long before SIGTERM
