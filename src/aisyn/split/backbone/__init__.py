"""The compute party B: its sessions and rounds, over ranks as pipeline stages,
and its checkpoint shares.
"""
