"""The migration engine: CRIU, CUDA checkpoint, GPU inventory, process trees and plans.

Nothing in this package imports Jupyter; the provisioner, the server extension and the CLI are
adapters on top of it.
"""
