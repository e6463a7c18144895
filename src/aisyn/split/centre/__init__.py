"""A compute centre serving many data owners: tenants, their batches through
one base, fair share, metrics and their endpoint, the server, and a
consortium's shared backbone.
"""
