"""The JupyterHub service: every user's kernels and GPUs for admins, actions on them, an idle policy.

Run by the Hub as a managed service (``python -m jupyter_gpumigrate_client.hub``; see examples/jupyterhub_config.py).
It finds users' servers through the Hub API and calls their ``/api/gpumigrate`` with a short-lived token of
each user, which it mints with its own (``tokens``); the Hub decides who may use it (the ``admin-ui`` or
``custom:gpumigrate:admin`` scope).
"""
