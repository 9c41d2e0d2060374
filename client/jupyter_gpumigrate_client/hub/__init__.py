"""The JupyterHub service: every user's kernels and GPUs for admins, actions on them, an idle policy.

Run by the Hub as a managed service (``python -m jupyter_gpumigrate_client.hub``; see examples/jupyterhub_config.py).
It finds users' servers through the Hub API and calls their ``/api/gpumigrate`` with its own token
(``access:servers``); the Hub decides who may use it (the ``custom:gpumigrate:admin`` scope).
"""
